"""task.behaviour on a language model: a batch drawn by an engine that is not the trainer (a bf16 copy of a
float32 policy) carries the engine's own log-probs as old_logp on every scoring path (hidden states, logits at
T = 1, micro-batches), the trainer's with task.behaviour=scorer, and a rollout that kept none is one line."""
from __future__ import annotations

import pytest
import torch

from klbench.models.hf import load_causal_lm
from klbench.models.lm_policy import LMPolicy
from klbench.models.sampler_engine import EngineSpec
from klbench.models.scoring import Scoring

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["The movie was", "I watched it"]


def _policy(path: str, behaviour: str = "sampler", sampler: str = "kv_cache") -> LMPolicy:
    model, tok = load_causal_lm(path, "float32")
    ref, _ = load_causal_lm(path, "float32")
    with torch.no_grad():  # away from the reference, and sharp enough that bf16 rounding moves the log-probs
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    policy = LMPolicy(model, ref, tok, 6, sampler=sampler)
    policy.set_engine(EngineSpec(precision="bf16"), behaviour)
    policy.sync_engine()
    return policy


def test_the_engines_logprobs_are_the_behaviour_on_every_path(tiny_lm_dir):
    policy = _policy(tiny_lm_dir)
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 3, engine=True)
    assert ro.by_engine and ro.sampled_logp is not None
    m = ro.mask
    for kwargs in ({}, {"logits": True}, {"micro_batch_size": 2}, {"micro_batch_size": 2, "logits": True}):
        batch = policy.score(ro, **kwargs)
        assert batch.old_logp is not None, kwargs  # at T = 1: the old target_batch dropped them
        torch.testing.assert_close(batch.old_logp[m], ro.sampled_logp[m].to(batch.old_logp.dtype), rtol=0, atol=0)
        gap = (batch.logp.detach() - batch.old_logp)[m].abs().max()
        assert gap > 1e-4, (kwargs, gap)  # a real mismatch: bf16 against float32


def test_the_micro_batch_context_is_the_trainers_not_the_engines(tiny_lm_dir):
    """What a loss reads across sequences (loo's group, token_mean's count) is the trainer's log-probs: the
    engine's stand in for them only where the engine is the trainer."""
    policy = _policy(tiny_lm_dir, "scorer")
    torch.manual_seed(1)
    ro = policy.rollout(PROMPTS, 3, engine=True)
    whole = policy.score(ro)
    context = Scoring(policy, ro, 2, True).context
    torch.testing.assert_close(context.logp[ro.mask], whole.logp.detach()[ro.mask], rtol=0, atol=1e-5)
    assert (context.logp - ro.sampled_logp)[ro.mask].abs().max() > 1e-4


def test_behaviour_scorer_keeps_the_batch_on_policy(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, "scorer")
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2, engine=True)
    for kwargs in ({}, {"logits": True}):
        assert policy.score(ro, **kwargs).old_logp is None
    # validation draws with the trainer: its rollouts are no engine's, whatever task.behaviour
    assert not policy.rollout(PROMPTS, 1).by_engine


def test_a_rollout_without_logprobs_is_one_line(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, sampler="generate")  # generate() returns tokens only
    ro = policy.rollout(PROMPTS, 2, engine=True)
    with pytest.raises(ValueError, match=r"^task.behaviour=sampler: this rollout kept no log-probs of its own") as e:
        policy.score(ro)
    assert "\n" not in str(e.value)
