"""Issue 34, parts 3-5: odd paths, secrets in tracebacks, and one line (no traceback, nothing left behind)
for what a careful user gets wrong. Each test failed on the code before the issue (checked by hand).

Whole `klbench` runs where the CLI's behaviour is the point (where files land, what is printed, what is
left; in this process, tests/cli_inprocess.py); in-process checks of the function that words a message everywhere else.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

import cli_inprocess
from klbench.config.errors import ConfigError, MissingInput
from klbench.record import store
from klbench.record.redact import redact, redact_exception
from test_record import env_for, klbench

QUICK = ["experiment=tabular", "task.max_steps=4", "task.val_every=2"]


def one_line(proc: subprocess.CompletedProcess, *says: str) -> str:
    """The run failed with exit code 1 and one `klbench: error:` line, no traceback; that line."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("klbench: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    for text in says:
        assert text in errors[0], errors[0]
    return errors[0]


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


# ---- paths ----

@pytest.mark.parametrize("name", ["hash#x", "quotes'\"x", "space é中"])
def test_an_outputs_folder_with_odd_characters_holds_all_the_run_writes(tmp_path, name):
    """'#' sent a run's artifacts outside the outputs folder, quotes broke MLflow's SQL; with spaces and
    non-ASCII, everything lands inside it too."""
    outputs = tmp_path / name
    proc = klbench(outputs, *QUICK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing beside the outputs folder
    client = mlflow.MlflowClient(store.tracking_uri(outputs))
    (run,) = client.search_runs([client.get_experiment_by_name("klbench").experiment_id])
    assert run.info.status == "FINISHED"
    config = [p for p in files_under(outputs) if p.name == "config.yaml" and "mlartifacts" in p.parts]
    assert len(config) == 1 and run.info.run_id in config[0].parts, files_under(outputs)
    from mlflow.utils.file_utils import local_file_uri_to_path  # MLflow's own reading of the location
    assert Path(local_file_uri_to_path(run.info.artifact_uri)) == config[0].parent


@pytest.mark.parametrize("name", ["q?x", "pct%20x"])
def test_an_outputs_folder_no_store_can_take_is_refused_in_one_line(tmp_path, name):
    """'?' ended the store's path (MLflow wrote its store to a file beside it), '%20' named another file
    (2 minutes of retries, then a failure); such a folder is refused at once, and nothing is created."""
    proc = klbench(tmp_path / name, *QUICK)
    one_line(proc, "KLBENCH_OUTPUTS", "choose a folder")
    assert list(tmp_path.iterdir()) == []


def test_store_uris_name_their_paths():
    assert store.sqlite_uri("/a b/é'\"#/mlflow.db") == "sqlite:////a b/é'\"#/mlflow.db"
    assert store.sqlite_path(store.sqlite_uri("/a b/é'\"#/mlflow.db")) == Path("/a b/é'\"#/mlflow.db")
    assert store.file_uri("/a #?%'\" é") == "file:///a%20%23%3F%25%27%22%20%C3%A9"
    for bad in ("/a?b/mlflow.db", "/a%20b/mlflow.db"):
        with pytest.raises(store.StoreError, match="KLBENCH_OUTPUTS: the path .* holds"):
            store.sqlite_uri(bad)


def test_the_optuna_store_of_an_odd_outputs_folder_is_inside_it(tmp_path):
    """store.optuna is built by the same function as the MLflow store's URI: inside the outputs folder for
    '#', quotes and non-ASCII; '%20' (which named another file) is refused in one line."""
    from test_config import compose_cfg
    import optuna
    odd = tmp_path / "odd #'\"é"
    cfg = compose_cfg(odd, ["store=local"])
    (odd / "outputs").mkdir(parents=True)  # a sweep's folder is made by then
    optuna.create_study(storage=cfg.store.optuna, study_name="s")
    assert (odd / "outputs" / "optuna.db").is_file() and [p.name for p in tmp_path.iterdir()] == [odd.name]
    cfg = compose_cfg(tmp_path / "pct%20x", ["store=local"])
    with pytest.raises(SystemExit, match="klbench: error: KLBENCH_OUTPUTS: the path .*pct%20x.* holds '%'"):
        cfg.store.optuna


def test_a_config_error_never_removes_a_folder_it_did_not_create(tmp_path):
    """estimator.beta=nan removed the user's own empty outputs folder, and through a symlink its target."""
    mine, target = tmp_path / "mine", tmp_path / "target"
    mine.mkdir()
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    for outputs in (mine, tmp_path / "link"):
        one_line(klbench(outputs, *QUICK, "estimator.beta=nan"), "estimator.beta")
    assert mine.is_dir() and target.is_dir() and (tmp_path / "link").is_symlink()
    assert list(mine.iterdir()) == [] and list(target.iterdir()) == []  # the run folders went, nothing else
    fresh = tmp_path / "fresh"  # a folder klbench created is removed again
    one_line(klbench(fresh, *QUICK, "estimator.beta=nan"), "estimator.beta")
    assert not fresh.exists()


@pytest.mark.parametrize("kind", ["read-only", "a file"])
def test_an_outputs_folder_that_cannot_hold_runs_is_said_in_one_line(tmp_path, read_only, kind):
    outputs = tmp_path / "outputs"
    if kind == "a file":
        outputs.write_text("not a folder")
    else:
        outputs.mkdir()
        read_only(outputs)
    one_line(klbench(outputs, *QUICK), "cannot create the run folder", "KLBENCH_OUTPUTS")
    assert (outputs.is_file() and outputs.read_text() == "not a folder") or list(outputs.iterdir()) == []


# ---- the store a run is recorded in ----

def test_relative_tracking_uri_env_interpolation_and_a_resume_elsewhere(tmp_path):
    """One run with a relative MLFLOW_TRACKING_URI (its `mlflow ui` command must work from anywhere) and
    `task.max_steps=${oc.env:STEPS,30}`; then a resume pointed at another store (one line, and no empty
    store left there), and a last.ckpt of random bytes (not a klbench checkpoint, and what to do)."""
    outputs = tmp_path / "outputs"
    env = {**env_for(outputs), "MLFLOW_TRACKING_URI": "sqlite:///rel.db", "STEPS": "4"}
    proc = cli_inprocess.run(["experiment=tabular", "task.val_every=2", "task.max_steps=${oc.env:STEPS,30}"],
                             cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'rel.db'}" in proc.stdout, proc.stdout
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'rel.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("klbench").experiment_id])
    assert run.data.params["task.max_steps"] == "4" and run.data.tags["klbench.steps_done"] == "4"
    run_dir = run.data.tags["klbench.run_dir"]

    other = tmp_path / "other"
    resume = ["experiment=tabular", "task.val_every=2", "task.max_steps=4", f"hydra.run.dir={run_dir}",
              "ckpt_path=last"]
    proc = cli_inprocess.run(resume, cwd=tmp_path, env={**env, "MLFLOW_TRACKING_URI": f"sqlite:///{other}/mlflow.db"})
    one_line(proc, run.info.run_id, f"{other}/mlflow.db", "resume with the store the run started with")
    assert not other.exists()

    Path(run_dir, "checkpoints", "last.ckpt").write_bytes(os.urandom(4000))
    proc = cli_inprocess.run(resume, cwd=tmp_path, env=env)
    line = one_line(proc, "is not a klbench checkpoint", "start the run again without ckpt_path")
    assert "Python objects" not in line


def test_a_file_store_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    with pytest.raises(store.StoreError, match=f"is a file store.*MLFLOW_TRACKING_URI=sqlite:///{tmp_path}/mlflow.db"):
        store.open_store(store.tracking_uri())
    proc = cli_inprocess.run(QUICK, cwd=tmp_path, env={**env_for(tmp_path / "outputs"),
                                                       "MLFLOW_TRACKING_URI": f"file:{tmp_path}/mlruns"})
    one_line(proc, "is a file store", "mlflow migrate-filestore")
    assert not (tmp_path / "outputs" / "runs").exists() or not any((tmp_path / "outputs" / "runs").rglob("*"))


def test_relative_sqlite_uri_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///sub/rel.db")
    assert store.tracking_uri() == f"sqlite:///{tmp_path}/sub/rel.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////abs/x.db")
    assert store.tracking_uri() == "sqlite:////abs/x.db"


# ---- secrets ----

def test_a_password_in_a_model_url_is_in_no_traceback_and_no_file(tmp_path):
    """The warning said klbench records it nowhere; the traceback that followed printed it twice."""
    outputs = tmp_path / "outputs"
    proc = klbench(outputs, "model=hf", "model.name_or_path=https://user:hunter2@example.com/model")
    one_line(proc, "model.name_or_path=https://user:***@example.com/model is a URL")
    assert "hunter2" not in proc.stdout + proc.stderr
    assert not any("hunter2" in p.read_bytes().decode("utf-8", "replace") for p in files_under(outputs))
    assert files_under(outputs) == [] or all("runs" not in p.parts for p in files_under(outputs))


def test_exception_text_is_redacted_before_it_is_printed():
    assert redact("'/o/https:/user:hunter2@example.com/model'") == "'/o/https:/user:***@example.com/model'"
    url = "https://u:" + "hunter2" + "@h/m"  # built here: a traceback also shows the source lines
    try:
        try:
            open(f"/nonexistent/{url}")
        except OSError as e:
            raise RuntimeError(f"loading {url} failed", 3) from e
    except RuntimeError as e:
        redact_exception(e)
        import traceback
        text = "".join(traceback.format_exception(e))
    assert "hunter2" not in text and text.count("https://u:***@h/m") == 2, text


# ---- models and data ----

@pytest.fixture(scope="module")
def bad_model_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_models")
    (root / "empty").mkdir()
    (root / "garbage").mkdir()
    (root / "garbage" / "config.json").write_text("{not json")
    (root / "weights_only").mkdir()
    (root / "weights_only" / "model.safetensors").write_bytes(b"x")
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    DistilBertForSequenceClassification(DistilBertConfig(vocab_size=50, dim=8, n_layers=1, n_heads=2,
                                                         hidden_dim=8)).save_pretrained(root / "classifier")
    return root


@pytest.mark.parametrize("case,says", [
    ("missing", "does not exist"), ("empty", "is empty: no config.json"),
    ("weights_only", "holds model.safetensors but no config.json"), ("garbage", "config.json is not valid JSON"),
    ("classifier", "is not a causal LM")])
def test_a_model_folder_that_is_not_a_causal_lm_names_the_setting(bad_model_folders, case, says):
    from klbench.models.hf import load_causal_lm
    with pytest.raises(MissingInput, match="model.ref_name_or_path") as e:
        load_causal_lm(str(bad_model_folders / case), path_setting="model.ref_name_or_path")
    assert says in str(e.value) and len(str(e.value).splitlines()) == 1 and "sentencepiece" not in str(e.value)


@pytest.mark.parametrize("case,says", [("missing", "does not exist"), ("empty", "is empty"),
                                       ("garbage", "is not valid JSON")])
def test_a_reward_folder_that_is_not_a_classifier_names_the_setting(bad_model_folders, case, says):
    from klbench.rewards.reward import HFClassifierReward
    with pytest.raises(MissingInput, match=f"reward.name_or_path.*{says}"):
        HFClassifierReward(str(bad_model_folders / case), "POSITIVE")


def test_a_model_folder_error_is_one_line_and_leaves_no_run_folder(tmp_path, bad_model_folders):
    outputs = tmp_path / "outputs"
    one_line(klbench(outputs, "model=hf", f"model.name_or_path={bad_model_folders / 'empty'}",
                     "task.max_steps=2", "task.val_every=1"), "model.name_or_path", "is empty")
    one_line(klbench(outputs, "model=hf", f"model.name_or_path={bad_model_folders / 'classifier'}",
                     "task.max_steps=2", "task.val_every=1"), "is not a causal LM")
    assert not (outputs / "runs").exists() or not any((outputs / "runs").rglob("*"))
    assert not (outputs / "mlflow.db").exists()


def test_dataset_hf_without_datasets_says_what_to_install(tmp_path, monkeypatch):
    from test_config import compose_cfg
    from klbench.data.prompts import load_prompts
    cfg = compose_cfg(tmp_path, ["dataset=hf", "dataset.name=imdb"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails as when it is not installed
    with pytest.raises(ConfigError, match=r"dataset=hf needs the `datasets` package.*pip install 'klbench\[hf\]'"):
        load_prompts(cfg.dataset)


def test_dataset_hf_without_datasets_in_a_real_run(tmp_path, tiny_lm_dir):
    outputs = tmp_path / "outputs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "datasets", None)  # `import datasets` fails, as where it is not installed
        proc = cli_inprocess.run(["model=hf", f"model.name_or_path={tiny_lm_dir}", "dataset=hf", "dataset.name=imdb",
                                  "task.max_new_tokens=8", "task.max_steps=2"], cwd=tmp_path, env=env_for(outputs))
    one_line(proc, "dataset=hf needs the `datasets` package", "pip install 'klbench[hf]'")
    assert not (outputs / "runs").exists() or not any((outputs / "runs").rglob("*"))


def test_jsonl_files_utf8_bom_and_directories(tmp_path):
    from klbench.data.jsonl import read_prompts
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "\xff bad"}\n')
    with pytest.raises(ValueError, match=f"{bad}:2 is not UTF-8 \\(byte 0xff at column 11\\)"):
        read_prompts(str(bad), "text")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + b'{"text": "hello"}\n{"text": "\xc3\xa9t\xc3\xa9"}\n')
    assert read_prompts(str(bom), "text") == ["hello", "été"]
    with pytest.raises(FileNotFoundError, match="is a directory"):
        read_prompts(str(tmp_path), "text")
    from test_config import compose_cfg
    from klbench.config.schema import validate
    cfg = compose_cfg(tmp_path, ["dataset=jsonl", f"dataset.train_path={bom}", f"dataset.val_path={tmp_path}",
                                 "dataset.field=text", "task.prompts_per_step=2"])
    with pytest.raises(ConfigError, match="dataset.val_path: .* is a directory"):
        validate(cfg)
