"""One folder per run, even for runs started in the same second.

Hydra names a run folder (and a sweep folder) after the time to the second, so parallel starts got
the same folder and shared its `mlflow_run_id.txt` and `last.ckpt`: a later resume continued the
wrong run. The `klbench_claim` resolver (conf/config.yaml: hydra.run.dir, hydra.sweep.dir) turns the
time-stamped name into a folder this process has created itself, with `os.mkdir`, which fails for
every process but one: the others take `<name>-2`, `<name>-3`, ...

The resolver is cached (like Hydra's `now`), and the cache travels with the config into a sweep's
trial processes (Hydra copies it; submitit pickles it), so a process claims once and its trials find
the same folder. A folder named on the command line (`hydra.run.dir=...`, e.g. to resume) is used as
given: the resolver is never called. No torch, Lightning or Hydra here.

Hydra saves the config a run started with into <run folder>/.hydra at every start, a resume's too, so
a resume refused for a changed config used to overwrite the files that describe the run. The
`klbench_config_subdir` resolver (hydra.output_subdir) keeps `.hydra` for a folder's first start and
gives every later one a folder of its own, `.hydra/attempt-<time>[-N]`.
"""
from __future__ import annotations

import os
import time

MAX_TRIES = 10_000  # distinct names per base name; a folder holding more is not a race but a loop
# the folders this process created by claiming, outermost first: a run stopped before it started removes
# these and no other (never the user's own outputs folder, nor the target of a symlink to it)
created: list[str] = []


def claim(base: str) -> str:
    """`base`, or the first free `base-N`, created by this call and by no other process."""
    parent, missing = os.path.abspath(os.path.dirname(base) or "."), []
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    for n in range(1, MAX_TRIES + 1):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        created.extend([*reversed(missing), os.path.abspath(path)])
        return path
    raise RuntimeError(f"{MAX_TRIES} run folders named {base}[-N] exist already; choose hydra.run.dir yourself")


def config_subdir(output_dir: str) -> str:
    """hydra.output_subdir, relative to the run folder `output_dir`: `.hydra` where no run has started yet,
    else a new `.hydra/attempt-<time>[-N]` of this process (claimed, so parallel attempts get one each)."""
    if not os.path.isfile(os.path.join(output_dir, ".hydra", "config.yaml")):
        return ".hydra"
    base = os.path.join(output_dir, ".hydra", time.strftime("attempt-%Y-%m-%d_%H-%M-%S"))
    return os.path.relpath(claim(base), output_dir)
