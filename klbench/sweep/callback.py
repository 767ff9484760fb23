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
import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from klbench.record import interrupts
from klbench.record.redact import redact
from klbench.sweep import jobs, nodes, parent, requeue, signals, study, trial

log = logging.getLogger(__name__)


class SweepTracking(Callback):
    """Holds only strings: submitit pickles this object into every trial after on_multirun_start."""

    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.tracking_uri: str | None = None
        self.study: tuple[str, str] | None = None  # (name, storage)
        self.n_trials: int | None = None  # the study's total, as this invocation was given it
        self.refused = False  # another process runs this study: this one ends at once, saying so

    def __getstate__(self) -> dict:
        # submitit pickles this object into every trial's job file in the sweep folder; the URLs (which may
        # carry passwords) are the sweeper's business only, so they stay out of those files
        return {**self.__dict__, "tracking_uri": None, "study": None}

    # ---- sweeper side ----

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from klbench.console import messages as console
        console.setup()  # e.g. the sweeper's unlabelled result lines: on_multirun_end prints them labelled
        interrupts.install()  # Ctrl-C or SIGTERM: the sweep ends KILLED (on_multirun_end)
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
            self.refused = isinstance(e, (jobs.StudyBusy, nodes.NodesError))  # nothing of this sweep exists
            raise SystemExit(f"klbench sweep: {type(e).__name__}: {e}") from e

    def _start(self, config: DictConfig) -> None:
        nodes.check(config)  # a multi-node job SLURM cannot start: one line before anything exists
        requeue.install()  # a job requeued after a node failure stays the trial's (submitit took it as ended)
        sw = config.hydra.sweeper
        if sw.get("study_name") and sw.get("storage"):  # first: a refused sweep leaves nothing behind
            jobs.claim(Path(config.paths.outputs), sw.study_name, redact(str(sw.storage)))
        Path(config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
        os.makedirs(config.paths.outputs, exist_ok=True)  # SQLite creates no folders
        n_trials = config.hydra.sweeper.get("n_trials")  # as given: prepare_study turns it into what is missing
        if n_trials is not None:
            self.n_trials = study.study_total(config)
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
        if self.refused:  # its one line said it all; the study and its folder are the other process's
            return
        try:
            self._end(config)
        finally:
            jobs.release_claims()

    def _end(self, config: DictConfig) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        # Hydra calls this in a `finally`: what ends the sweep is the exception being handled, if any
        if (sig := interrupts.signal_of(stop := sys.exc_info()[1])) is not None:
            interrupts.release(stop)
            self._stopped(config, sweep_dir, sig)
            raise interrupts.Stopped(sig)  # exit status 128 + sig, and no traceback
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
        if why := parent.failed_why(client, self.parent_run_id):  # a sweep without its frontier did not succeed
            raise SystemExit(f"klbench sweep: error: the sweep's parent run {self.parent_run_id} ended FAILED, "
                             f"with no frontier: {why}")

    def _stopped(self, config: DictConfig, sweep_dir: Path, sig: int) -> None:
        """A sweep stopped by a signal: its Optuna trials settled (klbench.sweep.study.settle_stopped), its
        parent run KILLED, and a console block that says how far it got and how to finish it."""
        atexit.unregister(self._abandoned)
        how = f"by {interrupts.name(sig)}"
        done, running = study.settle_stopped(config, self.study, f"the sweep was stopped {how}") \
            if self.study is not None else (None, [])
        if done is not None:
            how += f" after {done}{'' if self.n_trials is None else f' of {self.n_trials}'} trials finished"
        if running:
            how += (f"; the jobs {', '.join(running)} still run, and their trials stay RUNNING until the rerun, "
                    "which waits for them")
        again = "klbench " + " ".join(map(shlex.quote, sys.argv[1:]))
        client = None
        if self.parent_run_id is not None:
            from mlflow import MlflowClient
            client = MlflowClient(self.tracking_uri)
            parent.stop(client, self.parent_run_id, f"interrupted: {how}")
        parent.print_sweep_where(sweep_dir, client, self.parent_run_id, self.tracking_uri or "",
                                 stopped=f"{how}; to finish it, run the same command again: {again}")

    # ---- trial side ----

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        interrupts.raise_noted()  # a signal the last trial's training let pass: the sweep stops, not goes on
        trial.start(config)
        if os.environ.get("SUBMITIT_EXECUTOR"):
            signals.requeue_outside_database()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            trial.end(config, job_return)
