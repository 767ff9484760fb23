"""tinker-cookbook 0.6.1: on-policy distillation's KL-penalty reward, `incorporate_kl_penalty`
(tinker_cookbook/distillation/train_on_policy.py), at kl_discount_factor 0 (its default: each token's advantage
is minus its own log-ratio) and 1 (the undiscounted sum of the log-ratios still to come).

The function is async and works on tinker.Datum objects: it asks each datum's teacher, a tinker.SamplingClient
of the remote tinker service, for the teacher's log-probs of the whole sequence, subtracts them from the sampled
log-probs (datum.loss_fn_inputs["logprobs"], the sampler's: KLBatch.old_logp, or the current ones detached
on-policy), and adds -kl_penalty_coef * (discounted) log-ratio to loss_fn_inputs["advantages"]. The adapter
builds real tinker.Datum / ModelInput / TensorData values (zero advantages: only the KL moves the policy,
kl_penalty_coef = 1) and a stand-in teacher client whose compute_logprobs returns KLBatch.ref_logp (the
teacher's log-prob of each response token, after the prompt position) through the same .coroutine() call;
then runs the installed function under asyncio. tinker's own update runs on the service; its importance-sampling
loss is -sum_t w_t A_t with the per-token ratio w_t = pi / pi_sampler, so the per-sequence surrogate here is
sum_t w_t sg(-A_t) (w_t = 1 in value on-policy). The distribution and its imports: scripts/install_libraries.sh.

At a temperature (Setting.scored): tinker-cookbook's rollouts sample with a temperature and keep the sampling
client's log-probs of the sampled tokens, those of pi_s (tinker-cookbook #689), while the teacher's come from
compute_logprobs, which takes no temperature: the installed function then charges log pi_s(y_t) - log pi_ref(y_t)
per token. The adapter passes it exactly those two (the sampler's log-probs from klbench's Sampling.process, the
service's arithmetic being out of reach). The update runs on the service, which scores the trained model without a
temperature: the ratio w_t = pi(y_t) / pi_s(y_t) of the untempered policy to the sampler, as the service's
importance-sampling loss uses it (an assumption about remote code, stated as such).
"""
from __future__ import annotations

import asyncio

import torch

from klbench.estimators import KLBatch
from klbench.estimators.sampling import token_logprob
from klbench.libraries.base import Library, Setting, line_of, old_or_current, require, source_of

DIST, SUPPORTED = "tinker-cookbook", "0.6.1"
DISCOUNTS = {"tinker_cookbook.distill.discount0": 0.0, "tinker_cookbook.distill.discount1": 1.0}


class _Teacher:
    """Stands in for a tinker.SamplingClient: compute_logprobs(model_input).coroutine() gives the teacher's
    log-prob of every token of the sequence, the first (prompt) position first, as the service does."""

    def __init__(self, logprobs: list[float]):
        self.logprobs = logprobs

    def compute_logprobs(self, model_input):
        async def result():
            return [None] + self.logprobs

        class _Future:
            def coroutine(self_inner):
                return result()
        return _Future()


def load() -> Library:
    version = require(DIST, SUPPORTED)
    import tinker
    from tinker_cookbook.distillation import train_on_policy as top

    lib = Library(DIST, version)
    src = source_of(top.incorporate_kl_penalty)
    sampled_at = line_of(top.incorporate_kl_penalty, 'loss_fn_inputs["logprobs"]')
    teacher_at = line_of(top.incorporate_kl_penalty, "compute_logprobs(sequence_input)")
    divides = (f"policy (the sampler's), not the teacher: the sampler's log-probs (`{sampled_at}`); the teacher's "
               f"from compute_logprobs (`{teacher_at}`), which takes no temperature; old: the sampler itself")

    def advantages(batch: KLBatch, gamma: float, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] the advantages incorporate_kl_penalty writes, from zero; `sampled` [B, T] the sampler's
        log-probs (default: KLBatch.old_logp, or the current ones detached on-policy)."""
        sampled = (old_or_current(batch) if sampled is None else sampled).detach()  # [B, T]
        data, teachers = [], []
        for b in range(sampled.shape[0]):
            L = int(batch.mask[b].sum())
            data.append(tinker.Datum(model_input=tinker.ModelInput.from_ints([0] * L), loss_fn_inputs={
                "target_tokens": tinker.TensorData.from_torch(torch.zeros(L, dtype=torch.long)),
                "logprobs": tinker.TensorData.from_torch(sampled[b, :L].clone()),
                "mask": tinker.TensorData.from_torch(torch.ones(L)),
                "advantages": tinker.TensorData.from_torch(torch.zeros(L))}))
            teachers.append(_Teacher(batch.ref_logp[b, :L].detach().tolist()))
        asyncio.run(top.incorporate_kl_penalty(data, teachers, [0] * len(data), kl_penalty_coef=1.0,
                                               kl_discount_factor=gamma))
        out = torch.zeros_like(sampled)
        for b, d in enumerate(data):
            adv = d.loss_fn_inputs["advantages"].to_torch()
            out[b, :adv.shape[0]] = adv.to(out.dtype)
        return out

    for name, gamma in DISCOUNTS.items():
        def loss(batch: KLBatch, gamma=gamma) -> torch.Tensor:
            adv = advantages(batch, gamma)  # [B, T]
            zero = torch.zeros((), dtype=batch.logp.dtype)
            return torch.where(batch.mask, torch.exp(batch.log_w) * (-adv), zero).sum(-1)

        def scored(batch, sampling, gamma=gamma) -> torch.Tensor:
            sampler = token_logprob(sampling.process(batch.logits.detach()), batch.tokens)  # [B, T] log pi_s(y)
            zero = torch.zeros((), dtype=batch.logp.dtype)
            sampler = torch.where(batch.mask, sampler, zero)
            adv = advantages(batch, gamma, sampler)  # [B, T] teacher: batch.ref_logp, untempered
            return torch.where(batch.mask, torch.exp(batch.logp - sampler) * (-adv), zero).sum(-1)

        lib.settings[name] = Setting(
            name, loss, src, "per-token advantages (the library's), importance-sampling surrogate (klbench's)",
            f"kl_penalty_coef=1, kl_discount_factor={gamma}" + (" (default)" if gamma == 0 else ""), task="distill",
            scored=scored, divides_by_t=divides)
    return lib
