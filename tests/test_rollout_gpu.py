"""The rollout engine on CUDA: the same tokens as generate() in float32, bfloat16 and bf16 autocast, the same RNG
stream after, a scoring pass that backpropagates, and `klbench` RL runs with hardware=gpu and hardware=bf16.

Marked gpu, so excluded by default (pyproject addopts); skipped where no CUDA device is visible. On a GPU machine:
    HF_HUB_OFFLINE=1 python -m pytest -m gpu tests/test_rollout_gpu.py
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from klbench.estimators import gradient_estimator
from klbench.models.hf import load_causal_lm
from klbench.models.policies import LMPolicy
from klbench.models.rollout import generate_sample, kv_cache_sample
# tests/ is on sys.path (a rootdir conftest, no __init__.py), as for `from test_config import ...` elsewhere:
# the CPU test's prompts, batch, stand-in EOS and its model fixtures, reused rather than copied
from test_rollout import (EMBEDDED, PROMPTS, _batch, _frequent_token,  # noqa: F401
                          embedded_dir, gpt2_dir)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")]

CUDA = torch.device("cuda")
# how the weights are held and the forward runs: bf16-autocast is what hardware=bf16 (precision: bf16-mixed)
# does, float32 weights under torch.autocast, through the rollout as well as the scoring pass
PRECISIONS = ["float32", "bfloat16", "bf16-autocast"]



def _load(path: str, precision: str):
    """(model on CUDA, tokenizer, a fresh context manager factory the forwards run under)."""
    model, tok = load_causal_lm(path, "bfloat16" if precision == "bfloat16" else "float32")
    model.to(CUDA)
    if precision == "bf16-autocast":
        return model, tok, lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return model, tok, contextlib.nullcontext


def _where_they_differ(got: torch.Tensor, ref: torch.Tensor) -> str:
    if got.shape != ref.shape:
        return f"shapes differ: kv_cache {tuple(got.shape)}, generate {tuple(ref.shape)}"
    rows, steps = (got != ref).nonzero(as_tuple=True)
    return f"{len(rows)} tokens differ, first at row {int(rows[0])} step {int(steps[0])}"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("which", ["embedded", "gpt2"])
def test_same_tokens_as_generate_on_cuda(which, precision, request):
    """test_rollout.test_same_tokens_as_generate on CUDA: token for token, including EOS, the pads after it and
    the batch's early stop; and the CUDA (and CPU) RNG state after, so a run's later steps do not move either."""
    model, tok, forward_ctx = _load(request.getfixturevalue(f"{which}_dir"), precision)
    ids, attn = (t.to(CUDA) for t in _batch(tok))  # [B, P] left-padded
    new = model.config.n_positions - ids.shape[1]
    for seed in range(2):
        with forward_ctx():
            if which == "gpt2":  # its own eos, and GPT-2's convention for a tokenizer without a pad token
                eos = pad = tok.eos_token_id
            else:  # the embedded model rarely ends a text this early: a frequent token stands in; its own pad
                eos, pad = _frequent_token(model, tok, ids, attn, new, seed), tok.pad_token_id
            torch.manual_seed(seed)  # seeds the CUDA generator too: torch.multinomial on CUDA draws from it
            ref = generate_sample(model, ids, attn, new, eos, pad).tokens
            after_ref = torch.cuda.get_rng_state(), torch.get_rng_state()
            torch.manual_seed(seed)
            got = kv_cache_sample(model, ids, attn, new, eos, pad)
        assert got.tokens.device.type == "cuda" and got.logp.device.type == "cuda"
        assert got.logp.dtype == torch.float32  # the sampling softmax is float32 whatever the weights
        assert torch.equal(got.tokens, ref), f"seed {seed}: " + _where_they_differ(got.tokens, ref)
        # the same draws consumed: the Philox offset of the CUDA generator, and nothing drawn on the CPU
        assert torch.equal(torch.cuda.get_rng_state(), after_ref[0])
        assert torch.equal(torch.get_rng_state(), after_ref[1])
        hit = got.tokens == eos  # [B, L]
        assert hit.any(1).all()
        ended = hit.int().argmax(1)  # [B] each row's first EOS
        assert len(set(ended.tolist())) > 1  # rows ended at different steps ...
        length = got.tokens.shape[1]
        assert length == int(ended.max()) + 1 < new  # ... and the batch stopped at the last of them
        steps = torch.arange(length, device=CUDA)
        after = steps > ended[:, None]  # [B, L] past each row's EOS
        assert (got.tokens[after] == pad).all()
        assert (got.logp[after] == 0).all()
        assert (got.logp[~after] < 0).all() and got.logp.isfinite().all()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_hidden_state_scoring_gives_the_logits_path_on_cuda(precision, gpt2_dir, tiny_lm_dir):
    """Scoring from hidden states (klbench.estimators.head_scores) against the logits path, on CUDA in each
    precision: log-probs, kappa and the rb gradient of every parameter, to the precision's rounding."""
    model, tok, ctx = _load(gpt2_dir, precision)
    ref, _, _ = _load(tiny_lm_dir, precision)
    policy = LMPolicy(model, ref, tok, max_new_tokens=20)
    assert policy.scoring_reason is None
    torch.manual_seed(0)
    with ctx():
        ro = policy.rollout(PROMPTS, 4)
    runs = []
    for logits in (False, True):
        with ctx():
            batch = policy.score(ro, with_token_kl=True, logits=logits)
            loss = gradient_estimator("rb")(batch).mean()
        runs.append((batch, torch.autograd.grad(loss, policy.trainable())))
    (a, ga), (b, gb) = runs
    tol = 1e-4 if precision == "float32" else 3e-2
    m = ro.mask
    torch.testing.assert_close(a.logp.detach()[m], b.logp.detach()[m], atol=tol, rtol=tol)
    torch.testing.assert_close(a.token_kl.detach()[m], b.kappa.detach()[m], atol=tol, rtol=tol)
    worst = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(ga, gb))
    assert worst < tol * 3, worst


@pytest.mark.parametrize("precision", PRECISIONS)
def test_rollout_score_backward_on_cuda(precision, gpt2_dir, tiny_lm_dir):
    """LMPolicy.rollout + score + the rb gradient's backward, all on CUDA. The reference is another model on the
    same tokenizer (tiny_lm_dir, without gpt2_dir's EOS bias), so KL > 0 and the gradient is not zero."""
    model, tok, forward_ctx = _load(gpt2_dir, precision)
    ref, _, _ = _load(tiny_lm_dir, precision)
    policy = LMPolicy(model, ref, tok, max_new_tokens=20)
    torch.manual_seed(0)
    with forward_ctx():
        ro = policy.rollout(PROMPTS, 4)
        batch = policy.score(ro)
        loss = gradient_estimator("rb")(batch).mean()
    assert ro.tokens.device.type == "cuda" and batch.logp.device.type == "cuda"
    assert ro.sampled_logp.shape == batch.logp.shape == ro.mask.shape
    if precision == "float32":  # bf16 logits differ between the decode steps and the one scoring pass
        torch.testing.assert_close(ro.sampled_logp[ro.mask], batch.logp.detach()[ro.mask], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in policy.trainable()]
    assert all(g is not None and g.device.type == "cuda" for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.float().abs().sum()) for g in grads) > 0
    assert all(p.grad is None for p in ref.parameters())  # the reference stays frozen


@pytest.mark.parametrize("hardware", ["gpu", "bf16"])
def test_rl_run_on_cuda(hardware, embedded_dir, tmp_path):
    """A 3-step RL run through the `klbench` entry point (python -m klbench.cli, as tests/test_record.py runs it) on
    EMBEDDED's model: embedded_dir built it into this session's KLBENCH_CACHE, which the process inherits."""
    spec = [f"model.spec.{k}={v}" for k, v in EMBEDDED.items()]
    overrides = [f"hardware={hardware}", "logger=none", *spec, "task.max_steps=3", "task.val_every=3",
                 "task.log_every=1", "task.prompts_per_step=4", "task.val_prompts=4", "task.max_new_tokens=16"]
    env = {**os.environ, "KLBENCH_OUTPUTS": str(tmp_path / "outputs"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "klbench.cli", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "klbench: 3 steps in" in proc.stdout
    assert "building the embedded" not in proc.stderr  # the fixture's model, not a second build
    (ckpt,) = (tmp_path / "outputs").glob("runs/*/*/checkpoints/last.ckpt")
    # Lightning saves the module's state_dict as it is, on the device it trained on
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert ckpt.is_file() and {t.device.type for t in state.values()} == {"cuda"}
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_same_tokens_as_generate_on_cuda_under_sampling(precision, gpt2_dir):
    """test_sampling_wire's generate() equality at T = 0.7, top-k 50, top-p 0.9 and a two-id stop list, on CUDA."""
    from klbench.estimators.sampling import Sampling
    model, tok, forward_ctx = _load(gpt2_dir, precision)
    ids, attn = (t.to(CUDA) for t in _batch(tok))
    s = Sampling(0.7, 50, 0.9)
    stops = [tok.eos_token_id, _frequent_token(model, tok, ids, attn, 20, 0)]
    with forward_ctx():
        torch.manual_seed(0)
        ref = generate_sample(model, ids, attn, 20, stops, tok.pad_token_id, s).tokens
        torch.manual_seed(0)
        got = kv_cache_sample(model, ids, attn, 20, stops, tok.pad_token_id, s)
    assert torch.equal(got.tokens, ref), _where_they_differ(got.tokens, ref)
