"""On-policy distillation end to end (tabular with exact KL, tiny LMs with MLflow contents), the errors it
raises before training, and the token-versus-sequence report on synthetic MLflow runs."""
from __future__ import annotations

import math
import os

import mlflow
import numpy as np
import pytest
import torch

from klbench.analysis import distill_report
from klbench.analysis.artifacts import REPORT_FILES, write_report
from klbench.analysis.distill_curves import aggregate, summary_rows
from klbench.analysis.mlflow_io import REPORT_TAG, collect_curves, log_report
from klbench.record.runs import RUN_ID_FILE
from klbench.sweep.distill import DistillReport
from klbench.exact.tabular import TabularModel
from klbench.tasks.train import run_task
from tiny_lms import save_sharpened_variant
from test_config import compose_cfg
import cli_inprocess

TABULAR = ["experiment=distill_tabular", "task.max_steps=20", "task.val_every=10"]
ESTIMATORS = ("token", "seq", "cumulative", "loo", "rb", "vopd", "topk_tail", "topk_trunc")


def only_run(cfg):
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    (r,) = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment).experiment_id])
    return client, r


def exact_seq_kl(student: TabularModel, theta: torch.Tensor, teacher: TabularModel) -> float:
    """KL(student || teacher) by enumerating every complete sequence: sum_y p(y) (log p(y) - log q(y))."""
    log_p = student.seq_logprob(theta)  # [N]
    log_q = teacher.seq_logprob(teacher.ref_logits)  # [N], same enumeration (same K, T, eos)
    return float((log_p.exp() * (log_p - log_q)).sum())


# ---- tabular: the metric is the exact sequence KL, and every sound estimator lowers it ----

@pytest.mark.parametrize("estimator", [e for e in ESTIMATORS if e != "topk_trunc"])  # the pitfall falls short
def test_tabular_distill_lowers_the_exact_kl(tmp_path, single_thread, estimator):
    cfg = compose_cfg(tmp_path, TABULAR + [f"estimator={estimator}"])
    out = run_task(cfg)
    client, r = only_run(cfg)
    m = cfg.model
    student = TabularModel(m.K, m.T, eos=m.eos, seed=m.ref_seed, ref_scale=m.ref_scale)
    teacher = TabularModel(m.K, m.T, eos=m.eos, seed=cfg.teacher.ref_seed, ref_scale=cfg.teacher.ref_scale)
    hist = sorted((h.step, h.value) for h in client.get_metric_history(r.info.run_id, "val/seq_kl"))
    assert [s for s, _ in hist] == [0, 10, 20]
    start = exact_seq_kl(student, student.ref_logits, teacher)  # the student's own table vs the teacher's
    assert start > 2.0 and math.isclose(hist[0][1], start, rel_tol=1e-9)
    theta = torch.load(f"{cfg.paths.ckpt_dir}/last.ckpt", weights_only=False)["state_dict"]["policy.theta"]
    final = exact_seq_kl(student, theta, teacher)
    assert math.isclose(hist[-1][1], final, rel_tol=1e-9)  # MLflow keeps float64
    assert math.isclose(out["val/seq_kl"], final, rel_tol=1e-6)  # Lightning's callback metrics are float32
    assert hist[-1][1] < 0.6 * hist[0][1], hist  # 20 Adam steps at lr 0.1 take off at least 40%
    assert r.data.params["task.name"] == "distill" and r.data.params["estimator.beta"] == "1.0"


# ---- tiny LMs: student and teacher share a tokenizer, differ in weights ----

@pytest.fixture(scope="module")
def tiny_teacher_dir(tiny_lm_dir, tmp_path_factory):
    """tiny_lm_dir's tokenizer files with a differently initialised (and bigger) GPT-2 next to them."""
    return save_sharpened_variant(tiny_lm_dir, tmp_path_factory.mktemp("tiny_teacher"), n_embd=48, n_layer=2,
                                  seed=7, sharpen=20.0)


def lm_distill(tmp_path, student, teacher, extra=()):
    return compose_cfg(tmp_path, ["task=distill", "reward=none", "estimator=loo", "estimator.beta=1.0",
                                  "model=hf", f"model.name_or_path={student}", "model@teacher=hf",
                                  f"teacher.name_or_path={teacher}", "task.max_steps=4", "task.val_every=2",
                                  "task.prompts_per_step=2", "task.val_prompts=4", "task.max_new_tokens=8",
                                  "task.log_every=1", *extra])


def test_tiny_lm_distill_logs_to_mlflow(tmp_path, single_thread, tiny_lm_dir, tiny_teacher_dir):
    cfg = lm_distill(tmp_path, tiny_lm_dir, tiny_teacher_dir)
    out = run_task(cfg)
    client, r = only_run(cfg)
    assert r.info.status == "FINISHED" and r.info.run_name == "loo b=1 s0 distill-hf"
    p = r.data.params
    assert (p["task.name"], p["estimator.name"], p["model.name_or_path"], p["teacher.name_or_path"]) == \
        ("distill", "loo", tiny_lm_dir, tiny_teacher_dir)
    assert r.data.tags["klbench.task"] == "distill" and r.data.tags["klbench.estimator"] == "loo"
    hist = {k: sorted((h.step, h.value) for h in client.get_metric_history(r.info.run_id, k))
            for k in ("val/seq_kl", "val/token_kl", "val/response_len")}
    for k, h in hist.items():
        assert [s for s, _ in h] == [0, 2, 4], k
    # different weights, one tokenizer: a clearly positive KL from the first validation on
    assert hist["val/seq_kl"][0][1] > 0.5
    for (_, seq), (_, tok), (_, n) in zip(hist["val/seq_kl"], hist["val/token_kl"], hist["val/response_len"]):
        assert math.isclose(tok * n, seq, rel_tol=1e-6)  # per token = per sequence / mean length
    for label in ("mc", "k2", "k3", "cv_seq", "cv_opt", "rb"):
        key = f"train/kl_{label}"
        assert [h.step for h in client.get_metric_history(r.info.run_id, key)] == [0, 1, 2, 3], key
    assert r.data.metrics["val/reward"] == 0.0  # reward=none: distillation only
    assert math.isclose(out["val/seq_kl"], hist["val/seq_kl"][-1][1], rel_tol=1e-6)
    mlflow.set_tracking_uri(client.tracking_uri)  # load_table searches through the fluent API
    table = client.load_table(r.info.experiment_id, "samples.json", run_ids=[r.info.run_id])
    assert {"step", "prompt", "response", "seq_kl", "tokens"} <= set(table.columns)
    assert sorted(set(table["step"])) == [0, 2, 4]


# ---- errors, before anything trains or logs ----

def assert_nothing_ran(tmp_path):
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "outputs" / "mlflow.db").exists()


def test_lm_vocab_mismatch_stops_before_training(tmp_path, tiny_lm_dir, other_tiny_lm_dir):
    cfg = lm_distill(tmp_path, tiny_lm_dir, other_tiny_lm_dir)
    with pytest.raises(ValueError, match="student \\(model\\) and teacher tokenizers differ"):
        run_task(cfg)
    assert_nothing_ran(tmp_path)


NO_TEACHER = ["task=distill", "model=tabular", "reward=none", "estimator.beta=1.0"]


@pytest.mark.parametrize("overrides,match", [
    (TABULAR + ["teacher.K=5"], "student and teacher vocabularies differ"),
    (TABULAR + ["teacher.T=5"], "student and teacher vocabularies differ"),
    (TABULAR + ["estimator.beta=0.5"], "estimator.beta must be 1"),
    (NO_TEACHER, "task=distill needs a teacher"),
    (TABULAR + ["task.reward_coef=1.0"], "needs a reward, but reward=none"),
    (TABULAR + ["model@teacher=embedded"], "must both be tabular or both be language models"),
])
def test_tabular_bad_input_stops_before_training(tmp_path, overrides, match):
    cfg = compose_cfg(tmp_path, overrides)
    with pytest.raises(ValueError, match=match):
        run_task(cfg)
    assert_nothing_ran(tmp_path)


# ---- the report, on synthetic runs in a real SQLite store ----

# val/seq_kl at steps 0, 10, 20 for seeds 0, 1, 2: token falls slowly, rb fast
SYNTH = {"token": [[8.0, 6.0, 4.0], [8.0, 6.5, 4.5], [8.0, 5.5, 3.5]],
         "rb": [[8.0, 3.0, 1.0], [8.0, 2.0, 1.5], [8.0, 4.0, 0.5]]}


@pytest.fixture(scope="module")
def synthetic_db(tmp_path_factory):
    """An MLflow SQLite store with the SYNTH runs, plus runs the report must leave out; built once (the
    schema migration alone takes seconds) and copied for every test."""
    from klbench.record.store import ensure_experiment
    root = tmp_path_factory.mktemp("synth")
    uri = f"sqlite:///{root}/mlflow.db"
    exp = ensure_experiment(uri, "distill-synth", str(root / "artifacts"))
    client = mlflow.MlflowClient(uri)

    def make(est, seed, values, status="FINISHED", task="distill"):
        rid = client.create_run(exp, run_name=f"{est}-{seed}", tags={"klbench.task": task}).info.run_id
        for k, v in {"estimator.name": est, "seed": seed, "task.max_steps": 20}.items():
            client.log_param(rid, k, v)
        for step, v in zip((0, 10, 20), values):
            client.log_metric(rid, "val/seq_kl", v, step=step)
        client.set_terminated(rid, status)
        return rid

    ids = {(est, s): make(est, s, vals) for est, rows in SYNTH.items() for s, vals in enumerate(rows)}
    make("seq", 0, [8.0, 0.1, 0.1], status="FAILED")  # a crashed trial
    make("seq", 1, [8.0, 0.1, 0.1], task="rl")  # not distillation
    return root / "mlflow.db", exp, ids


@pytest.fixture
def synthetic_store(tmp_path, synthetic_db):
    """(client, experiment id, {(estimator, seed): run id}) on this test's own copy of the store."""
    import shutil
    db, exp, ids = synthetic_db
    shutil.copy(db, tmp_path / "mlflow.db")
    return mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), exp, ids


def test_report_means_ratios_and_files(tmp_path, synthetic_store):
    client, exp, ids = synthetic_store
    curves, skipped = collect_curves(client, experiment_id=exp)
    assert sorted((c.estimator, c.seed) for c in curves) == sorted(ids)
    assert list(skipped) == ["status FAILED"]
    bands = aggregate(curves)
    assert list(bands) == ["token", "rb"]  # ORDER, not insertion order
    assert bands["rb"].values.shape == (3, 3) and list(bands["rb"].steps) == [0, 10, 20]
    rows = {(r["estimator"], r["step"]): r for r in summary_rows(bands, [0, 10, 20])}
    for est, runs in SYNTH.items():
        arr = np.array(runs)  # [seed, step]
        for i, step in enumerate((0, 10, 20)):
            r = rows[(est, step)]
            assert math.isclose(r["mean"], arr[:, i].mean()) and math.isclose(r["std"], arr[:, i].std(ddof=1))
            assert (r["min"], r["max"], r["n"]) == (arr[:, i].min(), arr[:, i].max(), 3)
    assert math.isclose(rows[("rb", 10)]["ratio_to_token"], 3.0 / 6.0)
    assert math.isclose(rows[("rb", 20)]["ratio_to_token"], 1.0 / 4.0)
    assert rows[("token", 20)]["ratio_to_token"] == 1.0

    rep = write_report(curves, tmp_path / "report", steps=[10, 20])
    assert rep["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and rep["png"].stat().st_size > 10_000
    md = rep["md"].read_text()
    assert "| rb | 3 | 3.000 ± 1.000 (0.50x) | 1.000 ± 0.500 (0.25x) |" in md
    assert "| token | 3 | 6.000 ± 0.500 (1.00x) | 4.000 ± 0.500 (1.00x) |" in md
    lines = rep["csv"].read_text().splitlines()
    assert lines[0] == "estimator,step,n,mean,std,min,max,ratio_to_token"
    assert len(lines) == 1 + 2 * 3  # every step of both estimators, not only the table's


def test_log_report_makes_a_parent_run_and_recomputation_skips_it(tmp_path, synthetic_store):
    client, exp, ids = synthetic_store
    curves, _ = collect_curves(client, experiment_id=exp)
    run_id, _ = log_report(client, exp, curves, tmp_path / "rep", "synthetic")
    rep = client.get_run(run_id)
    assert rep.info.status == "FINISHED" and rep.info.run_name == "distill-report"
    assert {a.path for a in client.list_artifacts(run_id)} == set(REPORT_FILES)
    mean_rb = {m.step: m.value for m in client.get_metric_history(run_id, "report/seq_kl/rb")}
    assert mean_rb == pytest.approx({0: 8.0, 10: 3.0, 20: 1.0})
    ratio = {m.step: m.value for m in client.get_metric_history(run_id, "report/ratio_to_token/rb")}
    assert ratio == pytest.approx({0: 1.0, 10: 0.5, 20: 0.25})
    assert all(client.get_run(r).data.tags["mlflow.parentRunId"] == run_id for r in ids.values())
    again, _ = collect_curves(client, parent_run_id=run_id)  # the report's children are the trials
    assert sorted(c.run_id for c in again) == sorted(ids.values())


def test_callback_reports_the_sweep_folder(tmp_path, synthetic_store):
    """DistillReport.on_multirun_end with a sweep folder whose trials wrote their MLflow run ids."""
    from omegaconf import OmegaConf
    client, exp, ids = synthetic_store
    sweep = tmp_path / "sweep"
    for n, rid in enumerate(ids.values()):
        (sweep / str(n)).mkdir(parents=True)
        (sweep / str(n) / RUN_ID_FILE).write_text(rid + "\n")
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "model": {"kind": "tabular"},
                            "logger": {"kind": "mlflow", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
                                       "experiment": "distill-synth", "artifact_root": "unused: the experiment exists"}})
    DistillReport(steps=[0, 20]).on_multirun_end(cfg)
    md = (sweep / "report" / REPORT_FILES[1]).read_text()
    assert "| rb | 3 | 8.000 ± 0.000 (1.00x) | 1.000 ± 0.500 (0.25x) |" in md
    reports = client.search_runs([exp], f"tags.`{REPORT_TAG}` = 'distill'")
    assert len(reports) == 1 and reports[0].data.tags["klbench.report.sources"] == f"sweep_dir={sweep}"


def test_cli_recomputes_from_an_experiment(tmp_path, synthetic_store, capsys):
    out = tmp_path / "cli"
    argv = ["--experiment", "distill-synth", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db",
            "--out", str(out), "--no-log"]
    assert distill_report.main(argv) == 0
    assert "| rb | 3 |" in capsys.readouterr().out and (out / REPORT_FILES[0]).is_file()
    assert distill_report.main(argv[:1] + ["nope"] + argv[2:]) == 1
    assert "unknown experiment 'nope'; available: ['Default', 'distill-synth']" in capsys.readouterr().err


def test_cli_reads_the_store_runs_write(tmp_path, synthetic_store, monkeypatch, capsys):
    """As klbench-pareto: the store is $KLBENCH_OUTPUTS/mlflow.db and the files go under $KLBENCH_OUTPUTS,
    not under ./outputs."""
    import shutil
    outputs = tmp_path / "elsewhere"
    outputs.mkdir()
    shutil.copy(tmp_path / "mlflow.db", outputs / "mlflow.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("KLBENCH_OUTPUTS", str(outputs))
    monkeypatch.chdir(tmp_path)
    assert distill_report.main(["--experiment", "distill-synth", "--no-log"]) == 0
    assert "| rb | 3 |" in capsys.readouterr().out
    assert list((outputs / "distill_report").glob(f"*/{REPORT_FILES[1]}")) and not (tmp_path / "outputs").exists()


# ---- the one command, through Hydra's multirun and the callback ----

@pytest.mark.parametrize("experiment,kind", [("distill_estimators", "embedded"),
                                             ("distill_estimators_tabular", "tabular")])
def test_comparison_configs(experiment, kind):
    """Eight estimators x three seeds at one step budget, the report callback, and no hydra.mode (users pass -m)."""
    from klbench.config.compose import compose
    cfg = compose([f"experiment={experiment}"], hydra=True)
    params = cfg.hydra.sweeper.params
    assert sorted(params.estimator.split(",")) == sorted(ESTIMATORS) and params.seed.split(",") == ["0", "1", "2"]
    assert cfg.hydra.mode is None and cfg.hydra.sweeper._target_.endswith("BasicSweeper")
    assert cfg.hydra.callbacks.distill_report._target_ == "klbench.sweep.distill.DistillReport"
    assert (cfg.task.name, cfg.estimator.beta, cfg.model.kind, cfg.teacher.kind) == ("distill", 1.0, kind, kind)
    assert cfg.logger.experiment == f"distill-estimators-{kind}"


def test_distill_estimators_multirun_end_to_end(tmp_path):
    """`klbench -m experiment=distill_estimators_tabular`, shrunk: 8 estimators x 1 seed, then the report
    (the only test of the multirun + callback wiring, so it stays in the default set despite its time)."""
    env = {**os.environ, "KLBENCH_OUTPUTS": str(tmp_path / "outputs"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = cli_inprocess.run(["-m", "experiment=distill_estimators_tabular", "task.max_steps=6", "task.val_every=3",
                              "hydra.sweeper.params.seed=0", f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "sweep" / "report" / REPORT_FILES[1]).read_text()
    for est in ESTIMATORS:
        assert f"| {est} | 1 |" in md
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/outputs/mlflow.db")
    exp = client.get_experiment_by_name("distill-estimators-tabular").experiment_id
    (rep,) = client.search_runs([exp], f"tags.`{REPORT_TAG}` = 'distill'")
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{rep.info.run_id}'")
    assert sorted(c.data.params["estimator.name"] for c in children) == sorted(ESTIMATORS)
