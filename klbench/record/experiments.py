"""What each klbench MLflow experiment holds (its description in the UI), and what makes the UI show it
as model training rather than as a GenAI app.

How MLflow 3.17's UI picks the view: a global "GenAI | Model training" switch at the top of its sidebar.
The URL's `?workflowType=machine_learning|genai` sets it, else the browser's localStorage
(`mlflow.workflowType`), else GenAI. The experiment tag `mlflow.experimentKind` is what earlier 3.x UIs
read, and 3.17's still writes it, but reads it only with its workflow switch turned off (hard-wired on in
3.17.2). So klbench does both: it tags every experiment it opens as `custom_model_development`, and the
links it prints carry `?workflowType=machine_learning` (`ui_url`). docs/mlflow.md has the walk-through.

No MLflow import here: `store.ensure_experiment` applies `tags_to_set` with its client.
"""
from __future__ import annotations

import hashlib

KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"  # shown as "Machine learning"; the other kind is genai_development
NOTE_TAG = "mlflow.note.content"  # the experiment's description in the UI (Markdown)
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
    "- **Params**: the whole resolved config, flattened (`estimator.name`, `estimator.beta`, `model.kind`, "
    "...); Artifacts: `config.yaml`, `samples.json` (sample texts).\n"
    "- **Tags**: `klbench.run_dir` (checkpoints, logs), `klbench.error` on a run that failed.\n")

# Keyed by experiment-name prefix; the longest prefix that matches wins, "" matches every name.
DESCRIPTIONS: dict[str, str] = {
    "sweep-": (
        "**klbench sweep**: a parent run per Optuna study, a child run per trial (expand the parent: the + "
        "left of its name). The `val/seq_kl` against `val/reward` scatter: see the end of this text.\n\n"
        "`klbench -m sweep=<name>` writes to `sweep-<sweep>-<model kind>`.\n\n"
        "- **Parent run** `sweep-<study name>`, one per Optuna study (maximise `val/reward`, minimise "
        "`val/seq_kl`): params `sweep.*`, tags `optuna.study_name`, `klbench.sweep.dir`, `klbench.sweep.trials`; "
        "when the sweep ends, Artifacts `pareto.png` (every trial's `val/seq_kl` against `val/reward`, "
        "frontier marked) and `pareto.csv`, and metrics `pareto/*` (each estimator's share of the frontier, "
        "hypervolume; on the tabular model `pareto/frontier_gap/<estimator>`).\n"
        "- **Child runs**, one per trial, hidden until the parent is expanded.\n"
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
        "**klbench runs**: one per `klbench` command (without `-m`), named "
        "`<task>-<model>-<estimator>-beta<beta>-seed<seed>`; compare them in Chart view.\n\n"
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


def ui_command(tracking_uri: str) -> str:
    """The command that serves this store's UI (a server store is its own UI)."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri} --workers 1"


def ui_url(experiment_id: str, run_id: str | None = None, base: str = "http://127.0.0.1:5000") -> str:
    """A link into the UI that opens in the Model training view (MLflow 3.17 otherwise opens GenAI's)."""
    path = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    return f"{base.rstrip('/')}/{path}?{WORKFLOW_PARAM}"
