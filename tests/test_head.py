"""rb without the reference's [B, T, V] logits in backward (issue 31): klbench.models.head gives them again a row
block at a time from the reference's last hidden states, for every architecture whose logits are its head's
output as is, and the gradient is the one computed from the kept logits."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from klbench.estimators.sampling import Sampling, target_batch
from klbench.models.gpt2_score import sdpa_mask
from klbench.models.hf import load_causal_lm
from klbench.models.lora import WithoutAdapter, add_lora
from klbench.models.policies import LMPolicy
from klbench.models.rollout import position_ids_from_mask

PROMPTS = ["the film was", "a slow and quiet"]


def _policy(path, ref_path=None, lora=False, **kw) -> LMPolicy:
    """pi_ref from ref_path, or the base of `path` with the policy moved away from it (a LoRA adapter, or noise)."""
    model, tok = load_causal_lm(path)
    if lora:
        model = add_lora(model, 4, 8, 0.0, None)
    if ref_path is None:
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p)) if p.requires_grad else None
    ref = WithoutAdapter(model) if lora else load_causal_lm(ref_path or path)[0]
    return LMPolicy(model, ref, tok, 10, **kw)


def _rows_of(policy, ro):
    pos, att = position_ids_from_mask(ro.attention), sdpa_mask(ro.attention)
    with torch.no_grad():
        return policy._logits(policy.ref, ro, pos, att)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "gemma3", "mistral", "phi3", "llama-lora"])
def test_rows_give_the_reference_logits_again(arch, tiny_arch, tiny_lm_dir, monkeypatch):
    path = tiny_lm_dir if arch == "gpt2" else tiny_arch(arch.split("-")[0])[0]
    policy = _policy(path, lora=arch.endswith("lora"))
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 3)
    logits, rows = _rows_of(policy, ro)  # [B, L, V]
    assert rows is not None
    B, L = ro.mask.shape
    blocks = [(slice(None),), (0, slice(0, 3)), (0, slice(3, 5)), (0, slice(1, 2)), (1, slice(0, 1)),
              (B - 1, slice(2, L))]
    for span in (None, 2):  # whole sequences projected at once (the default here), and 2 positions at a time
        if span:
            monkeypatch.setattr("klbench.models.head.SPAN_ELEMENTS", span * logits.shape[-1])
            logits, rows = _rows_of(policy, ro)
        for i in blocks:  # the same matmul on other row blocks: float32 rounding apart
            torch.testing.assert_close(rows(i), logits[i], rtol=1e-5, atol=1e-5)


def test_a_post_processed_head_keeps_the_logits(tiny_arch):
    """Gemma 2 softcaps its logits after the head: the head's output is not the logits, so no rows."""
    policy = _policy(tiny_arch("gemma2")[0])
    ro = policy.rollout(PROMPTS, 2)
    assert _rows_of(policy, ro)[1] is None


def _saved_vocab_tensors(policy, ro, V):
    """The [..., V] tensors autograd saves while rb's batch is scored and its loss built, and the loss."""
    saved = []

    def pack(t):
        if t.shape and t.shape[-1] == V:
            saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch = policy.score(ro, kappa=True)
        loss = (batch.logp * batch.token_kl.detach()).sum() + batch.token_kl.sum()
    return saved, batch, loss


@pytest.mark.parametrize("sampling,target", [(Sampling(), "sampler"), (Sampling(0.7, 0, 0.9), "sampler"),
                                             (Sampling(0.7), "tempered_vs_raw")])
@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_rb_backward_keeps_no_reference_logits_and_has_the_same_gradient(arch, sampling, target, tiny_arch,
                                                                         tiny_lm_dir):
    path, ref = (tiny_lm_dir, None) if arch == "gpt2" else tiny_arch("qwen2")
    policy = _policy(path, ref, sampling=sampling, kl_target=target)
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 3)
    V = policy.model.get_output_embeddings().weight.shape[0]
    saved, batch, loss = _saved_vocab_tensors(policy, ro, V)
    assert not any(t.untyped_storage().data_ptr() == batch.ref_logits.untyped_storage().data_ptr() for t in saved)
    loss.backward()
    got = [p.grad.clone() for p in policy.trainable()]
    # the same step from the kept raw reference logits (target_batch without ref_rows)
    policy.model.zero_grad()
    logits, _ = policy._logits(policy.model, ro, position_ids_from_mask(ro.attention), sdpa_mask(ro.attention))
    kept = target_batch(logits, _rows_of(policy, ro)[0], ro.tokens[:, ro.prompt_len:], ro.mask, sampling, target,
                        kappa=True)
    ((kept.logp * kept.token_kl.detach()).sum() + kept.token_kl.sum()).backward()
    for g, p in zip(got, policy.trainable()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
