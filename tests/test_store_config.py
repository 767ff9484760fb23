"""The `store` group switches both records with one override, and a server store without its URLs is
refused before anything starts, naming the field; a single run needs no Optuna URL, a sweep does. A
password in a store URL is redacted wherever klbench writes the URL (klbench.record.redact; the end-to-end
checks against real servers are in tests/stores/test_secrets.py)."""
from __future__ import annotations

import logging
import warnings

import pytest

import cli_inprocess
from klbench.config.compose import compose
from klbench.record.redact import RedactHydraFiles, redact, redact_logs, redact_obj
from klbench.config.schema import ConfigError, validate

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
    r = cli_inprocess.run(["store=server"], cwd=tmp_path, env=env)
    assert r.returncode == 1
    assert "klbench: error: store.mlflow must be the URL of an `mlflow server`" in r.stderr
    assert not (tmp_path / "outputs" / "mlflow.db").exists()


def test_single_run_needs_no_optuna_url(monkeypatch, tmp_path):
    monkeypatch.delenv("KLBENCH_OPTUNA_STORAGE", raising=False)
    validate(compose(["store=server", f"store.mlflow={MLFLOW}"], outputs=tmp_path / "outputs", hydra=True))


def test_sweep_needs_the_optuna_url(monkeypatch, tmp_path):
    from klbench.sweep.study import prepare_study
    monkeypatch.delenv("KLBENCH_OPTUNA_STORAGE", raising=False)
    cfg = compose(["sweep=rl_beta", "store=server", f"store.mlflow={MLFLOW}"], outputs=tmp_path / "outputs",
                  hydra=True)
    with pytest.raises(ConfigError, match=r"^store.optuna must be an SQLAlchemy database URL.*a sweep with "
                                          r"store=server keeps its Optuna study there, got null"):
        prepare_study(cfg)


def test_cli_refuses_a_server_sweep_without_optuna_url(tmp_path):
    """Before any trial starts or any server is contacted (the MLflow URL points nowhere)."""
    env = {"PATH": "/usr/bin:/bin", "KLBENCH_OUTPUTS": str(tmp_path / "outputs"), "HF_HUB_OFFLINE": "1"}
    r = cli_inprocess.run(["-m", "sweep=rl_beta", "experiment=tabular", "store=server",
                           "store.mlflow=http://127.0.0.1:9"], cwd=tmp_path, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "klbench sweep: ConfigError: store.optuna must be" in r.stderr
    assert not list((tmp_path / "outputs").rglob("klbench.log"))  # no trial ran


# ---- redaction ----

@pytest.mark.parametrize("text,clean", [
    ("postgresql+psycopg://klbench:s3cr%40t@db:5432/klbench", "postgresql+psycopg://klbench:***@db:5432/klbench"),
    ("postgresql+psycopg://klbench@db/klbench", "postgresql+psycopg://klbench@db/klbench"),  # user only
    ("postgresql+psycopg://db/klbench", "postgresql+psycopg://db/klbench"),  # no credentials
    ("sqlite:////shared/optuna.db", "sqlite:////shared/optuna.db"),
    ("postgresql://db/k?user=klbench&password=s3cret&sslmode=require",
     "postgresql://db/k?user=klbench&password=***&sslmode=require"),
    ("postgresql://db/k?PASSWORD=s3cret", "postgresql://db/k?PASSWORD=***"),
    ("http://alice:pw@mlflow:5000", "http://alice:***@mlflow:5000"),
    ("https://:token@mlflow.example/", "https://:***@mlflow.example/"),
    ("http://127.0.0.1:5000/#/experiments/1", "http://127.0.0.1:5000/#/experiments/1"),
    # Hydra's overrides escape the colons
    ("store.mlflow=http\\://alice\\:pw@127.0.0.1\\:5000", "store.mlflow=http\\://alice\\:***@127.0.0.1\\:5000"),
    # inside YAML, a repr and a log line: cut at the URL's end
    ("['store.optuna=mysql+pymysql://u:p/w@db/k', 'x=a@b']", "['store.optuna=mysql+pymysql://u:***@db/k', 'x=a@b']"),
    ("mlflow: http://127.0.0.1:5000\nemail: a@b", "mlflow: http://127.0.0.1:5000\nemail: a@b"),
    ("[HYDRA] Storage: postgresql+psycopg://k:pw@h/k (study x)",
     "[HYDRA] Storage: postgresql+psycopg://k:***@h/k (study x)"),
])
def test_redact(text, clean):
    assert redact(text) == clean
    assert redact(clean) == clean


def test_redact_obj_and_the_run_params(monkeypatch, tmp_path):
    from klbench.record.tracking import flat_params
    assert redact_obj({"a": ["http://u:pw@h", 1, None], "b": ("x=password=pw",)}) == \
        {"a": ["http://u:***@h", 1, None], "b": ("x=password=***",)}
    monkeypatch.setenv("KLBENCH_OPTUNA_STORAGE", "postgresql+psycopg://klbench:pgpw@db/klbench")
    cfg = compose(["store=server", "store.mlflow=http://alice:mlpw@mlflow:5000"], outputs=tmp_path)
    params = flat_params(cfg)
    assert params["store.optuna"] == "postgresql+psycopg://klbench:***@db/klbench"
    assert params["logger.tracking_uri"] == "http://alice:***@mlflow:5000"
    assert not [k for k, v in params.items() if "pgpw" in v or "mlpw" in v]
    assert cfg.store.optuna == "postgresql+psycopg://klbench:pgpw@db/klbench"  # the run itself keeps it


def test_log_records_and_warnings_are_redacted(caplog):
    redact_logs()
    redact_logs()  # idempotent: one wrapper
    log = logging.getLogger("klbench.test_redact")
    with caplog.at_level(logging.INFO, logger="klbench.test_redact"):
        log.info("Storage: %s", "postgresql://k:pw1@h/k")
        try:
            raise RuntimeError("cannot reach http://u:pw2@h:5000")
        except RuntimeError:
            log.exception("failed")
    text = caplog.text + "".join(logging.Formatter().format(r) for r in caplog.records)
    assert "Storage: postgresql://k:***@h/k" in text and "http://u:***@h:5000" in text
    assert "pw1" not in text and "pw2" not in text
    assert "pw3" not in warnings.formatwarning("API request to http://u:pw3@h failed", UserWarning, "f.py", 1)


def test_hydra_files_are_rewritten_redacted(tmp_path):
    from omegaconf import OmegaConf
    saved = tmp_path / "run" / ".hydra"
    saved.mkdir(parents=True)
    (saved / "overrides.yaml").write_text("- store.optuna=postgresql://k:pw@h/k\n- seed=1\n")
    (saved / "config.yaml").write_text("seed: 1\n")
    (tmp_path / "multirun.yaml").write_text("x: http://u:pw@h\n")
    config = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "run")}, "output_subdir": ".hydra",
                                         "sweep": {"dir": str(tmp_path)}, "mode": "MULTIRUN"}})
    RedactHydraFiles().on_job_start(config)
    assert (saved / "overrides.yaml").read_text() == "- store.optuna=postgresql://k:***@h/k\n- seed=1\n"
    assert (saved / "config.yaml").read_text() == "seed: 1\n"
    assert (tmp_path / "multirun.yaml").read_text() == "x: http://u:***@h\n"
    assert sorted(p.name for p in saved.iterdir()) == ["config.yaml", "overrides.yaml"]  # no temporary left
