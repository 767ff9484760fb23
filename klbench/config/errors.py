"""The one error type of a bad config value, shared by every layer that finds one: the schema before
anything is imported, and the models once they know what the config alone cannot tell (a model's context,
a prompt's length). The CLI prints it as one line, `klbench: error: <field> ...`, without a traceback."""
import errno
import os


class ConfigError(ValueError):
    """A config value no run can use; the message names the field."""


class MissingInput(ConfigError, FileNotFoundError):
    """A file or folder a config value names that is missing, or is not what the setting needs (a model
    folder without a model, a checkpoint klbench did not write). A FileNotFoundError too, as callers of the
    loaders caught before it existed."""


# where the cache is: said in every line about it (klbench.models.embedded.cache resolves it)
CACHE_WHERE = "$KLBENCH_CACHE, else $XDG_CACHE_HOME/klbench, else ~/.cache/klbench; paths.cache="


class CacheUnusable(ConfigError):
    """The cache cannot hold what a run must write there (a file where its folder should be, a read-only
    folder, a full disk), or what it holds cannot be read: one line naming the folder and what to do."""


def unusable(folder: str, doing: str, e: OSError) -> CacheUnusable:
    """The one line for an OSError met while `doing` (e.g. "build the embedded reference LM") in `folder`."""
    if isinstance(e, (NotADirectoryError, FileExistsError)) or e.errno in (errno.ENOTDIR, errno.EEXIST):
        why = f"{file_above(e.filename or folder)} is a file, not a folder"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = f"{e.filename or folder} cannot be written ({e.strerror})"
    else:
        why = e.strerror or str(e)
    return CacheUnusable(f"the klbench cache {folder} ({CACHE_WHERE}) cannot {doing}: {why}; point KLBENCH_CACHE at a "
                         "folder you can write")


def file_above(path: str) -> str:
    """The file that stands where `path` or one of the folders above it should be (else `path`)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p if os.path.exists(p) and not os.path.isdir(p) else path
