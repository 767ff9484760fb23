"""What each klbench MLflow experiment holds (its description in the UI), and what makes the UI show it
as model training rather than as a GenAI app.

How MLflow 3.17's UI picks the view: a global "GenAI | Model training" switch at the top of its sidebar.
The URL's `?workflowType=machine_learning|genai` sets it, else the browser's localStorage
(`mlflow.workflowType`), else GenAI. The experiment tag `mlflow.experimentKind` is what earlier 3.x UIs
read, and 3.17's still writes it, but reads it only with its workflow switch turned off (hard-wired on in
3.17.2). So klbench does both: it tags every experiment it opens as `custom_model_development`, and the
links it prints carry `?workflowType=machine_learning` (`ui_url`). docs/mlflow.md has the walk-through.

Also what each run holds (`run_name`, `trial_name`, `split_config`): names that put what tells runs apart
first, and params that are the experiment's design, with the bookkeeping in `klbench.config.*` tags.

No MLflow import here: `store.ensure_experiment` applies `tags_to_set` with its client.
"""
from __future__ import annotations

import hashlib
import shlex

from klbench.record.redact import redact

KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"  # shown as "Machine learning"; the other kind is genai_development
NOTE_TAG = "mlflow.note.content"  # an experiment's or a run's description in the UI (Markdown)
FIGURE = "pareto.html"  # the interactive frontier figure on a sweep's parent run and a klbench-pareto run
# The hash of the description klbench last wrote. A description that no longer matches it was edited
# by a person, and klbench leaves it alone; one that matches is klbench's to bring up to date.
NOTE_HASH_TAG = "klbench.note_sha1"
WORKFLOW_PARAM = "workflowType=machine_learning"

_READ = ("Read it in the **Model training** view: the switch at the top of MLflow's sidebar, or a link "
         "ending in `?workflowType=machine_learning`. Walk-through: docs/mlflow.md in the klbench repository.")

_METRICS = (
    "- **Metrics**, by optimiser step: `val/reward` and `val/seq_kl`, the sequence KL(pi||pi_ref), on "
    "held-out prompts with fresh samples: the `rb` estimate, never the training estimator, and exact on "
    "`model=tabular`, which also logs `val/kl_ref_pi` = KL(pi_ref||pi) and `val/frontier_gap` (reward left "
    "below the exact optimal frontier at the run's KL). `train/kl_*`: every value estimator on the same "
    "training batch; `train/reward`, `train/entropy`, `train/grad_norm`.\n")
_PARAMS = (
    "- **Params**: the experiment's design, the resolved config flattened (`estimator.name`, `estimator.beta`, "
    "`model.kind`, `task.*`, `seed`, ...); Artifacts: `config.yaml` (the whole config), `samples.json` "
    "(sample texts).\n"
    "- **Tags**: `klbench.run_dir` (the run folder: checkpoints, `klbench.log`), `klbench.config.*` (the "
    "bookkeeping: paths, checkpoint and logger settings, store URLs), `klbench.error` on a run that failed.\n")

# Keyed by experiment-name prefix; the longest prefix that matches wins, "" matches every name.
DESCRIPTIONS: dict[str, str] = {
    "sweep-": (
        "**klbench sweep**: a parent run per Optuna study, a child run per trial (expand the parent: the + "
        "left of its name). Reward against KL per estimator, with the frontier: the parent run's "
        f"Artifacts, `{FIGURE}`.\n\n"
        "`klbench -m sweep=<name>` writes to `sweep-<sweep>-<model kind>`.\n\n"
        "- **Parent run** `sweep-<study name>`, one per Optuna study (maximise `val/reward`, minimise "
        "`val/seq_kl`): params `sweep.*`, tags `optuna.study_name`, `klbench.sweep.dir`, `klbench.sweep.trials`; "
        f"when the sweep ends, Artifacts `{FIGURE}` (interactive: every trial's `val/seq_kl` against "
        "`val/reward`, a colour per estimator, the empirical frontier with its bootstrap band and, on the "
        "tabular model, the exact frontier), `pareto.png` (the same, as an image) and `pareto.csv`, and metrics "
        "`pareto/*` (each estimator's share of the frontier, hypervolume; on the tabular model "
        "`pareto/frontier_gap/<estimator>`).\n"
        "- **Child runs**, one per trial, hidden until the parent is expanded, named by what sets them apart: "
        "the swept values first, then estimator, seed, task and model (`b=0.0523 rb s0 rl-tabular`).\n"
        + _METRICS + _PARAMS +
        "\nThe scatter across trials: Runs, expand the parent (charts plot only the runs the list shows, and "
        "the parent has no `val/*`), Chart view (second button above the list), Add chart > Scatter chart, "
        "X axis `val/seq_kl`, Y axis `val/reward`, Add chart; typing `val/seq_kl` into Search metric charts "
        "brings it up. From the shell: `klbench-pareto --parent <parent run id>` "
        "(the id is in `<sweep dir>/mlflow_parent_run_id.txt`).\n\n" + _READ),
    "distill-estimators-": (
        "**klbench distillation, estimators compared**: a run per estimator and seed, and a `distill-report` "
        "run with the comparison (`distill_seq_kl.png` under its Artifacts).\n\n"
        "`klbench -m experiment=distill_estimators` (or `distill_estimators_tabular`) trains the student "
        "towards the teacher (pi_ref = teacher, beta = 1, no reward).\n\n"
        "- **Trial runs**: the curve to compare is `val/seq_kl`, KL(student||teacher) of the sequence on fresh "
        "student samples (the `rb` estimate; exact on the tabular model), by step.\n"
        "- **`distill-report` runs** (tag `klbench.report=distill`), one per multirun: `distill_seq_kl.png`, "
        "`.md` and `.csv`, the mean and std over seeds and the ratio to the `token` estimator. Recompute with "
        "`klbench-distill-report --experiment <this experiment>`.\n"
        + _PARAMS + "\n" + _READ),
    "": (
        "**klbench runs**: one per `klbench` command (without `-m`), named estimator and beta first: "
        "`<estimator> b=<beta> s<seed> <task>-<model>` (`rb b=0.05 s0 rl-tabular`); compare them in Chart "
        "view.\n\n"
        "The experiment is `logger.experiment` (default `klbench`).\n\n"
        + _METRICS + _PARAMS +
        "\nCompare runs: Runs, Chart view (second button above the list), Add chart > Scatter chart, X axis "
        "`val/seq_kl`, Y axis `val/reward`. One run's curves: click its name, Model metrics. Sample texts side "
        "by side: Artifact evaluation (third button above the list).\n\n" + _READ),
}


def description(name: str) -> str:
    """The description of experiment `name`: the entry of the longest prefix of DESCRIPTIONS it starts with."""
    return DESCRIPTIONS[max((p for p in DESCRIPTIONS if name.startswith(p)), key=len)]


def note_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def tags_to_set(name: str, tags: dict[str, str]) -> dict[str, str]:
    """The experiment tags klbench sets on experiment `name`, given its current `tags` (none for a new one):
    the training kind where no kind is set (a kind someone chose stays), and the description where there is
    none or it is klbench's own earlier text (a description someone edited stays)."""
    out = {}
    if not tags.get(KIND_TAG):
        out[KIND_TAG] = TRAINING_KIND
    text, old = description(name), tags.get(NOTE_TAG)
    if old != text and (not old or note_hash(old) == tags.get(NOTE_HASH_TAG)):
        out[NOTE_TAG] = text
        out[NOTE_HASH_TAG] = note_hash(text)
    return out


def ui_command(tracking_uri: str, port: int | None = None) -> str:
    """The command that serves this store's UI, quoted for a POSIX shell (an outputs folder may hold spaces)
    and with a password in the URI as ***. `port`: another than MLflow's default 5000."""
    cmd = f"mlflow ui --backend-store-uri {shlex.quote(redact(tracking_uri))}"
    return cmd + (f" --port {port}" if port else "")


def ui_url(experiment_id: str, run_id: str | None = None, base: str = "http://127.0.0.1:5000") -> str:
    """A link into the UI that opens in the Model training view (MLflow 3.17 otherwise opens GenAI's).
    The UI routes by the address's fragment and reads its query from there: the parameter goes after
    `#/...`; before the `#` 3.17.2 ignores it (checked in headless Chromium, docs/mlflow.md)."""
    path = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    return f"{base.rstrip('/')}/{path}?{WORKFLOW_PARAM}"


# ---- what each run holds ----

# Bookkeeping: where a run writes, how it is logged and resumed, where the stores are. Not the experiment's
# design: tags `klbench.config.<key>` rather than params, so that the compare view's axes are what was run.
BOOKKEEPING = ("paths", "logger", "store", "ckpt_path", "ckpt_allow_changes", "optimized_metrics")
CONFIG_TAG = "klbench.config."
RUN_DIR_TAG = "klbench.run_dir"  # the run folder: checkpoints, klbench.log, .hydra/
# how a swept key reads in a trial's name; other keys by their last part (task.lr=0.001: lr=0.001)
SHORT = {"estimator.beta": "b", "estimator.lam": "l", "kl_ctl.target": "klt"}
# in a trial's name anyway: the estimator (with its value or setting, estimator_label) and the seed
NAMED_ANYWAY = ("estimator", "estimator.name", "estimator.value", "estimator.setting", "seed")


def is_bookkeeping(key: str) -> bool:
    """Whether a flattened config key (`paths.ckpt_dir`) is bookkeeping rather than design."""
    return any(key == b or key.startswith(b + ".") for b in BOOKKEEPING)


def split_config(flat: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(params, tags) of a flattened config: the design as params, the bookkeeping as `klbench.config.*` tags."""
    params = {k: v for k, v in flat.items() if not is_bookkeeping(k)}
    tags = {CONFIG_TAG + k: v for k, v in flat.items() if is_bookkeeping(k)}
    return params, tags


def estimator_label(est) -> str:
    """The estimator as a run name says it: a library's setting (`trl.grpo`), a placement estimator with its
    value (`in_reward:k3`, as klbench.analysis.mlflow_io.estimator_label labels the frontier), else its name."""
    if est.get("setting"):
        return str(est.setting)
    return f"{est.name}:{est.value}" if est.get("value") is not None else str(est.name)


def run_name(cfg) -> str:
    """A single run's name, what tells runs apart first (MLflow's run table shows about 20 characters): the
    estimator, beta (or the adaptive controller's KL target and signal), its options, what else sets it apart
    within its task (APART), the seed; then task and model, with an embedded model's preset:
    `rb b=0.05 s0 rl-tabular`, `rb b=0.02 grpo s0 rl-embedded:arith`. A sweep's trials: trial_name."""
    est = cfg.estimator
    parts = [estimator_label(est)]
    ctl = cfg.get("kl_ctl")
    if ctl is not None and ctl.name == "adaptive":  # beta is the controller's: name the target and signal
        parts += [f"klt={ctl.target:g}", f"sig={ctl.signal}"]
    else:
        parts.append(f"b={est.beta:g}")
    if "lam" in est:
        parts.append(f"l={est.lam:g}")
    if est.get("level") == "sequence":
        parts.append("seqlevel")
    parts += [*apart(cfg), f"s{cfg.seed}", task_model(cfg)]
    return redact(" ".join(parts))


# settings that set a run apart within its task, each named only where it is not the task's default:
# (key, default, label); experiment=arith's `grpo`, a sampler's `T=0.7`, a LoRA rank's `r=8`
APART = (("task.advantage", "rloo", "{}"), ("task.temperature", 1.0, "T={:g}"), ("task.top_k", 0, "top_k={}"),
         ("task.top_p", 1.0, "top_p={:g}"), ("task.kl_target", "sampler", "kl={}"), ("model.lora.r", None, "r={}"))


def apart(cfg, skip: tuple[str, ...] = ()) -> list[str]:
    """The labels of APART's settings that differ from their defaults (`skip`: keys named elsewhere)."""
    from omegaconf import OmegaConf
    out = []
    for key, default, label in APART:
        value = OmegaConf.select(cfg, key, default=default)
        if key not in skip and value is not None and value != default:
            out.append(label.format(value))
    return out


def task_model(cfg) -> str:
    """`rl-tabular`, `rl-hf`, `rl-embedded`; an embedded model of another preset than the reference names it:
    `rl-embedded:arith` (experiment=arith), `distill-embedded:student`."""
    preset = cfg.model.get("preset") if cfg.model.kind == "embedded" else None
    return f"{cfg.task.name}-{cfg.model.kind}" + (f":{preset}" if preset and preset != "reference" else "")


def trial_name(cfg, swept: dict) -> str:
    """A sweep trial's name: its values of the swept keys first (`swept`, key -> value, in the sweep's order),
    then estimator, seed, task and model: `b=0.0523 rb s0 rl-tabular` (sweep=rl_beta), `b=0.03 l=0.3 rb s1
    rl-embedded` (rl_beta_lambda), `in_reward:k3 s2 rl-tabular` (kl_placement)."""
    parts = []
    for key, value in swept.items():
        if key not in NAMED_ANYWAY:
            value = f"{value:.3g}" if isinstance(value, float) else str(value)
            parts.append(f"{SHORT.get(key, key.rsplit('.', 1)[-1])}={value}")
    parts += [estimator_label(cfg.estimator), *apart(cfg, tuple(swept)), f"s{cfg.seed}", task_model(cfg)]
    return redact(" ".join(parts))[:250]  # MLflow keeps run names up to 250 characters
