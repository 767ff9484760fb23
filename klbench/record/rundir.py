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
"""
from __future__ import annotations

import os

MAX_TRIES = 10_000  # distinct names per base name; a folder holding more is not a race but a loop


def claim(base: str) -> str:
    """`base`, or the first free `base-N`, created by this call and by no other process."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    for n in range(1, MAX_TRIES + 1):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"{MAX_TRIES} run folders named {base}[-N] exist already; choose hydra.run.dir yourself")
