"""task.sampler in whole runs: a bf16-engine run and a lag-2 run of the embedded default finish on the CPU with the
sampler named at start-up and the mismatch meter logged; a lag-2 run resumed equals the straight run, and a resume
that changes the lag or lacks the engine's weights is refused in one line with the run left as it was; every bad
combination is one line before any model loads."""
from __future__ import annotations

import csv
import math

import mlflow
import pytest
import torch

from klbench.config.errors import ConfigError
from klbench.record.resume import ResumeError
from klbench.tasks.train import check_config, run_task
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")

# a spec that pretrains in seconds (tests/test_instantiate.py's), on a tiny RL step
TINY = ["model=embedded", "model.spec.corpus_size=200", "model.spec.n_embd=16", "model.spec.n_layer=1",
        "model.spec.n_head=2", "model.spec.steps=3", "model.spec.batch_size=8", "model.spec.max_len=32",
        "task.max_steps=4", "task.val_every=4", "task.log_every=1", "task.prompts_per_step=2", "task.n_samples=2",
        "task.max_new_tokens=6", "task.val_prompts=2", "logger=csv"]
TABULAR = ["experiment=tabular", "task.sampler.lag=2", "task.val_every=4", "task.max_steps=8", "task.log_every=1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("embedded_cache")  # the tiny LM is pretrained once for the module


@pytest.mark.parametrize("engine,named", [("task.sampler.precision=bf16", "a bf16 copy of the policy"),
                                          ("task.sampler.lag=2", "the weights of 2 optimiser steps ago")])
def test_an_engine_run_of_the_embedded_default_names_it_and_logs_the_meter(tmp_path, cache, capsys, engine, named):
    run_task(compose_cfg(tmp_path, TINY + [engine, f"paths.cache={cache}"]))
    out = capsys.readouterr().out
    assert f"klbench: rollouts: an engine that is not the trainer: {named}; the KL batch's behaviour policy: the " \
           "engine's own log-probs (task.behaviour=sampler)" in out
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    k1 = [float(r["train/mismatch_k1"]) for r in rows if r.get("train/mismatch_k1")]
    chi2 = [float(r["train/mismatch_chi2"]) for r in rows if r.get("train/mismatch_chi2")]
    assert len(k1) == len(chi2) == 4 and all(math.isfinite(v) for v in k1 + chi2)
    # bf16 moves every step's log-probs; a lag only once the weights have moved (steps 0-2 sample the start's)
    assert max(chi2) > 0 and (engine.endswith("bf16") and min(chi2) > 0 or not engine.endswith("bf16"))


def test_a_lag_run_resumes_exactly_and_a_changed_or_missing_queue_is_refused(tmp_path):
    straight = run_task(compose_cfg(tmp_path / "a", TABULAR + ["logger=none"]))
    first = compose_cfg(tmp_path / "b", TABULAR + ["task.max_steps=4"])
    run_task(first)
    resumed = run_task(compose_cfg(tmp_path / "b", TABULAR + ["ckpt_path=last", "ckpt_allow_changes=[task.max_steps]"]))
    for key in ("val/seq_kl", "val/reward"):  # the queue carried the weights of steps 2 and 3 across the resume
        assert math.isclose(resumed[key], straight[key], rel_tol=1e-12), key
    ckpt = next((tmp_path / "b").rglob("last.ckpt"))
    before = ckpt.read_bytes()
    client = mlflow.MlflowClient(first.logger.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(first.logger.experiment).experiment_id])
    assert run.data.params["sampling.engine"] == "an engine that is not the trainer: the weights of 2 optimiser steps ago"
    assert run.data.params["sampling.behaviour"] == "sampler"

    def refused(*over: str) -> str:
        with pytest.raises(ResumeError) as e:
            run_task(compose_cfg(tmp_path / "b", [*TABULAR, "task.max_steps=12", "ckpt_path=last", *over]))
        assert "\n" not in str(e.value)
        assert ckpt.read_bytes() == before  # the run stays as it was: its checkpoint, its record
        assert client.get_run(run.info.run_id).info.status == "FINISHED"
        return str(e.value)

    assert "task.sampler.lag (2 in the checkpoint, 1 now)" in refused("task.sampler.lag=1",
                                                                      "ckpt_allow_changes=[task.max_steps]")
    assert refused("task.sampler.lag=1", "ckpt_allow_changes=[task.max_steps,task.sampler.lag]").startswith(
        f"task.sampler.lag=1: {ckpt} was made at task.sampler.lag=2")
    state = torch.load(ckpt, weights_only=True)
    del state["sampler_engine"]  # a checkpoint without the engine's weights (another writer's, or an older one's)
    torch.save(state, ckpt)
    before = ckpt.read_bytes()
    assert refused("ckpt_allow_changes=[task.max_steps]").startswith(
        f"task.sampler.lag=2: {ckpt} holds the rollout engine's weights of 0 of the 2 steps before step 8")


BAD = [
    (["model=embedded", "task.sampler.precision=bf16", "task.top_p=0.9"],
     "task.behaviour=sampler with task.sampler's task.sampler.precision=bf16 and a truncating sampler (top_p=0.9)"),
    (["model=embedded", "task.sampler.lag=2", "estimator=seq"],
     "task.sampler.lag=2 draws the rollouts with an engine that is not the trainer, and task.behaviour=sampler"),
    (["experiment=tabular", "task.sampler.attn_implementation=eager"],
     "task.sampler.attn_implementation=eager: model=tabular is a table of logits"),
    (["experiment=tabular", "task.sampler.lag=1", "task.inner_steps=2", "task.val_every=2", "task.max_steps=4"],
     "task.sampler.lag=1 with task.inner_steps=2"),
    (["model=embedded", "task.sampler.lag=1", "kl_ctl=adaptive"], "kl_ctl=adaptive with task.sampler.lag=1"),
    (["model=embedded", "task.sampler.precision=bf16", "hardware=fsdp", "hardware.devices=2"],
     "task.sampler.precision=bf16 copies the whole policy into a rollout engine, and hardware=fsdp"),
    (["task.behaviour=engine"], "task.behaviour"),
    (["experiment=tabular", "task.pg_correction.mode=token_mask"], "task.pg_correction.mode=token_mask: with "
     "model=tabular the sampler is the table itself"),
    (["experiment=tabular", "task.sampler.lag=1", "task.pg_correction.mode=token_mask", "task.inner_steps=2",
      "task.val_every=2", "task.max_steps=4", "estimator=in_reward"], "task.pg_correction.mode=token_mask with "
     "task.inner_steps=2"),
]


@pytest.mark.parametrize("over,start", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_combinations_are_one_line_before_any_model_loads(tmp_path, over, start):
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(tmp_path, over))  # the config alone: no model is built or loaded
    assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)


def test_a_precision_the_device_cannot_run_is_one_line(tmp_path, monkeypatch):
    real = torch.nn.functional.linear

    def linear(x, w, b=None):  # a CPU without float16 kernels, as torch reports one
        if x.dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    check_config(compose_cfg(tmp_path, ["model=embedded", "task.sampler.precision=bf16"]))  # bf16 runs
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(tmp_path, ["model=embedded", "task.sampler.precision=float16"]))
    assert str(e.value) == ("task.sampler.precision=float16: this cpu cannot run torch.float16 (\"addmm_impl_cpu_\" "
                            "not implemented for 'Half'); use task.sampler.precision=bf16 or same")


def test_the_pg_correction_weights_the_engines_samples(tmp_path):
    """task.pg_correction in a run: the reward term's weights pi / pi_s of a lagged engine's samples are logged
    (train/pg_weight_*), 1 exactly while the engine still holds the weights the trainer has (step 0)."""
    run_task(compose_cfg(tmp_path, ["experiment=tabular", "task.sampler.lag=1", "task.max_steps=6", "task.val_every=6",
                                    "task.log_every=1", "task.pg_correction.mode=sequence_truncate", "logger=csv"]))
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("train/pg_weight_mean")]
    w = {int(r["step"]): float(r["train/pg_weight_mean"]) for r in rows}
    assert sorted(w) == list(range(6)) and w[0] == 1.0  # step 0: the engine holds the trainer's own weights
    assert all(w[s] != 1.0 for s in range(1, 6))  # step s draws with step s - 1's
