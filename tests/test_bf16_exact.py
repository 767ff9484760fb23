"""Exact in bf16 (issue 54, part 1): at pi = pi_ref every KL is 0 and every estimator whose per-sample gradient
vanishes there has gradient exactly 0, under bf16 autocast and bf16 weights, on both scoring paths, in klbench's
step and in the TRL integration; where pi != pi_ref the two scoring paths agree under bf16 to float32's rounding.

The bug this pins: head_scores ran the policy's head product in bf16 and the reference's in float32 (its dtype was
read inside a block that had turned autocast off), so kappa at pi = pi_ref came out between -0.03 and 0.05."""
from __future__ import annotations

import contextlib
import csv
import os

import pytest
import torch

import cli_inprocess
from klbench.estimators import KLBatch, gradient_estimator, value_estimator
from klbench.estimators.head_scores import LMHead, head_scores
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["the film was", "a slow and", "i liked", "bad acting"]
AUTOCAST = torch.autocast("cpu", torch.bfloat16)
# per-sample gradients at pi = pi_ref: naive_mc's (and in_loss's k1, the same cell) is grad log pi(y), topk_tail's
# tail term (rho + 1) grad log pi(y) is grad log pi(y) there: zero in expectation only. Every other estimator's
# weight on grad log pi or grad kappa is a KL term, exactly 0 there, so its gradient is exactly 0 per sample.
# topk_trunc's is sum over the top k of grad pi(v), not 0 even in expectation: its documented bias
NONZERO_AT_EQUALITY = {"naive_mc", "in_loss", "topk_tail", "topk_trunc"}


def _heads(dtype):
    g = torch.Generator().manual_seed(0)
    N, H, V = 64, 64, 345
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (3 * torch.randn(V, H, generator=g)).requires_grad_()  # logits of tens of nats: bf16 rounds them by ~0.05
    return h, LMHead(w, dtype=dtype), torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, None], ids=["head_float32", "head_autocast"])
def test_identical_heads_give_zero_kl_and_gradient_under_autocast(dtype):
    h, head, y = _heads(dtype)
    with AUTOCAST:
        s = head_scores(h, head, y, h.detach(), LMHead(head.weight.detach(), dtype=dtype), with_token_kl=True)
    assert torch.equal(s.kappa, torch.zeros_like(s.kappa)), float(s.kappa.abs().max())
    assert torch.equal(s.logp, s.ref_logp)
    gh, gw = torch.autograd.grad(s.kappa.sum(), (h, head.weight))  # rb's gradient through kappa
    assert not gh.any() and not gw.any(), (float(gh.abs().max()), float(gw.abs().max()))


def _pair(tmp_path, policy_dir, ref_dir, *extra):
    from klbench.models.policies import build_policy, task_sampling
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={policy_dir}", f"model.ref_name_or_path={ref_dir}",
                                 "task.max_new_tokens=8", *extra])
    return build_policy(cfg.model, cfg.task.max_new_tokens, sampling=task_sampling(cfg.task)[0])


def _precision(policy, mode):
    """bf16-mixed: autocast around the step; bf16-true: bfloat16 weights, as Lightning's two precisions run."""
    if mode == "bf16-true":
        policy.model.to(torch.bfloat16)
        policy.ref.to(torch.bfloat16)
        return contextlib.nullcontext()
    return torch.autocast("cpu", torch.bfloat16)


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("logits", [False, True], ids=["hidden", "logits"])
def test_every_estimator_is_exact_at_pi_equal_pi_ref(tmp_path, tiny_arch, mode, logits):
    from klbench.probe.measure import gradient_variants
    policy_dir, _ = tiny_arch("llama")
    policy = _pair(tmp_path, policy_dir, policy_dir)
    with _precision(policy, mode):
        torch.manual_seed(0)
        ro = policy.rollout(PROMPTS, 2)
        batch = policy.score(ro, with_token_kl=True, logits=logits)
        assert batch.mask.sum() > 8
        for name in ("mc", "k2", "cv", "rb"):
            v = value_estimator(name)(batch)
            assert torch.equal(v, torch.zeros_like(v)), (name, v)
        params = policy.trainable()
        for label, (name, options) in gradient_variants().items():
            est = gradient_estimator(name, **options)
            if est.reads_logits and not logits:
                continue  # top-k estimators read the whole distribution: the logits path serves them
            surrogate = est(batch).mean()
            assert surrogate.requires_grad, label
            grads = torch.autograd.grad(surrogate, params, retain_graph=True, allow_unused=True)
            # None: no gradient reached the parameter (head_scores' backward skips an all-zero upstream): zero
            largest = max((float(g.abs().max()) for g in grads if g is not None), default=0.0)
            if name in NONZERO_AT_EQUALITY:
                assert largest > 0  # grad log pi(y): the pitfall stays as documented
            else:
                assert largest == 0, (label, largest)


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16-true"])
def test_the_two_scoring_paths_agree_under_bf16(tmp_path, tiny_arch, mode):
    """pi != pi_ref (a tiny Llama against another of its vocabulary): log pi, log pi_ref and kappa from the hidden
    states and from the [B, L, V] logits, the head's product in float32 on both (model.head_dtype)."""
    policy = _pair(tmp_path, *tiny_arch("llama"))
    with _precision(policy, mode):
        torch.manual_seed(0)
        ro = policy.rollout(PROMPTS, 2)
        a, b = (policy.score(ro, with_token_kl=True, logits=lg) for lg in (False, True))
    assert float(a.token_kl.sum(-1).mean()) > 0.1
    for name in ("logp", "ref_logp", "token_kl"):
        x, y = getattr(a, name).detach(), getattr(b, name).detach()
        assert torch.allclose(x, y, rtol=0, atol=2e-5), (name, float((x - y).abs().max()))


def _metrics(folder) -> dict[int, dict[str, float]]:
    rows = {}
    for r in csv.DictReader(open(folder / "csv" / "metrics.csv")):
        rows.setdefault(int(r["step"]), {}).update({k: float(v) for k, v in r.items() if v not in ("", None)})
    return rows


@pytest.mark.parametrize("hardware", ["bf16", "bf16_true"])
@pytest.mark.parametrize("path", ["hidden", "logits"])
def test_the_step_logs_zero_kl_and_takes_zero_gradient_at_step_0(tmp_path, hardware, path):
    """`klbench hardware=bf16 ...` at step 0, where pi = pi_ref: every logged KL is 0, and with no reward the
    step's gradient (rb's alone) is 0. The float32 run's figures were already so; bf16 logged kl_rb = -0.037."""
    folder = tmp_path / "run"
    args = [f"hardware={hardware}", "reward=none", "task.max_steps=1", "task.val_every=1", "task.log_every=1",
            "task.prompts_per_step=4", "task.n_samples=2", f"model.scoring_path={path}", "logger=csv",
            f"hydra.run.dir={folder}"]
    proc = cli_inprocess.run(args, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("hidden states" in proc.stdout + proc.stderr) == (path == "hidden")
    step0 = _metrics(folder)[0]
    kls = {k: v for k, v in step0.items() if k.startswith("train/kl_")}
    assert {"train/kl_rb", "train/kl_mc"} <= set(kls) and all(v == 0 for v in kls.values()), kls
    assert step0["train/grad_norm"] == 0, step0["train/grad_norm"]


def test_trl_logs_zero_kl_at_pi_equal_pi_ref_under_its_default_bf16(tiny_arch, tmp_path):
    """TRL's GRPOConfig defaults to bf16 autocast: at its first step (pi = pi_ref) klbench/seq_kl is 0."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig

    from klbench.integrations import trl as integration
    policy_dir, _ = tiny_arch("llama")
    args = GRPOConfig(output_dir=str(tmp_path), beta=0.1, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=8, report_to="none", use_cpu=True, use_vllm=False, save_strategy="no",
                      logging_steps=1, max_steps=1, learning_rate=1e-3)
    assert args.bf16  # TRL's default on a CPU with bf16
    trainer = integration.GRPOTrainer(model=policy_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                      args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), kl_estimator="rb")
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "klbench/seq_kl" in h]
    assert log["klbench/seq_kl"] == 0.0, log
