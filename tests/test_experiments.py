"""Experiments klbench opens are of the model-training kind and carry a description; a person's own
kind or description is kept (issue 10, item 5). A real MlflowClient on a tmp SQLite store."""
import pytest

mlflow = pytest.importorskip("mlflow")

from klbench.record import experiments, store  # noqa: E402
from klbench.record.experiments import KIND_TAG, NOTE_HASH_TAG, NOTE_TAG, TRAINING_KIND  # noqa: E402


@pytest.fixture(scope="module")
def uri(tmp_path_factory):  # one store for the module (a new one costs seconds); each test its own names
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.mark.parametrize("name, words", [
    ("klbench", ["val/seq_kl", "val/reward", "KL(pi||pi_ref)", "Model training"]),
    ("my-own-name", ["val/seq_kl", "logger.experiment"]),
    ("sweep-rl_beta-tabular", ["Parent run", "Child runs", "pareto.png", "Scatter chart", "klbench-pareto"]),
    ("distill-estimators-embedded", ["KL(student||teacher)", "distill-report", "klbench-distill-report"]),
])
def test_a_new_experiment_is_training_kind_with_its_description(uri, tmp_path, name, words):
    exp_id = store.ensure_experiment(uri, name, str(tmp_path / "art"))
    tags = mlflow.MlflowClient(uri).get_experiment(exp_id).tags
    assert tags[KIND_TAG] == TRAINING_KIND
    assert tags[NOTE_TAG] == experiments.description(name)
    for w in words:
        assert w in tags[NOTE_TAG], (name, w)
    assert store.ensure_experiment(uri, name, str(tmp_path / "art")) == exp_id  # opening again: same one


def test_an_older_experiment_gets_the_tags_when_klbench_opens_it(uri, tmp_path):
    store.open_store(uri)
    client = mlflow.MlflowClient(uri)
    exp_id = client.create_experiment("sweep-old")  # as klbench made them before
    assert KIND_TAG not in client.get_experiment(exp_id).tags
    assert store.ensure_experiment(uri, "sweep-old", None) == exp_id
    tags = client.get_experiment(exp_id).tags
    assert tags[KIND_TAG] == TRAINING_KIND and tags[NOTE_TAG] == experiments.description("sweep-old")


def test_a_persons_description_and_kind_are_kept(uri, tmp_path):
    exp_id = store.ensure_experiment(uri, "klbench-paper", None)
    client = mlflow.MlflowClient(uri)
    client.set_experiment_tag(exp_id, NOTE_TAG, "beta sweep for the paper, seeds 0-4")  # as the UI's editor does
    client.set_experiment_tag(exp_id, KIND_TAG, "genai_development")
    store.ensure_experiment(uri, "klbench-paper", None)
    tags = client.get_experiment(exp_id).tags
    assert tags[NOTE_TAG] == "beta sweep for the paper, seeds 0-4"
    assert tags[KIND_TAG] == "genai_development"

    other = client.create_experiment("sweep-mine", tags={NOTE_TAG: "written before klbench opened it"})
    store.ensure_experiment(uri, "sweep-mine", None)
    assert client.get_experiment(other).tags[NOTE_TAG] == "written before klbench opened it"


def test_klbench_updates_its_own_earlier_description(uri, monkeypatch):
    exp_id = store.ensure_experiment(uri, "klbench-older", None)
    monkeypatch.setitem(experiments.DESCRIPTIONS, "", "a newer text")
    store.ensure_experiment(uri, "klbench-older", None)
    tags = mlflow.MlflowClient(uri).get_experiment(exp_id).tags
    assert tags[NOTE_TAG] == "a newer text" and tags[NOTE_HASH_TAG] == experiments.note_hash("a newer text")


def test_the_longest_prefix_picks_the_description():
    assert experiments.description("sweep-estimators_grid-embedded") == experiments.DESCRIPTIONS["sweep-"]
    assert experiments.description("distill-estimators-tabular") == experiments.DESCRIPTIONS["distill-estimators-"]
    assert experiments.description("klbench") == experiments.DESCRIPTIONS[""]


def test_links_open_the_model_training_view():
    """MLflow 3.17.2 routes by the fragment and reads `workflowType` from the fragment's query: after `#/...`
    (before the `#` it is ignored and the page opens in GenAI; checked in headless Chromium, docs/mlflow.md)."""
    url = experiments.ui_url("3", "abc")
    assert url == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert experiments.ui_url("3", base="http://host:8080/") == \
        "http://host:8080/#/experiments/3/runs?workflowType=machine_learning"
    assert experiments.ui_command("sqlite:////x/mlflow.db") == "mlflow ui --backend-store-uri sqlite:////x/mlflow.db"
    assert experiments.ui_command("sqlite:////my runs/mlflow.db", port=5001) == \
        "mlflow ui --backend-store-uri 'sqlite:////my runs/mlflow.db' --port 5001"


@pytest.mark.parametrize("uri, port, lines", [
    ("sqlite:////o/mlflow.db", None, ["mlflow ui --backend-store-uri sqlite:////o/mlflow.db",
                                      "then open http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"]),
    ("sqlite:////o/mlflow.db", 5002, ["mlflow ui --backend-store-uri sqlite:////o/mlflow.db --port 5002",
                                      "then open http://127.0.0.1:5002/#/experiments/3/runs/abc?workflowType=machine_learning"]),
    ("http://u:secret@mlflow-host:5000/", None,
     ["open http://u:***@mlflow-host:5000/#/experiments/3/runs/abc?workflowType=machine_learning"]),
])
def test_every_printed_link_opens_the_model_training_view(uri, port, lines):
    from klbench.console.messages import mlflow_ui_lines
    assert mlflow_ui_lines(uri, "3", "abc", port) == lines


# ---- what each run holds (issue 21) ----

def _cfg(**over):
    from omegaconf import OmegaConf
    cfg = {"task": {"name": "rl"}, "model": {"kind": "tabular"}, "seed": 0, "kl_ctl": {"name": "fixed"},
           "estimator": {"name": "rb", "beta": 0.05}}
    return OmegaConf.merge(OmegaConf.create(cfg), OmegaConf.create(over))


def test_run_names_start_with_what_tells_runs_apart():
    """MLflow's run table shows about 20 characters of a name: estimator and beta first, task and model last."""
    assert experiments.run_name(_cfg()) == "rb b=0.05 s0 rl-tabular"
    assert experiments.run_name(_cfg(estimator={"name": "naive_cv", "lam": 0.3, "level": "sequence"}, seed=2)) == \
        "naive_cv b=0.05 l=0.3 seqlevel s2 rl-tabular"
    assert experiments.run_name(_cfg(kl_ctl={"name": "adaptive", "target": 2.0, "signal": "k3"})) == \
        "rb klt=2 sig=k3 s0 rl-tabular"
    assert experiments.run_name(_cfg(estimator={"name": "in_reward", "value": "k3"})) == "in_reward:k3 b=0.05 s0 rl-tabular"
    assert experiments.run_name(_cfg(estimator={"name": "library", "setting": "trl.grpo"})).startswith("trl.grpo b=0.05")


def test_trial_names_start_with_the_swept_values():
    """Two rl_beta children used to read `rl-tabular-rb-bet…` in the table: now their betas come first."""
    name = experiments.trial_name(_cfg(estimator={"beta": 0.052345}), {"estimator.beta": 0.052345})
    assert name == "b=0.0523 rb s0 rl-tabular"
    both = {"estimator.beta": 0.05, "estimator.lam": 0.3}
    assert experiments.trial_name(_cfg(estimator={"lam": 0.3}), both) == "b=0.05 l=0.3 rb s0 rl-tabular"
    grid = {"estimator": None, "estimator.value": "k3", "seed": 1, "task.lr": 0.001}  # kl_placement and more
    cfg = _cfg(estimator={"name": "in_reward", "value": "k3"}, seed=1)
    assert experiments.trial_name(cfg, grid) == "lr=0.001 in_reward:k3 s1 rl-tabular"
    names = {experiments.trial_name(_cfg(), {"estimator.beta": b}) for b in (0.0523, 0.0524, 0.1)}
    assert len(names) == 3 and all(len(n.split(" rb ")[0]) <= 8 for n in names)


def test_a_trial_gets_its_name_through_the_sweep_config(tmp_path, monkeypatch):
    """klbench.sweep.trial sets KLBENCH_RUN_NAME in the trial's process; sweeps/sweep_common.yaml reads it."""
    from klbench.config.compose import compose
    from klbench.sweep.trial import NAME_ENV, swept_values
    cfg = compose(["sweep=rl_beta_lambda", "experiment=tabular", "estimator.beta=0.0523", "estimator.lam=0.3"],
                  outputs=tmp_path, hydra=True)
    assert swept_values(cfg) == {"estimator.beta": 0.0523, "estimator.lam": 0.3}
    monkeypatch.setenv(NAME_ENV, experiments.trial_name(cfg, swept_values(cfg)))
    assert cfg.logger.run_name == "b=0.0523 l=0.3 naive_cv s0 rl-tabular"  # the sweep's estimator


def test_bookkeeping_goes_to_tags_and_the_design_stays_params():
    flat = {"estimator.beta": "0.05", "seed": "0", "task.lr": "0.1", "hardware.precision": "32-true",
            "paths.ckpt_dir": "/o/runs/x/checkpoints", "paths.outputs": "/o", "ckpt_allow_changes": "[]",
            "ckpt_path": "None", "logger.experiment": "klbench", "store.optuna": "postgresql://u:***@db/o",
            "optimized_metrics": "['val/reward', 'val/seq_kl']"}
    params, tags = experiments.split_config(flat)
    assert params == {"estimator.beta": "0.05", "seed": "0", "task.lr": "0.1", "hardware.precision": "32-true"}
    assert tags["klbench.config.paths.ckpt_dir"] == "/o/runs/x/checkpoints"
    assert tags["klbench.config.store.optuna"] == "postgresql://u:***@db/o"
    assert len(tags) == len(flat) - len(params)
