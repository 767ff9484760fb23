"""The one error type of a bad config value, shared by every layer that finds one: the schema before
anything is imported, and the models once they know what the config alone cannot tell (a model's context,
a prompt's length). The CLI prints it as one line, `klbench: error: <field> ...`, without a traceback."""


class ConfigError(ValueError):
    """A config value no run can use; the message names the field."""
