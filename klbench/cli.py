"""`klbench`: the Hydra entry point. Returns (val/reward, val/seq_kl) for the Optuna sweeper.

The config is checked (klbench.config.schema) before torch, Lightning or MLflow are imported, so a bad value
fails at once (measured: docs/record.md, "Every bad value is stopped"), leaves no MLflow run and no run folder.
A run stopped by SIGTERM or Ctrl-C exits 143 or 130 after one line with its folder and its resume command
(klbench.record.interrupts; docs/record.md, "A stopped job says so").
"""
from __future__ import annotations

import gc
import os
import re
import shlex
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from klbench.record import interrupts

if __name__ == "__main__" or Path(sys.argv[0]).name == "klbench":  # the command, not a test importing this
    interrupts.install(early=True)  # Ctrl-C while Hydra loads: one line too

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from klbench.config.resolvers import ROOT, register
from klbench.record import store
from klbench.record.redact import redact, redact_exception

register()  # the klbench_* resolvers conf/ uses (klbench/config/resolvers.py)


def main() -> None:
    """The `klbench` command: the Hydra app below, with what Hydra cannot compose told in klbench's one line."""
    from klbench.console import pipes
    pipes.guard()  # `klbench | head -1`: the run goes on when its reader goes away (issue 50)
    check_environment_first()
    with _composition_errors_in_one_line():
        app()


def check_environment_first() -> None:
    """The KLBENCH_* values klbench parses, before Hydra starts: in a sweep, check(cfg) would fail each trial in
    turn and the sweep's parent FAILED (issue 50). KLBENCH_OPTUNA_RETRY_S (a sweep on a server store reads it) is
    parsed by the sweep's own reader, whose import (Optuna) is paid only when it is set."""
    from klbench.console.env_checks import check_environment
    try:
        check_environment()
        if os.environ.get("KLBENCH_OPTUNA_RETRY_S", "").strip():
            from klbench.sweep.storage import retry_budget
            retry_budget()
    except ValueError as e:
        fail(str(e))


@contextmanager
def _composition_errors_in_one_line():
    """Hydra reports a composition error itself (hydra._internal.utils.run_and_report, around each of its
    steps) and exits 1: for a required group's unknown option (`estimator=rbb`) a 26-line block, for an unknown
    key (`task.max_step=20`) the advice to add it with `+`, which would compose a key nothing reads. Hydra has
    no hook for this, so while the app runs its reporter first asks klbench.config.choices for one line
    (the valid names, or the nearest key) and exits with it; what klbench cannot tell better, Hydra reports."""
    from hydra._internal import utils as hydra_utils
    from hydra.errors import ConfigCompositionException
    report = hydra_utils.run_and_report

    def run_and_report(func):
        def told():
            try:
                return func()
            except ConfigCompositionException:
                from klbench.config.choices import explain_composition_error
                try:
                    args = hydra_utils.get_args_parser().parse_args(sys.argv[1:])
                    line = explain_composition_error(args.overrides, args.config_name or "config")
                except Exception:  # the explanation must never hide Hydra's own report
                    line = None
                if line:
                    raise SystemExit(f"klbench: error: {line}") from None
                raise
        return report(told)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = report


@hydra.main(config_path=str(ROOT / "conf"), config_name="config",
            execution_whitelist=("klbench.*",))
def app(cfg: DictConfig) -> tuple[float, float] | None:
    interrupts.install()  # first: Ctrl-C while torch loads is a stop too, not a traceback
    # One job, then the process exits (a sweep's in-process jobs keep Python's collector as it is). Its cyclic
    # garbage collector would otherwise traverse every object torch, Lightning and transformers create: 0.7 s
    # of full collections while they import, and about 1.2 s at exit, where finalisation collects again, for
    # nothing (docs/console.md, "Start-up time"). So: no collection until they are imported, then those
    # objects frozen out of every later collection; frozen again once the job is over, the collector back on
    # (for a caller that goes on: a test calling main()).
    once = HydraConfig.get().mode == RunMode.RUN
    if once:
        gc.disable()
    try:
        return _main(cfg, once)
    except BaseException as e:
        if (sig := interrupts.signal_of(e)) is None:
            raise
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # the sweep stops too (klbench.sweep.callback)
            raise (e if isinstance(e, interrupts.Stopped) else interrupts.Stopped(sig)) from e
        print(f"klbench: {stopped_advice(e, sig, Path(cfg.paths.ckpt_dir) / 'last.ckpt')}", file=sys.stderr)
        sys.exit(128 + sig)
    finally:
        if once:
            gc.freeze()
            gc.enable()


def _main(cfg: DictConfig, once: bool = False) -> tuple[float, float] | None:
    decode_env_overrides(cfg)
    try:
        check(cfg)
    except ValueError as e:
        redact_exception(e)
        _discard_run_folder()
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # fails this trial only; the sweep records it and goes on
        fail(str(e))
    from klbench.tasks.train import run_task  # first: it imports Lightning without what klbench never uses (lean.py)
    from klbench.record.resume import ResumeError
    from klbench.config.schema import ConfigError
    from klbench.record.lifecycle import RecordUnavailable, store_failure
    from klbench.tasks import TRAINING
    if once:  # torch and Lightning are in: what they made stays out of the collector's way (main)
        gc.freeze()
        gc.enable()
    try:
        metrics = run_task(cfg)
    except Exception as e:  # what the user can act on is said in one line, with what to do
        redact_exception(e)  # whatever prints it next (Hydra, a sweep's log) shows no password
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        if isinstance(e, RecordUnavailable):
            fail(unavailable_advice(e, Path(cfg.paths.ckpt_dir) / 'last.ckpt'))
        if isinstance(e, (ResumeError, store.StoreError, ConfigError)):  # ConfigError: found once models load
            _discard_run_folder()  # stopped before its record began: only Hydra's files are there
            fail(str(e))
        if why := store_failure(e, str(OmegaConf.select(cfg, "logger.tracking_uri", default="") or "")):
            fail(f"{why}; no run was recorded: start it again once the store is back")
        if isinstance(e, FloatingPointError):  # non-finite logits, a NaN metric: the message names the cause
            fail(str(e).splitlines()[0])
        if isinstance(e, MemoryError):  # task.prompts_per_step=1000000000: a 23-line MemoryError (issue 50)
            t = cfg.task
            sizes = ", ".join(f"task.{k}={t[k]}" for k in ("prompts_per_step", "n_samples", "val_prompts",
                                                          "max_new_tokens", "micro_batch_size") if k in t)
            fail(f"out of memory building or running the run ({sizes}): lower the batch sizes (task.micro_batch_size "
                 "splits a step's batch without changing it)")
        raise
    if cfg.task.name not in TRAINING:  # a sweep's objective is a training run's (reward, KL)
        return None
    reward, kl = cfg.get("optimized_metrics") or ("val/reward", "val/seq_kl")  # experiment=arith: val/accuracy
    return metrics[reward], metrics[kl]


def fail(message: str) -> NoReturn:
    """Ends klbench with `klbench: error: <message>`, one line, exit code 1, no password in it."""
    sys.exit(f"klbench: error: {redact(message)}")


def check(cfg: DictConfig) -> None:
    """Everything that can be told from the config alone (no torch, no MLflow)."""
    from klbench.config.schema import ConfigError, validate
    from klbench.console.env_checks import check_environment
    check_environment()  # KLBENCH_PROGRESS_SECONDS=abc: one line now, not a FAILED run 40 s in (issue 50)
    hc = HydraConfig.get()
    check_deletions(cfg, hc.overrides.task)
    sweep = hc.runtime.choices.get("sweep")
    if sweep and hc.mode != RunMode.MULTIRUN:
        raise ConfigError(f"sweep={sweep} is a sweep: run it with -m (klbench -m sweep={sweep} ...); "
                         "without -m it would be a single run filed under the sweep's experiment")
    validate(cfg)
    if cfg.task.name != "pretrain":
        from klbench.config.model_checks import check_model_folders
        check_model_folders(cfg)  # a missing folder, a LoRA target no module has: before any model loads


def check_deletions(cfg: DictConfig, overrides) -> None:
    """`~task.lr`: a key of a group deleted. Every key of a group's option is read by the run (a KeyError of 43
    lines, a FAILED run, issue 50), so the deletion is refused in one line naming the declared default."""
    from klbench.config.schema import GROUPS, ConfigError, _tags
    for override in overrides:
        key = override[1:].split("=", 1)[0].strip() if override.startswith("~") else ""
        group, _, leaf = key.partition(".")
        if not leaf or group not in GROUPS:
            continue
        options, disc = GROUPS[group]
        model = _tags(options, disc).get(OmegaConf.select(cfg, f"{group}.{disc}")) if disc else options
        field = model.model_fields.get(leaf.split(".")[0]) if model is not None else None
        default = "" if field is None or field.is_required() or "." in leaf else f" (its default: {field.default!r})"
        raise ConfigError(f"{override}: {key} cannot be deleted, the run reads it{default}; leave it out of the "
                          f"command line for its default, or give {key}=<value>")


ENV_VALUE = re.compile(r"\$\{oc\.env:[^${}]*\}")


def decode_env_overrides(cfg: DictConfig) -> None:
    """`key=${oc.env:VAR,default}` on the command line takes the variable's value as the command line takes
    a value (`task.max_steps=30` is the integer 30): OmegaConf's oc.env gives the string '30', which the
    schema would refuse, so such a value is read through oc.decode, as Hydra's documentation advises."""
    for override in OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False):  # as typed
        key, _, value = override.partition("=")
        if ENV_VALUE.fullmatch(value.strip()):
            OmegaConf.update(cfg, key.lstrip("+~"), f"${{oc.decode:{value.strip()}}}", merge=False)


def unavailable_advice(e, ckpt: Path) -> str:
    """What failed, what became of the MLflow run, and the command that resumes it."""
    status = (f"MLflow run {e.run_id} is marked FAILED" if e.marked else
              f"MLflow run {e.run_id} could not be marked FAILED: it shows RUNNING until klbench next opens "
              "this store and marks it KILLED")
    when = "there is free space" if "disk is full" in e.why else "the server answers"
    return f"{e.why}; {status}. {resume_advice(ckpt, when)}"


def stopped_advice(e: BaseException, sig: int, ckpt: Path) -> str:
    """A run stopped by a signal: which, what became of its MLflow run, its folder and how to resume it."""
    status = ""
    if isinstance(e, interrupts.Stopped) and e.run_id:
        status = (f"; MLflow run {e.run_id} is marked KILLED" if e.marked else
                  f"; MLflow run {e.run_id} could not be marked KILLED: it shows RUNNING until klbench next "
                  "opens this store and marks it KILLED")
    folder = HydraConfig.get().runtime.output_dir
    return f"stopped by {interrupts.name(sig)}{status}. Run folder {folder}. {resume_advice(ckpt)}"


def resume_advice(ckpt: Path, when: str = "") -> str:
    """How to go on with a run that stopped: from its folder's checkpoint, or from the start without one."""
    if not ckpt.is_file():
        return "No checkpoint was written yet: start it again" + (f" once {when}" if when else "")
    return (f"Once {when}, resume" if when else "Resume") + f" it from {ckpt.name}: {resume_command()}"


def resume_command() -> str:
    """This run's command line, pasteable into a shell, continuing in its own folder from last.ckpt."""
    hc = HydraConfig.get()
    keep = [o for o in hc.overrides.task if o.split("=", 1)[0] not in ("ckpt_path", "hydra.run.dir")]
    return " ".join(["klbench", *map(shlex.quote, keep),
                     shlex.quote(hydra_override("hydra.run.dir", hc.runtime.output_dir)), "ckpt_path=last"])


def hydra_override(key: str, value: str) -> str:
    """key=value that Hydra's override parser, then OmegaConf, read back as the string `value` (the shell's
    quotes come on top). Left bare: ASCII path characters with a '/' (never a number, bool or null).
    Otherwise in Hydra's quotes, where ${ would be an interpolation (written \\${, a backslash run before
    it doubled) and a backslash run before a quote or at the end is doubled, the quote escaped."""
    if "/" in value and re.fullmatch(r"[\w./@:+-]+", value, re.ASCII):
        return f"{key}={value}"
    v = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", value)
    v = re.sub(r'(\\*)("|$)', lambda m: m[1] * 2 + ('\\"' if m[2] else ""), v)
    return f'{key}="{v}"'


def _discard_run_folder() -> None:
    """A run stopped before it started leaves nothing behind: its folder, if it holds only Hydra's own
    files, and the empty folders above it, but only those this process created (klbench.record.rundir
    .claim; in a sweep, Hydra's folder of the trial): never the user's outputs folder or a symlink's target."""
    from klbench.record import rundir
    out = os.path.abspath(HydraConfig.get().runtime.output_dir)
    ours = (rundir.created if HydraConfig.get().mode != RunMode.MULTIRUN else [out])
    if out not in ours or not (os.path.isdir(out) and not os.path.islink(out)
                               and all(p.name in (".hydra", "klbench.log") for p in Path(out).iterdir())):
        return
    shutil.rmtree(out, ignore_errors=True)
    for parent in reversed(ours[:ours.index(out)]):  # the date folders claim made, innermost first
        try:
            os.rmdir(parent)
        except OSError:  # not empty: other runs live here
            break


if __name__ == "__main__":
    main()
