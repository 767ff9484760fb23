"""End-to-end RL runs (tabular and a tiny LM), MLflow contents, resume, bad input, failure handling."""
from __future__ import annotations

import math

import mlflow
import pytest
import torch

from klbench.tasks.train import run_task
from test_config import compose_cfg


def mlflow_run(cfg):
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    exp = client.get_experiment_by_name(cfg.logger.experiment)
    runs = client.search_runs([exp.experiment_id])
    return client, runs


TABULAR = ["experiment=tabular", "task.max_steps=30", "task.val_every=10"]


def test_tabular_rl_learns_and_logs_to_mlflow(tmp_path):
    cfg = compose_cfg(tmp_path, TABULAR + ["task.max_steps=60"])
    out = run_task(cfg)
    client, runs = mlflow_run(cfg)
    assert len(runs) == 1
    r = runs[0]
    assert r.info.status == "FINISHED"
    assert r.info.run_name == "rb b=0.5 s0 rl-tabular"  # estimator and beta first (issue 21)
    assert r.data.params["estimator.name"] == "rb" and r.data.params["model.kind"] == "tabular"
    for key in ("val/reward", "val/seq_kl", "val/frontier_gap", "val/kl_ref_pi", "train/kl_mc", "train/kl_k3",
                "train/kl_rb", "train/kl_cv_opt", "train/reward", "train/entropy", "train/grad_norm"):
        assert key in r.data.metrics, key
    history = client.get_metric_history(r.info.run_id, "val/reward")
    assert [m.step for m in history] == [0, 10, 20, 30, 40, 50, 60]
    assert history[-1].value > history[0].value + 0.5  # RL moved the policy towards reward
    assert math.isclose(out["val/seq_kl"], r.data.metrics["val/seq_kl"], rel_tol=1e-6)
    assert out["val/frontier_gap"] >= -1e-6  # nobody beats the exact frontier
    arts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"config.yaml", "samples.json"} <= arts


def test_tabular_val_seq_kl_is_exact(tmp_path):
    from klbench.models.policies import build_policy
    from klbench.rewards.reward import build_reward
    from klbench.tasks import build_task
    from klbench.tasks.train import build_data
    cfg = compose_cfg(tmp_path, TABULAR + ["logger=none"])
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.cache)
    with torch.no_grad():
        policy.theta.add_(torch.randn_like(policy.theta))
    module = build_task(cfg, policy, build_reward(cfg.reward, policy))
    exact = module._exact_metrics({"val/reward": 0.0, "val/seq_kl": 0.0})
    assert math.isclose(exact["val/seq_kl"], float(policy.table.kl_pi_ref(policy.theta.detach())), rel_tol=1e-12)
    assert exact["val/seq_kl"] > 0.1 and build_data(cfg, policy.fixed_prompt).val


def test_tiny_lm_rl_run_logs_to_mlflow(tmp_path, tiny_lm_dir):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}", "task.max_steps=4",
                                 "task.val_every=2", "task.prompts_per_step=4", "task.val_prompts=4",
                                 "task.max_new_tokens=8", "task.log_every=1", "estimator=naive_mc",
                                 "estimator.beta=1.0"])
    out = run_task(cfg)
    client, runs = mlflow_run(cfg)
    (r,) = runs
    assert r.info.status == "FINISHED"
    assert r.data.params["model.name_or_path"] == tiny_lm_dir
    for key in ("val/reward", "val/seq_kl", "val/token_kl", "train/kl_rb", "train/kl_mc", "train/entropy"):
        assert key in r.data.metrics and math.isfinite(r.data.metrics[key]), key
    # the untrained reference starts the run at KL 0: policy == reference at step 0
    first = client.get_metric_history(r.info.run_id, "val/seq_kl")[0]
    assert first.step == 0 and abs(first.value) < 1e-5
    # every sound KL gradient is exactly zero at pi == pi_ref, and the random tiny LM earns no reward;
    # naive_mc's per-sample noise (zero only in expectation) is what moves it away from the reference
    assert out["val/seq_kl"] > 0
    mlflow.set_tracking_uri(client.tracking_uri)  # load_table searches through the fluent API
    table = client.load_table(r.info.experiment_id, "samples.json", run_ids=[r.info.run_id])
    assert {"step", "prompt", "response", "reward", "seq_kl"} <= set(table.columns) and len(table) > 0


def test_resume_continues_exactly(tmp_path):
    """20 steps straight == 10 steps, stop, resume to 20: same step, optimizer and RNG streams."""
    straight = compose_cfg(tmp_path / "a", TABULAR + ["task.max_steps=20", "task.val_every=10", "logger=none"])
    full = run_task(straight)
    first = compose_cfg(tmp_path / "b", TABULAR + ["task.max_steps=10", "task.val_every=10"])
    run_task(first)
    resumed = compose_cfg(tmp_path / "b", TABULAR + ["task.max_steps=20", "task.val_every=10", "ckpt_path=last",
                                                 "ckpt_allow_changes=[task.max_steps]"])
    out = run_task(resumed)
    assert math.isclose(out["val/seq_kl"], full["val/seq_kl"], rel_tol=1e-9)
    assert math.isclose(out["val/reward"], full["val/reward"], rel_tol=1e-9)
    ckpt = torch.load(f"{resumed.paths.ckpt_dir}/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 20 and "rng" in ckpt and ckpt["optimizer_states"]
    client, runs = mlflow_run(resumed)
    assert len(runs) == 1  # the resumed run continued the same MLflow run
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "val/reward")]
    assert steps == [0, 10, 20]


@pytest.mark.parametrize("overrides,match", [
    (["estimator.beta=-0.1"], "estimator.beta must be a finite number >= 0"),
    (["+estimator.lam=0.5"], "estimator.lam does not apply to estimator 'rb'"),
    (["estimator=loo", "task.n_samples=1"], "task.n_samples >= 2"),
    (["estimator=naive_cv", "estimator.level=tok"], "level must be 'token' or 'sequence'"),
    (["model=tabular"], "model=tabular needs reward=tabular"),
    (["model=hf", "model.name_or_path=/nonexistent/model"], "/nonexistent/model"),
    (["reward=hf_classifier", "reward.name_or_path=/nonexistent/clf", "model=tabular", "reward.kind=hf_classifier"],
     "model=tabular needs reward=tabular"),
    (["hardware=gpu"], "no CUDA GPU"),
])
def test_bad_input_stops_before_training(tmp_path, overrides, match):
    if overrides == ["hardware=gpu"] and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    cfg = compose_cfg(tmp_path, overrides)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        run_task(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_reward_path(tmp_path, tiny_lm_dir):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}", "reward=hf_classifier",
                                 "reward.name_or_path=/nonexistent/clf"])
    with pytest.raises(FileNotFoundError, match="/nonexistent/clf"):
        run_task(cfg)


def test_vocab_mismatch(tmp_path, tiny_lm_dir, other_tiny_lm_dir):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}",
                                 f"model.ref_name_or_path={other_tiny_lm_dir}"])
    with pytest.raises(ValueError, match="tokenizers differ"):
        run_task(cfg)


def test_non_finite_loss_fails_the_run(tmp_path, monkeypatch):
    from klbench.exact.tabular import TabularReward
    calls = {"n": 0}
    original = TabularReward.__call__

    def poisoned(self, ids):
        calls["n"] += 1
        r = original(self, ids)
        return r * float("nan") if calls["n"] > 5 else r

    monkeypatch.setattr(TabularReward, "__call__", poisoned)
    cfg = compose_cfg(tmp_path, TABULAR + ["task.val_every=100"])
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step \d+"):
        run_task(cfg)
    _, runs = mlflow_run(cfg)
    assert [r.info.status for r in runs] == ["FAILED"]


def test_ddp_two_cpu_processes(tmp_path):
    """A real 2-process DDP run through the CLI (Lightning relaunches the Hydra command for rank 1)."""
    import os
    import subprocess
    env = {**os.environ, "KLBENCH_OUTPUTS": str(tmp_path / "outputs"), "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    import sys
    from pathlib import Path
    klbench = str(Path(sys.executable).with_name("klbench"))  # the installed entry point, found without PATH
    proc = subprocess.run([klbench, "experiment=tabular", "hardware=ddp", "hardware.accelerator=cpu",
                           "hardware.devices=2", "task.max_steps=6", "task.val_every=3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/outputs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("klbench").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # rank 1 logs nothing of its own
    assert runs[0].data.params["hardware.strategy"] == "ddp"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "val/seq_kl")]
    assert steps == [0, 3, 6]


def test_clamps_that_fire_reach_the_record(tmp_path):
    """estimate(batch).n_clamped, logged at every logged step as train/n_clamped: a clamp this tight fires
    on most tokens, and no clamp logs no count."""
    cfg = compose_cfg(tmp_path, TABULAR + ["estimator=naive_cv", "estimator.clamp=0.01", "task.max_steps=10",
                                           "task.log_every=1"])
    run_task(cfg)
    client, runs = mlflow_run(cfg)
    counts = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "train/n_clamped")}
    assert sorted(counts) == list(range(10))
    assert counts[0] == 0 and all(counts[s] > 0 for s in range(1, 10))  # step 0: pi = pi_ref, every k3 term is 0
    cfg = compose_cfg(tmp_path / "none", TABULAR + ["estimator=naive_cv", "task.max_steps=10"])
    run_task(cfg)
    client, runs = mlflow_run(cfg)
    assert "train/n_clamped" not in runs[0].data.metrics


def test_a_library_setting_trains_as_the_estimator(tmp_path):
    """estimator=trl_grpo runs TRL's own GRPO KL code as the loss (its gradient: partial_kl_pi_ref, see
    docs/libraries.md): with beta = 3 it holds the policy nearer pi_ref than the same run with beta = 0, and
    the run records the setting."""
    from klbench.libraries import LibraryMissing, load
    try:
        load("trl")
    except LibraryMissing as e:
        pytest.skip(str(e))
    kl = {}
    for beta in (0.0, 3.0):
        cfg = compose_cfg(tmp_path / f"beta{beta}", TABULAR + ["estimator=trl_grpo", f"estimator.beta={beta}",
                                                               "task.max_steps=20", "task.val_every=20"])
        kl[beta] = run_task(cfg)["val/seq_kl"]
    params = mlflow_run(cfg)[1][0].data.params
    assert params["estimator.name"] == "library" and params["estimator.setting"] == "trl.grpo"
    assert kl[3.0] < 0.5 * kl[0.0], kl


def test_an_unknown_library_setting_is_one_line_naming_the_valid_ones(tmp_path):
    from klbench.config.errors import ConfigError
    from klbench.libraries import LibraryMissing, load
    try:
        load("verl")
    except LibraryMissing as e:
        pytest.skip(str(e))
    cfg = compose_cfg(tmp_path, TABULAR + ["estimator=library", "estimator.setting=verl.nope", "logger=none"])
    with pytest.raises(ConfigError, match=r"estimator.setting=verl.nope: verl 0.9.1 has no such setting; valid: "
                                          r"verl.kl_penalty.k1, "):
        run_task(cfg)


def test_train_metrics_only_where_something_reads_them(tmp_path, monkeypatch):
    """logger=none with output that is not a terminal (as under pytest) still computes the train/ metrics: the
    plain progress lines show the latest reward and KL (klbench.console.progress.TrainingLines). They draw no
    random numbers: the run's results are those of the same run with MLflow. With nothing that reads them (no
    logger, no bar, no progress lines) they are skipped."""
    from klbench.console import progress
    from klbench.tasks.rl import RLTask
    calls = []
    original = RLTask.log_train
    monkeypatch.setattr(RLTask, "log_train", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    quiet = run_task(compose_cfg(tmp_path / "none", TABULAR + ["logger=none"]))
    assert len(calls) == 30 // 5  # task.log_every=5: the progress lines read them
    logged = run_task(compose_cfg(tmp_path / "mlflow", TABULAR))
    assert len(calls) == 2 * (30 // 5)
    monkeypatch.setattr(progress, "lines", lambda: [])  # nothing reads them
    calls.clear()
    unread = run_task(compose_cfg(tmp_path / "unread", TABULAR + ["logger=none"]))
    assert calls == [] and unread == quiet
    assert quiet == logged
