"""What klbench prints: each message once, no library chatter a user cannot act on, and where the results are.

`setup()` runs at the start of every run (klbench.tasks.train.run_task) and of every sweep (klbench.sweep.callback). Everything silenced here is named by its logger or its message, one entry per notice;
KLBENCH_VERBOSE=1 brings all of it back (docs/console.md).

No torch, Lightning, transformers or MLflow imports here: filters are set on logger names and warning
messages, which works before those libraries are imported.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

from klbench.record.redact import redact, redact_logs

VERBOSE_ENV = "KLBENCH_VERBOSE"

# logger name -> message beginnings silenced at default verbosity
QUIET_LOGS: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.utilities.rank_zero": (
        "💡 Tip: For seamless cloud logging",  # an advertisement for litlogger, at every Trainer
        "GPU available: ", "TPU available: ", "HPU available: ",  # the summary table names the device
        "`Trainer.fit` stopped: `max_steps=",  # the summary's "N steps in T s" says it
    ),
    "transformers.modeling_utils": (
        "`loss_type=None` was set in the config",  # GPT-2 pretraining uses the default causal-LM loss, as meant
        # seen on the model=hf path (issue 10). klbench passes attention masks wherever it calls a model
        # (policies.py, rewards.py); with pad == eos, as for GPT-2, a finished response ends in the pad id
        "We strongly recommend passing in an `attention_mask`",
    ),
    # the Optuna sweeper's unlabelled "Values: [1.79, 4.35], Params: {...}" lines; the sweep callback
    # prints the same trials labelled (klbench.sweep.parent.print_pareto_trials)
    # and its start: the study's name and storage are in the sweep's own lines and in the parent run's
    # tags (optuna.study_name, optuna.storage), its sampler and directions in the sweep's config
    "hydra_plugins.hydra_optuna_sweeper._impl": ("Number of Pareto solutions: ", "    Values: ", "Study name: ",
                                                 "Storage: ", "Sampler: ", "Directions: "),
    # klbench's own line says which study and how many of its trials are done (klbench.sweep.study)
    "optuna.storages._rdb.storage": ("A new study created in RDB",),
    "optuna.storages.journal._storage": ("A new study created in Journal",),
    # klbench opens the study itself just before the sweeper does, so this shows at every sweep, a new
    # study included; klbench's own line says how many of its trials are done
    "optuna.study.study": ("Using an existing study with",),
    # the store's creation: klbench.record.store prints one line saying where
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables"),
}
# (warning category, message regex) silenced at default verbosity
QUIET_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # Lightning 2.6's own pytree copy builds torch's deprecated LeafSpec; nothing klbench can change
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # a SLURM client on a login node or a workstation: klbench's SLURM path is submitit's (docs/scale-out.md)
    (UserWarning, r"The `srun` command is available on your system but is not used"),
)
# progress bars of transformers silenced at default verbosity (desc= of the bar)
QUIET_BARS = ("Loading weights", "Writing model shards")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


_installed: set[str] = set()


def setup() -> None:
    """Each Lightning message once; at default verbosity, the notices above silenced; at every verbosity,
    passwords in URLs as *** in every log record (klbench.record.redact); in a Hydra job, what is printed is
    copied into the run folder's klbench.log (klbench.console.logfile). Idempotent."""
    redact_logs()
    one_handler()
    from klbench.console.logfile import copy_console
    copy_console()  # what is printed goes to the run folder's klbench.log too, with times
    if verbose():
        return
    for name in QUIET_LOGS:
        quiet_logger(name)
    if "warnings" not in _installed:
        _installed.add("warnings")
        for category, message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)


def quiet_logger(name: str) -> None:
    if name in _installed or verbose():
        return
    _installed.add(name)
    logging.getLogger(name).addFilter(_DropMessages(QUIET_LOGS[name]))


def one_handler() -> None:
    """`import lightning` gives the `lightning` logger a console handler of its own, and the records also reach
    the root logger's handlers: with Hydra's logging (console and klbench.log) every message printed twice.
    Where the application has configured the root logger, these libraries' own handlers go and their records
    take the application's way only. Where it has not (a plain `python -c`), they are left as they are."""
    root = logging.getLogger()
    if not root.handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            # the console's own streams too: copy_console may have wrapped sys.stdout and sys.stderr
            if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.stdout, sys.__stderr__,
                                                                 sys.__stdout__, getattr(sys.stderr, "stream", None)):
                lg.removeHandler(h)
        lg.propagate = True


def quiet_transformers() -> None:
    """transformers' bars for loading and saving weights, at default verbosity (download bars stay: they
    are huggingface_hub's). Called where transformers loads or saves a model (klbench.models.hf,
    klbench.models.embedded.pretrain); imports transformers."""
    if verbose() or "bars" in _installed:
        return
    _installed.add("bars")
    from transformers.utils import logging as hf_logging

    def hook(factory, args, kwargs):
        if kwargs.get("desc") in QUIET_BARS:
            kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous else factory(*args, **kwargs)

    previous = hf_logging.set_tqdm_hook(hook)


# ---- where the results are ----

def display_uri(uri: str) -> str:
    """A tracking URI fit for a console and a log file: a password in it is replaced by ***."""
    return redact(uri)


def mlflow_ui_lines(tracking_uri: str, experiment_id: str, run_id: str | None, port: int | None = None) -> list[str]:
    """How to look at a run (or an experiment) in the MLflow UI: the `mlflow ui` command for a store that is a
    file or a database, the page itself for an MLflow server. The command is quoted for a POSIX shell (an
    outputs folder may hold spaces), so that it works pasted; `port` serves it beside a UI already on 5000.
    Every link opens in the Model training view (klbench.record.experiments.ui_url)."""
    from klbench.record.experiments import ui_command, ui_url
    if tracking_uri.startswith(("http://", "https://")):
        return [f"open {ui_url(experiment_id, run_id, base=display_uri(tracking_uri))}"]
    return [ui_command(tracking_uri, port),
            f"then open {ui_url(experiment_id, run_id, base=f'http://127.0.0.1:{port or 5000}')}"]


UI_PORT = 5000  # `mlflow ui`'s own default


def ui_port(host: str = "127.0.0.1") -> int | None:
    """None where `mlflow ui` can take its default port; else a free port to give it. A second `mlflow ui`
    on a port another UI holds fails with "Address already in use" and still exits 0 (MLflow 3.17.2)."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is free
            try:
                s.bind((host, port))
                return True
            except OSError:
                return False

    if free(UI_PORT):
        return None
    return next((p for p in range(UI_PORT + 1, UI_PORT + 100) if free(p)), None) or _any_port(host)


def _any_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kl_target_line(sampling: str, target: str, meaning: str) -> str:
    """The run's sampling and KL target in one line (start and end of a run; docs/sampling.md)."""
    return (f"samples with {sampling}; KL target {target}: {meaning} (the KL term and val/seq_kl; "
            "task.kl_target, docs/sampling.md)")


def print_run_where(cfg, logger) -> None:
    """A run's last lines: its folder, its MLflow run and how to look at it (train.run_task, task=probe).
    `logger` as klbench.record.tracking.build_logger returns it: a RecordLogger, a CSVLogger, or False.
    A sweep's trial leaves how to look at it to the sweep's end, which prints it once, for the parent."""
    lines = [("run folder", os.path.abspath(os.path.dirname(cfg.paths.ckpt_dir)))]
    lines += export_lines(cfg)
    client = getattr(logger, "client", None)
    if client is not None:  # an MLflow RecordLogger on rank zero
        info = client.get_run(logger.run_id).info
        lines.append(("MLflow run", f"{info.run_id} ({info.run_name}) in experiment {logger.name!r}"))
        if not cfg.logger.get("parent_run_id"):
            ui = mlflow_ui_lines(cfg.logger.tracking_uri, info.experiment_id, info.run_id, ui_port())
            lines += [("to see it" if i == 0 else "", line) for i, line in enumerate(ui)]
    elif hasattr(logger, "log_dir"):
        lines.append(("metrics", os.path.join(logger.log_dir, "metrics.csv")))
    elif not logger:
        lines.append(("MLflow run", "none (logger=none)"))
    print_where(lines)


def export_lines(cfg) -> list[tuple[str, str]]:
    """How to take the trained policy out as a save_pretrained folder (klbench.tasks.export), where the run
    has a checkpoint of a language model (task=probe writes none, the tabular model has no such form)."""
    import shlex
    ckpt = os.path.join(cfg.paths.ckpt_dir, "last.ckpt")
    if not os.path.isfile(ckpt) or cfg.model.get("kind") == "tabular":
        return []
    command = f"klbench-export {shlex.quote(os.path.abspath(os.path.dirname(cfg.paths.ckpt_dir)))}"
    lora = (cfg.model.get("lora") or {}).get("r")
    return [("to export", command + ("   (--adapter: the LoRA adapter alone)" if lora else ""))]


def print_where(lines: list[tuple[str, str]]) -> None:
    """The last lines of a run or a sweep: (label, value) pairs, aligned, on stdout."""
    width = max(len(k) for k, _ in lines)
    print()
    for k, v in lines:
        print(f"klbench: {k:<{width}}  {v}")
    sys.stdout.flush()
