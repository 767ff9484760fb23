"""The Policy interface the RL and distillation tasks drive, and the Rollout it returns.

A policy samples from pi_s (`sampling`: temperature, top-k, top-p; plain pi by default) and scores the KL target it
holds (`kl_target`, klbench/estimators/sampling.py): which KL the run regularises and measures. The reward term
always follows the sampler: its REINFORCE log-prob is log pi_s(y) (`Policy.scored_sampler_logp`).
Two policies implement it: klbench.models.lm_policy.LMPolicy (any AutoModelForCausalLM pair: policy, frozen
reference) and klbench.models.tabular_policy.TabularPolicy (the enumerable tabular model, so that the same
Lightning module runs against exact ground truth). What is special about the tabular model lives behind this
interface: the tasks, the probe and the sweeps ask a policy for its prompt and its ground truth, never for its type.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from klbench.estimators import KLBatch
from klbench.estimators.vocab_exact import exact_token_entropy
from klbench.estimators.sampling import Sampling, token_logprob
from klbench.models.rollout import PLAIN, stop_ids
from klbench.models.scoring import ScoredBatch, WholeBatch


@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, P + L] left-padded prompt then response (LM) or [B, T] (tabular)
    attention: torch.Tensor  # [B, P + L] 1 on real prompt tokens and real response tokens
    prompt_len: int  # P
    mask: torch.Tensor  # [B, L] bool, response tokens up to and including the first stop id
    group: torch.Tensor  # [B] prompt index: the n samples of one prompt share it
    texts: list[str]  # decoded responses
    prompts: list[str]
    seq_ids: torch.Tensor | None = None  # [B] tabular sequence ids
    sampled_logp: torch.Tensor | None = None  # [B, L] the sampler's log pi_s of its tokens, where it keeps them

    def rows(self, i: int, j: int) -> "Rollout":
        """Sequences i..j-1: the same prompt length P (left padding kept), every per-sequence field sliced."""
        cut = {f.name: getattr(self, f.name)[i:j] for f in fields(self)
               if f.name != "prompt_len" and getattr(self, f.name) is not None}
        return replace(self, **cut)


def token_entropy(batch: KLBatch) -> torch.Tensor | None:
    """[B, T] exact per-position entropy of the batch's policy (0 off the mask), or None without its logits."""
    if isinstance(batch, ScoredBatch) and batch.entropy is not None:
        return batch.entropy
    if batch.logits is None:
        return None
    return exact_token_entropy(batch.logits, batch.mask, batch.chunk_rows)


def has_distributions(batch: KLBatch) -> bool:
    """Whether rb's exact per-position KL is available: the full logits, or their reduction (ScoredBatch)."""
    return batch.logits is not None or batch.token_kl is not None


def response_mask(resp: torch.Tensor, eos_ids) -> torch.Tensor:
    """[B, L] True up to and including the first stop id (any of `eos_ids`: an id or a list); after it, padding."""
    stops = torch.tensor(stop_ids(eos_ids), dtype=resp.dtype, device=resp.device)
    is_eos = torch.isin(resp, stops).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


class Policy(nn.Module):
    """pi, trained, and pi_ref, frozen. Subclasses implement rollout, score, trainable, device and reference;
    a policy whose truth is computable (the tabular model) also overrides the exact_* methods."""

    # a policy that ignores prompts names the one prompt its batches repeat (they only set the batch
    # shape); None: prompts come from the `dataset` group
    fixed_prompt: str | None = None
    # how rollouts sample (pi_s) and which KL score() builds its batch for (klbench/estimators/sampling.py)
    sampling: Sampling = PLAIN
    kl_target: str = "sampler"

    def rollout(self, prompts: list[str], n: int) -> Rollout:
        """n samples y ~ pi_s per prompt (ancestral; pi itself at plain sampling)."""
        raise NotImplementedError

    def score(self, ro: Rollout, micro_batch_size: int | None = None, with_token_kl: bool = True,
              logits: bool = False) -> KLBatch:
        """The KL target's batch of a rollout's responses (klbench.estimators.sampling.target_batch): the log-probs
        and logits of the two distributions it compares; old_logp = log pi_s for kl_target=model.
        micro_batch_size (task.micro_batch_size; language models): a ScoredBatch built that many sequences at a
        time, whose gradient is the whole batch's (LMPolicy.score).
        with_token_kl: the exact per-position KL (KLBatch.token_kl) is needed (rb's, for its gradient, its value or the logs): a language model
        scores it with the log-probs in one pass. logits: a language model's batch keeps the [B, T, V] logits
        (top-k estimators read them; klbench.models.scoring)."""
        raise NotImplementedError

    def scoring(self, ro: Rollout, micro_batch_size: int | None, with_token_kl: bool):
        """A step's scoring of ro in parts (klbench.models.scoring): here the whole batch at once."""
        return WholeBatch(self.score(ro, micro_batch_size, with_token_kl))

    def scored_sampler_logp(self, ro: Rollout, batch: KLBatch) -> torch.Tensor:
        """[B, T] log pi_s(y), differentiable: the reward term's REINFORCE log-prob (the run maximises the reward
        of the policy as it samples, E_{y ~ pi_s}[r]), and the scorer's side of train/logp_gap. It is batch.logp
        itself wherever the target scores pi_s (sampler; tempered targets without truncation)."""
        if isinstance(batch, ScoredBatch) and batch.scored_sampler_logp is not None:  # computed per micro-batch
            return batch.scored_sampler_logp
        s, target = self.sampling, self.kl_target
        if s.is_plain or target == "sampler" or (target != "model" and not s.truncates):
            return batch.logp
        # batch.logits: the raw logits (model) or already divided by T (tempered targets): cut them as pi_s does
        warp = s if target == "model" else Sampling(top_k=s.top_k, top_p=s.top_p)
        return token_logprob(warp.process(batch.logits), ro.tokens[:, ro.prompt_len:])

    def on_target(self) -> "Policy":
        """A view of this policy (the same modules) whose rollouts are y ~ the target's own policy, where the run's
        are not: kl_target=model samples pi_s, and the value estimators need y ~ pi (validation measures the
        target's KL on these). The policy itself where its rollouts serve."""
        if self.kl_target != "model" or self.sampling.is_plain:
            return self
        view = copy.copy(self)  # shallow: shares the parameters; only the sampling attribute differs
        view.sampling = PLAIN
        return view

    def trainable(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def check_prompts(self, prompts: list[str], source: str) -> None:
        """ValueError, naming `source` (the dataset field or file), for prompts this policy cannot complete;
        a policy that ignores prompts accepts all."""

    def reference(self) -> "Policy":
        """A policy of the same kind whose rollouts sample from pi_ref (the probe's baseline)."""
        raise NotImplementedError

    def exact_metrics(self, reward=None) -> dict[str, float]:
        """The ground truth at the current parameters, where it is computable: seq_kl (kl_pi_ref), kl_ref_pi,
        and with a reward the policy can enumerate, reward and frontier_gap. {} where it is not."""
        return {}

    def exact_frontier(self, reward):
        """The exact optimal reward-vs-kl_pi_ref frontier (a klbench.exact.tabular.Frontier), or None."""
        return None

    def exact_gradients(self) -> dict[str, torch.Tensor] | None:
        """Exact gradients of kl_pi_ref, kl_ref_pi and the partial gradients (klbench.exact.tabular), or None."""
        return None
