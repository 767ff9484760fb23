"""The sweep's Optuna study: resumed instead of duplicated, the trials a dead sweep left RUNNING settled,
and the budget counted over every invocation of the same command.

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

log = logging.getLogger(__name__)

STUDY_PARENT = "klbench.mlflow_parent_run_id"  # study user attrs
STUDY_SETUP = "klbench.setup"
STUDY_SWEEP_DIR = "klbench.sweep_dir"  # the folder of the study's latest invocation
RETRY_OF = "klbench.retry_of"  # trial user attr: number of the interrupted trial this one re-runs


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
    if not (name and storage and "n_trials" in sw):
        return None  # not the Optuna sweeper, or an in-memory study: nothing to resume
    import optuna
    from optuna.trial import TrialState
    dirs = sw.direction if OmegaConf.is_list(sw.direction) else [sw.direction]
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                directions=[getattr(d, "name", str(d)) for d in dirs])
    # what the trials run: the command line's task overrides and the search space
    setup = {"overrides": sorted(config.hydra.overrides.task),
             "params": {k: str(v) for k, v in (sw.get("params") or {}).items()}}
    first = study.user_attrs.get(STUDY_SETUP)
    if first is None:
        study.set_user_attr(STUDY_SETUP, setup)
    elif first != setup:
        raise ValueError(f"study {name!r} in {storage} was run with {first}, this sweep has {setup}; "
                         "repeat the original command to resume it, or start a new study with "
                         "hydra.sweeper.study_name=<new name>")
    if stale := study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # only a sweep process that died leaves RUNNING trials behind (restart after it has exited)
        settle_orphans(study, stale, study.user_attrs.get(STUDY_SWEEP_DIR))
    study.set_user_attr(STUDY_SWEEP_DIR, str(config.hydra.sweep.dir))
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}
    done = sum(t.state.is_finished() and t.number not in retried for t in trials)
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


def settle_orphans(study, stale: list, sweep_dir: str | None) -> None:
    """Closes the trials a dead sweep process left RUNNING, without running any of them twice.

    Their jobs outlive that process (SLURM array jobs, submitit's local processes): wait for those still
    pending or running, then take each trial's result from its job's result file, as the sweeper would
    have. A trial whose job left no result (never started, or killed) is marked FAIL and its parameters
    run again; one whose job raised is marked FAIL, as the sweeper marks it.
    """
    from optuna.trial import TrialState

    from klbench import jobs
    returns = jobs.wait_and_collect(Path(sweep_dir) / ".submitit") if sweep_dir else []
    for t in stale:
        wanted = {f"{k}={v}" for k, v in t.params.items()}
        ret = next((r for r in returns if wanted <= set(r.overrides)), None)
        if ret is not None:
            returns.remove(ret)
        values = jobs.objective_values(ret, len(study.directions)) if ret is not None else None
        if values is not None:
            study.tell(t.number, values=values)
            log.warning("trial %d finished after its sweep process died: result %s taken from its job",
                        t.number, values)
        elif ret is not None:
            study.tell(t.number, state=TrialState.FAIL)
            log.warning("trial %d failed after its sweep process died (see its job's log)", t.number)
        else:
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={RETRY_OF: t.number})
            log.warning("trial %d was interrupted: marked FAIL, its parameters %s run again", t.number, t.params)


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
