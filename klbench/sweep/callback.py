"""The sweeps' Hydra callback, a facade over the modules of klbench.sweep.

Enabled by the sweep configs (sweeps/sweep_common.yaml, `hydra.callbacks.sweep_tracking`). `on_multirun_*`
run in the sweeper's process; `on_job_*` run in each trial's process, which is the same process with
the basic launcher, a fresh one with submitit, another machine with SLURM. The two sides therefore
talk only through files in the sweep folder and environment variables that the sweep configs read:
`logger.parent_run_id: ${oc.env:KLBENCH_PARENT_RUN_ID,null}`, `ckpt_path: ${oc.env:KLBENCH_RESUME_CKPT,null}`.
"""
from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from klbench.sweep import parent, signals, study, trial

log = logging.getLogger(__name__)


class SweepTracking(Callback):
    """Holds only strings: submitit pickles this object into every trial after on_multirun_start."""

    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.tracking_uri: str | None = None
        self.study: tuple[str, str] | None = None  # (name, storage)

    def __getstate__(self) -> dict:
        # submitit pickles this object into every trial's job file in the sweep folder; the URLs (which may
        # carry passwords) are the sweeper's business only, so they stay out of those files
        return {**self.__dict__, "tracking_uri": None, "study": None}

    # ---- sweeper side ----

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from klbench.console import messages as console
        console.setup()  # e.g. the sweeper's unlabelled result lines: on_multirun_end prints them labelled
        study.tolerate_grid_stop()
        try:
            self._start(config)
            if self.parent_run_id is not None:
                # the plugin can end a sweep with an exception (too many failed trials in a batch),
                # and then Hydra skips on_multirun_end: the parent run must not stay RUNNING
                atexit.register(self._abandoned)
        except Exception as e:
            # Hydra downgrades callback exceptions to warnings; a sweep that would mix into another
            # study, or whose trials could not be tracked, must not start.
            raise SystemExit(f"klbench sweep: {type(e).__name__}: {e}") from e

    def _start(self, config: DictConfig) -> None:
        Path(config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
        os.makedirs(config.paths.outputs, exist_ok=True)  # SQLite creates no folders
        n_trials = config.hydra.sweeper.get("n_trials")  # as given: prepare_study turns it into what is missing
        st = study.prepare_study(config)
        if st is not None:
            self.study = (st.study_name, str(config.hydra.sweeper.storage))
        if config.logger.get("kind") != "mlflow":
            log.info("logger.kind=%s: no MLflow parent run for this sweep", config.logger.get("kind"))
            return
        self.tracking_uri = config.logger.tracking_uri
        self.parent_run_id = parent.open_parent(config, st, n_trials)

    def _abandoned(self) -> None:
        parent.abandon(self.tracking_uri, self.parent_run_id)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        parent.print_pareto_trials(sweep_dir, list(config.get("optimized_metrics") or ()))
        if self.parent_run_id is None:
            parent.print_sweep_where(sweep_dir)
            return
        atexit.unregister(self._abandoned)
        from mlflow import MlflowClient
        client = MlflowClient(self.tracking_uri)
        try:
            parent.finish(client, config, self.parent_run_id, self.study)
        except Exception:
            parent.fail(client, self.parent_run_id)
        parent.print_sweep_where(sweep_dir, client, self.parent_run_id, self.tracking_uri)

    # ---- trial side ----

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        trial.start(config)
        if os.environ.get("SUBMITIT_EXECUTOR"):
            signals.requeue_outside_database()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            trial.end(config, job_return)
