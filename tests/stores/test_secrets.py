"""Credentials in a store URL never reach the record, the run folders, the checkpoints or the console, and
a URL without a password works with libpq's own password file.

Real sweeps against the real servers: PostgreSQL with a password (`postgres_url`) and an `mlflow server`,
reached through a URL that carries a user and password of its own (the server has no auth, so it ignores
them; what is checked is that klbench never writes them). Every byte klbench leaves is searched: MLflow
params, tags and artifacts of every run, every file under the outputs folder (run and sweep folders,
`.hydra/`, `.submitit/`, `last.ckpt`, `klbench.log`), the Optuna study's attributes, stdout and stderr.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from test_sweeps import cli_env

pytestmark = pytest.mark.servers

MLFLOW_PASSWORD = "mlflowsecret1"  # the MLflow server fixture has no auth: any user and password get in
SWEEP = ["-m", "sweep=rl_beta", "experiment=tabular", "estimator=rb", "store=server", "task.max_steps=20",
         "task.val_every=10", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2"]


def _with_mlflow_login(url: str) -> str:
    return url.replace("http://", f"http://klbench:{MLFLOW_PASSWORD}@", 1)


def _sweep(tmp_path: Path, study: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "klbench.cli", *SWEEP, f"hydra.sweeper.study_name={study}", *args],
                       cwd=tmp_path, env=cli_env(tmp_path / "outputs", **env), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _mlflow_texts(url: str, parent: str) -> tuple[int, list[tuple[str, str]]]:
    """(number of runs, [(where, text)]) for every param, tag and artifact of the sweep's parent run and its
    trials' runs, and the tags of their experiment (which other tests' sweeps share)."""
    from mlflow import MlflowClient
    client = MlflowClient(url)
    exp = client.get_experiment(client.get_run(parent).info.experiment_id)
    out = [(f"experiment tag {k}", f"{k}={v}") for k, v in exp.tags.items()]
    runs = [client.get_run(parent), *client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")]
    for run in runs:
        rid = run.info.run_id
        out += [(f"run {rid} param {k}", f"{k}={v}") for k, v in run.data.params.items()]
        out += [(f"run {rid} tag {k}", f"{k}={v}") for k, v in run.data.tags.items()]
        with tempfile.TemporaryDirectory() as d:
            local = Path(client.download_artifacts(rid, "", d))
            out += [(f"run {rid} artifact {p.relative_to(local)}", p.read_bytes().decode("latin-1"))
                    for p in local.rglob("*") if p.is_file()]
    return len(runs), out


def _assert_absent(secrets: list[str], outputs: Path, mlflow_url: str, study, console: str,
                   launcher_files: bool) -> None:
    files = [p for p in outputs.rglob("*") if p.is_file()]
    ckpts = [p for p in files if p.name == "last.ckpt"]
    assert len(ckpts) == 2, ckpts  # one per trial: the checkpoints were searched
    assert any(".hydra" in p.parts for p in files) and any(p.name == "klbench.log" for p in files)
    assert any(".submitit" in p.parts for p in files) == launcher_files
    n_runs, texts = _mlflow_texts(mlflow_url, study.user_attrs["klbench.mlflow_parent_run_id"])
    assert n_runs == 3  # the parent and two trials
    texts += [(str(p.relative_to(outputs)), p.read_bytes().decode("latin-1")) for p in files]
    texts += [("study user attrs", repr(study.user_attrs)), ("console", console)]
    if launcher_files:  # the sweeper plugin keeps the command line's overrides as the trials' attributes
        texts.append(("trial user attrs", repr([t.user_attrs for t in study.trials])))
    leaks = {s: [f"{where}: ...{text[max(0, text.index(s) - 80):text.index(s) + 20]!r}..." for where, text in texts
                 if s in text] for s in secrets}
    assert not any(leaks.values()), f"written to: {leaks}"


def test_sweep_with_passwords_in_the_environment(postgres_url, mlflow_server, tmp_path):
    """Both URLs, with their passwords, in $KLBENCH_OPTUNA_STORAGE and $KLBENCH_MLFLOW_URI; trials as
    local processes (submitit, whose job files in the sweep folder are searched too)."""
    import optuna
    # KLBENCH_VERBOSE=1: Hydra's and Optuna's start-up lines (the storage URL among them), hidden by default,
    # are printed and searched too
    env = {"KLBENCH_OPTUNA_STORAGE": postgres_url, "KLBENCH_MLFLOW_URI": _with_mlflow_login(mlflow_server),
           "KLBENCH_VERBOSE": "1"}
    r = _sweep(tmp_path, "secrets-env", ["hydra/launcher=local"], **env)
    study = optuna.load_study(study_name="secrets-env", storage=postgres_url)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    _assert_absent([urlsplit(postgres_url).password, MLFLOW_PASSWORD], tmp_path / "outputs", mlflow_server, study,
                   r.stdout + r.stderr, launcher_files=True)
    out = r.stdout + r.stderr
    assert "Storage: postgresql+psycopg://klbench:***@127.0.0.1" in out  # still shown, without the password
    assert "open http://klbench:***@127.0.0.1" in out
    assert "password on the command line" not in out


@pytest.mark.parametrize("key", ["store.optuna", "hydra.sweeper.storage"])
def test_sweep_with_passwords_on_the_command_line(postgres_url, mlflow_server, tmp_path, key):
    """Both URLs, with their passwords, as overrides (where Hydra saves them in every .hydra/ folder);
    trials in the sweep's process. klbench writes them nowhere, and says where else they are."""
    import optuna
    args = [f"store.mlflow={_with_mlflow_login(mlflow_server)}", f"{key}={postgres_url}"]
    r = _sweep(tmp_path, f"secrets-{key}", args)
    study = optuna.load_study(study_name=f"secrets-{key}", storage=postgres_url)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    _assert_absent([urlsplit(postgres_url).password, MLFLOW_PASSWORD], tmp_path / "outputs", mlflow_server, study,
                   r.stdout + r.stderr, launcher_files=False)
    out = r.stdout + r.stderr
    assert "password on the command line (store.mlflow=http://klbench:***@127.0.0.1" in out
    sweep_dir = next((tmp_path / "outputs" / "multirun").glob("*/*"))
    saved = (sweep_dir / "0" / ".hydra" / "hydra.yaml").read_text().replace("\\:", ":")  # Hydra escapes colons
    # Hydra's file, rewritten: both URLs still readable
    assert f"{key}=postgresql+psycopg://klbench:***@127.0.0.1" in saved
    assert "store.mlflow=http://klbench:***@127.0.0.1" in saved


def test_password_from_pgpassfile(postgres_url, mlflow_server, tmp_path):
    """The documented form: a URL without a password, which psycopg completes from $PGPASSFILE (libpq's
    ~/.pgpass format), so the password is in no config at all."""
    import optuna
    url = urlsplit(postgres_url)
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"{url.hostname}:{url.port}:klbench:{url.username}:{url.password}\n")
    passfile.chmod(0o600)  # libpq ignores a password file that others can read
    bare = postgres_url.replace(f":{url.password}@", "@")
    assert url.password not in bare
    r = _sweep(tmp_path, "pgpassfile", [], KLBENCH_MLFLOW_URI=mlflow_server, KLBENCH_OPTUNA_STORAGE=bare,
               PGPASSFILE=str(passfile), KLBENCH_VERBOSE="1")
    study = optuna.load_study(study_name="pgpassfile", storage=postgres_url)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    assert f"Storage: {bare}" in r.stdout + r.stderr  # nothing to hide, shown as it is


def test_bare_url_without_password_source_is_refused(postgres_url):
    """Without PGPASSWORD or a password file the server refuses the bare URL: the tests above connect
    because of the password they give, not because the fixture lets anyone in."""
    import optuna
    import sqlalchemy
    url = urlsplit(postgres_url)
    bare = postgres_url.replace(f":{url.password}@", "@")
    env = {k: os.environ.pop(k) for k in ("PGPASSWORD", "PGPASSFILE") if k in os.environ}
    os.environ["PGPASSFILE"] = "/nonexistent"
    try:
        with pytest.raises(sqlalchemy.exc.OperationalError, match="password"):
            optuna.create_study(study_name="bare", storage=bare)
        os.environ["PGPASSWORD"] = url.password  # libpq's other source: the environment
        optuna.create_study(study_name="bare", storage=bare)
    finally:
        os.environ.pop("PGPASSFILE", None)
        os.environ.pop("PGPASSWORD", None)
        os.environ.update(env)


def test_single_run_needs_no_optuna_url(mlflow_server, tmp_path):
    """Only a sweep opens an Optuna study: a single run with store=server runs without store.optuna."""
    from mlflow import MlflowClient
    env = cli_env(tmp_path / "outputs", KLBENCH_MLFLOW_URI=mlflow_server)
    env.pop("KLBENCH_OPTUNA_STORAGE", None)
    r = subprocess.run([sys.executable, "-m", "klbench.cli", "experiment=tabular", "store=server",
                        "task.max_steps=10", "task.val_every=10", "logger.experiment=single-no-optuna"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("single-no-optuna").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["klbench.config.store.optuna"] == "None"
    assert not any(k.startswith("store.") for k in run.data.params)  # bookkeeping is tagged, not a param
