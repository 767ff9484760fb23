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
    url = experiments.ui_url("3", "abc")
    assert url == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert experiments.ui_command("sqlite:////x/mlflow.db") == \
        "mlflow ui --backend-store-uri sqlite:////x/mlflow.db --workers 1"
