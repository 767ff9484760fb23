"""The one error type of a bad config value, shared by every layer that finds one: the schema before
anything is imported, and the models once they know what the config alone cannot tell (a model's context,
a prompt's length). The CLI prints it as one line, `klbench: error: <field> ...`, without a traceback."""


class ConfigError(ValueError):
    """A config value no run can use; the message names the field."""


class MissingInput(ConfigError, FileNotFoundError):
    """A file or folder a config value names that is missing, or is not what the setting needs (a model
    folder without a model, a checkpoint klbench did not write). A FileNotFoundError too, as callers of the
    loaders caught before it existed."""
