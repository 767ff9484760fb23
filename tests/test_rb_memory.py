"""rb without a [B, T, V] of its own in backward (issue 31): kappa's gradient reads the reference's logits, so they
are kept to backward, and backward writes the logits' gradient into them (token_scores' donate) instead of
allocating one; the gradient is the one computed into a fresh tensor."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from klbench.estimators.sampling import Sampling, target_batch
from klbench.models.hf import load_causal_lm
from klbench.models.policies import LMPolicy
from klbench.models.rollout import position_ids_from_mask

PROMPTS = ["the film was", "a slow and quiet"]
TARGETS = [(Sampling(), "sampler"), (Sampling(0.7, 0, 0.9), "sampler"), (Sampling(0.7), "tempered_vs_raw")]


def _policy(path, ref_path=None, **kw) -> LMPolicy:
    """pi_ref from ref_path, or the model of `path` with the policy moved away from it by noise."""
    model, tok = load_causal_lm(path)
    if ref_path is None:
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return LMPolicy(model, load_causal_lm(ref_path or path)[0], tok, 10, **kw)


def _scored(policy, ro):
    """The two models' [B, L, V] logits as LMPolicy scores them: the policy's a leaf with grad."""
    pos, att = position_ids_from_mask(ro.attention), None
    with torch.no_grad():
        logits, ref = policy._logits(policy.model, ro, pos, att), policy._logits(policy.ref, ro, pos, att)
    return logits.requires_grad_(), ref


def _loss(batch):
    return (batch.logp * batch.token_kl.detach()).sum() + batch.token_kl.sum()  # both of rb's gradient terms


@pytest.fixture(params=["gpt2", "qwen2"])
def pair(request, tiny_arch, tiny_lm_dir):
    return (tiny_lm_dir, None) if request.param == "gpt2" else tiny_arch("qwen2")


@pytest.mark.parametrize("sampling,target", TARGETS)
def test_rb_gradient_is_the_same_written_into_the_reference_logits(pair, sampling, target):
    policy = _policy(*pair, sampling=sampling, kl_target=target)
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 3)
    resp = ro.tokens[:, ro.prompt_len:]
    grads = []
    for donate in (False, True):
        logits, ref = _scored(policy, ro)
        seen = []
        logits.register_hook(seen.append)
        kept = ref.clone()
        _loss(target_batch(logits, ref, resp, ro.mask, sampling, target, with_token_kl=True, donate_ref=donate)).backward()
        grads.append(logits.grad)
        if sampling.is_plain:  # the reference's logits are the batch's own: the gradient went into them
            assert (seen[0].data_ptr() == ref.data_ptr()) == donate
            assert torch.equal(ref, kept) != donate  # given up, or left as they were
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)  # the same arithmetic, another buffer


def test_the_policy_step_gives_up_the_reference_logits(pair):
    """The step's scoring (Scoring.parts: each part backpropagated once) on the logits path hands its reference logits
    to backward, and its gradient of every parameter is the one of a batch that keeps them. Policy.score keeps them:
    its caller may take several gradients of one graph (the probe; tests/test_probe_lm.py)."""
    from klbench.models.scoring import Scoring
    policy = _policy(*pair)
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 3)
    kept_graph = policy.score(ro, with_token_kl=True, logits=True)
    before = kept_graph.ref_logits.clone()
    _loss(kept_graph).backward()
    assert torch.equal(kept_graph.ref_logits, before)  # Policy.score: left as they were
    policy.model.zero_grad()
    ((_, _, batch),) = Scoring(policy, ro, None, with_token_kl=True, logits=True).parts()
    ref = batch.ref_logits
    kept = ref.clone()
    _loss(batch).backward()
    assert not torch.equal(ref, kept)  # backward wrote the gradient into them
    got = [p.grad.clone() for p in policy.trainable()]
    policy.model.zero_grad()
    pos, att = position_ids_from_mask(ro.attention), None
    logits = policy._logits(policy.model, ro, pos, att)
    _loss(target_batch(logits, kept, ro.tokens[:, ro.prompt_len:], ro.mask, policy.sampling, policy.kl_target,
                       with_token_kl=True)).backward()
    for g, p in zip(got, policy.trainable()):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-9)


def test_a_second_backward_through_given_up_logits_is_refused():
    """retain_graph and a second backward would read the gradient as the reference: autograd refuses it."""
    from klbench.estimators.vocab_exact import token_scores
    z = torch.randn(2, 5, 11, requires_grad=True)
    ref, tokens, mask = torch.randn(2, 5, 11), torch.randint(11, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    logp, kappa = token_scores(z, ref, tokens, mask, donate=True)
    (logp.sum() + kappa.sum()).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + kappa.sum()).backward()
