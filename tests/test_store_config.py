"""The `store` group switches both records with one override, and a server store without its URLs is
refused before anything starts, naming the field."""
from __future__ import annotations

import subprocess
import sys

import pytest

from klbench.compose import compose
from klbench.schema import ConfigError, validate

MLFLOW, OPTUNA = "http://mlflow.example:5000", "postgresql+psycopg://klbench@db.example/klbench"


def test_local_store_is_sqlite_in_outputs(tmp_path):
    cfg = compose(["sweep=rl_beta"], outputs=tmp_path / "outputs", hydra=True)
    out = tmp_path / "outputs"
    assert cfg.logger.tracking_uri == f"sqlite:///{out}/mlflow.db"
    assert cfg.logger.artifact_root == f"{out}/mlartifacts"
    assert cfg.hydra.sweeper.storage == f"sqlite:///{out}/optuna.db"


def test_server_store_switches_both(monkeypatch, tmp_path):
    monkeypatch.setenv("KLBENCH_MLFLOW_URI", MLFLOW)
    monkeypatch.setenv("KLBENCH_OPTUNA_STORAGE", OPTUNA)
    cfg = compose(["sweep=rl_beta", "store=server"], outputs=tmp_path / "outputs", hydra=True)
    validate(cfg)
    assert cfg.logger.tracking_uri == MLFLOW and cfg.logger.artifact_root is None  # the server keeps artifacts
    assert cfg.hydra.sweeper.storage == OPTUNA


@pytest.mark.parametrize("overrides,field", [
    ([], "store.mlflow"),
    ([f"store.mlflow={MLFLOW}"], "store.optuna"),
    (["store.mlflow=mlflow.example:5000", f"store.optuna={OPTUNA}"], "store.mlflow"),
    ([f"store.mlflow={MLFLOW}", "store.optuna=/shared/optuna.db"], "store.optuna"),
])
def test_server_store_needs_its_urls(monkeypatch, tmp_path, overrides, field):
    monkeypatch.delenv("KLBENCH_MLFLOW_URI", raising=False)
    monkeypatch.delenv("KLBENCH_OPTUNA_STORAGE", raising=False)
    cfg = compose(["store=server", *overrides], outputs=tmp_path / "outputs", hydra=True)
    with pytest.raises(ConfigError, match=rf"^{field} must be"):
        validate(cfg)


def test_cli_refuses_a_server_store_without_urls(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "KLBENCH_OUTPUTS": str(tmp_path / "outputs"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "klbench.cli", "store=server"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1
    assert "klbench: error: store.mlflow must be the URL of an `mlflow server`" in r.stderr
    assert not (tmp_path / "outputs" / "mlflow.db").exists()
