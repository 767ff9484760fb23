"""The sweep's Optuna study: resumed instead of duplicated, the trials a dead sweep left RUNNING settled,
and the budget counted over every invocation of the same command. The sweep's process reaches the study
through klbench.sweep.storage, which waits out a briefly unreachable database.

The Optuna sweeper plugin offers none of this, so it is done around it: by editing the config the
plugin is built from (Hydra instantiates the sweeper after the callbacks' on_multirun_start), through
its private API (`hydra_plugins.hydra_optuna_sweeper._impl`, in study_total) and by wrapping
GridSampler.after_trial. These are the places to look at when the plugin or Optuna is upgraded.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, read_write

from klbench.record.redact import redact, redact_obj
from klbench.sweep.orphans import RETRY_OF, STUDY_PARENT, STUDY_SWEEP_DIR, job_folders, settle_orphans, trial_runs

log = logging.getLogger(__name__)

STUDY_SETUP = "klbench.setup"  # study user attr: what its trials run (the others: klbench.sweep.orphans)


def tolerate_grid_stop() -> None:
    """Optuna's GridSampler calls study.stop() after the trial that completes the grid, and stop() raises
    outside study.optimize. The sweeper plugin catches that for a completed trial but not for a failed
    one, so a sweep whose last grid trial failed exited 1 though every result was recorded. Only that
    one error is swallowed, and only in the sweep's own process."""
    import optuna
    grid = optuna.samplers.GridSampler
    if getattr(grid.after_trial, "_klbench", False):
        return
    original = grid.after_trial

    def after_trial(self, study, trial, state, values):
        try:
            original(self, study, trial, state, values)
        except RuntimeError as e:
            if "Study.stop" not in str(e):
                raise

    after_trial._klbench = True
    grid.after_trial = after_trial


def prepare_study(config: DictConfig):
    """Opens the sweep's study, closes trials a dead sweep left RUNNING and re-queues their parameters,
    and turns `hydra.sweeper.n_trials` into the study's total: this invocation runs what is missing.

    Hydra instantiates the sweeper after this callback, so the budget is set by editing the config.
    """
    sw = config.hydra.sweeper
    name, storage = sw.get("study_name"), sw.get("storage")
    if name and not storage and OmegaConf.select(config, "store.kind") == "server":
        # a single run never opens the study, so the schema lets store.optuna be null; a sweep needs it
        from klbench.config.schema import OPTUNA_URL, ConfigError
        raise ConfigError(f"store.optuna must be {OPTUNA_URL}: a sweep with store=server keeps its Optuna "
                          "study there, got null")
    if not (name and storage and "n_trials" in sw):
        return None  # not the Optuna sweeper, or an in-memory study: nothing to resume
    import optuna
    from optuna.trial import TrialState

    from klbench.sweep import jobs
    from klbench.sweep import storage as resilient
    from klbench.record.store import open_optuna
    open_optuna(storage)  # a fresh optuna.db: created by one sweep while others wait
    resilient.install(storage)
    dirs = sw.direction if OmegaConf.is_list(sw.direction) else [sw.direction]
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                directions=[getattr(d, "name", str(d)) for d in dirs])
    # what the trials run: the command line's task overrides and the search space (a password in a URL
    # there is not kept: the same command with another password is the same sweep)
    setup = redact_obj({"overrides": sorted(config.hydra.overrides.task),
                        "params": {k: str(v) for k, v in (sw.get("params") or {}).items()}})
    first = study.user_attrs.get(STUDY_SETUP)
    if first is None:
        study.set_user_attr(STUDY_SETUP, setup)
    elif redact_obj(first) != setup:  # a study an older klbench recorded with the password
        raise ValueError(f"study {name!r} in {redact(storage)} was run with {redact_obj(first)}, "
                         f"this sweep has {setup}; "
                         "repeat the original command to resume it, or start a new study with "
                         "hydra.sweeper.study_name=<new name>")
    outputs, shown = Path(config.paths.outputs), redact(storage)
    if stale := study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # only a sweep process that died leaves RUNNING trials behind (restart after it has exited)
        folders = job_folders(config, study, jobs.recorded_sweep_dir(outputs, name, shown))
        for folder in folders:
            jobs.wait(folder / ".submitit")
        settle_orphans(study, stale, folders, trial_runs(config, study),
                       list(config.get("optimized_metrics") or ()))
    jobs.record_sweep_dir(outputs, name, shown, Path(config.hydra.sweep.dir))
    study.set_user_attr(STUDY_SWEEP_DIR, str(config.hydra.sweep.dir))
    trials = study.get_trials(deepcopy=False)
    done = finished(trials)
    total = study_total(config)
    set_hydra_value(config, "sweeper.n_trials", max(0, total - done))
    seed = sw.get("sampler", {}).get("seed")
    if trials and seed is not None:
        # the sampler restarts with every invocation: with the first invocation's seed its random
        # start-up trials would propose the same points again. Offset by the study's size, so a rerun
        # of the same command still proposes the same (new) points.
        set_hydra_value(config, "sweeper.sampler.seed", int(seed) + len(trials))
    log.info("study %r: %d of %d trials finished, running %d", name, done, total, sw.n_trials)
    return study


def set_hydra_value(config: DictConfig, key: str, value) -> None:
    """Sets hydra.<key> as if given on the command line: Hydra rebuilds every trial's config from the
    command-line overrides and refuses trials whose hydra.sweeper differs from the sweeper's."""
    with read_write(config.hydra):
        OmegaConf.update(config.hydra, key, value)
        full = f"hydra.{key}"
        kept = [o for o in config.hydra.overrides.hydra if o.split("=", 1)[0].lstrip("+~") != full]
        config.hydra.overrides.hydra = kept + [f"{full}={value}"]


def study_total(config: DictConfig) -> int:
    """n_trials, capped at the grid size for the grid sampler (which repeats points beyond it)."""
    sw = config.hydra.sweeper
    total = int(sw.n_trials)
    if sw.get("sampler", {}).get("_target_") != "optuna.samplers.GridSampler":
        return total
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
    args = [f"{k}={v}" for k, v in (sw.params or {}).items()] + list(config.hydra.overrides.task)
    dists, fixed, _ = create_params_from_overrides(args)  # as the sweeper parses them
    if both := sorted(set(dists) & set(fixed)):
        # the plugin builds the grid before it drops fixed values: it would enumerate these anyway
        # and run the same point several times
        raise ValueError(f"{both} are grid dimensions in hydra.sweeper.params and fixed on the command "
                         "line; narrow the grid instead, e.g. 'hydra.sweeper.params={seed:\"choice(0)\"}'")
    return min(total, math.prod(len(OptunaSweeperImpl._to_grid_sampler_choices(d)) for d in dists.values()))


def failed_trials(study: tuple[str, str] | None) -> str:
    """The study's failed trials that no later trial re-ran, `#number {params}` each; "" without a study.
    Trials stopped by their config have no MLflow run: the study is where they are recorded."""
    if study is None:
        return ""
    import optuna
    from optuna.trial import TrialState
    st = optuna.load_study(study_name=study[0], storage=study[1])
    retried = {t.user_attrs.get(RETRY_OF) for t in st.trials}
    return "; ".join(f"#{t.number} {t.params}" for t in st.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                     if t.number not in retried)


def settle_stopped(config: DictConfig, study: tuple[str, str], cause: str) -> tuple[int, list[str]]:
    """At the end of a sweep stopped by a signal: its trials left RUNNING are settled as a resume would
    settle them (klbench.sweep.orphans.settle_orphans: a trial whose run finished is COMPLETE with its
    values, the others FAIL, their parameters queued to run again), so none stays RUNNING. Trials whose
    SLURM or submitit jobs still run are left RUNNING: the rerun waits for those jobs and takes their results.
    Returns the study's finished trials (those no later trial re-runs) and the ids of the jobs still running."""
    import optuna
    from optuna.trial import TrialState

    from klbench.sweep import jobs
    st = optuna.load_study(study_name=study[0], storage=study[1])
    sweep_dir = Path(config.hydra.sweep.dir).resolve()
    running = jobs.alive(sweep_dir / ".submitit")
    if not running and (stale := st.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
        settle_orphans(st, stale, [sweep_dir], trial_runs(config, st), list(config.get("optimized_metrics") or ()),
                       cause=cause)
    return finished(st.get_trials(deepcopy=False)), running


def finished(trials: list) -> int:
    """How many of the study's trials are done: finished, and not re-run by a later trial (RETRY_OF)."""
    retried = {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}
    return sum(t.state.is_finished() and t.number not in retried for t in trials)
