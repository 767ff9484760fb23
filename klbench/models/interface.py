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
from klbench.models.sampler_lines import engine_truncation
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
    by_engine: bool = False  # drawn by a rollout engine that is not the trainer (task.sampler)

    def rows(self, i: int, j: int) -> "Rollout":
        """Sequences i..j-1: the same prompt length P (left padding kept), every per-sequence field sliced."""
        cut = {f.name: getattr(self, f.name)[i:j] for f in fields(self)
               if f.name not in ("prompt_len", "by_engine") and getattr(self, f.name) is not None}
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
    # the rollout engine of a training step where it is not the trainer (klbench.models.sampler_engine, task.sampler),
    # and which log-probs a batch it drew carries as its behaviour policy (task.behaviour)
    engine = None
    behaviour: str = "sampler"

    def rollout(self, prompts: list[str], n: int, engine: bool = False) -> Rollout:
        """n samples y ~ pi_s per prompt (ancestral; pi itself at plain sampling). engine: drawn by the training
        steps' rollout engine where it is not the trainer (set_engine); validation and the probe draw with pi."""
        raise NotImplementedError

    def set_engine(self, spec, behaviour: str = "sampler") -> None:
        """A rollout engine that is not the trainer (a klbench.models.sampler_engine.EngineSpec that differs),
        and task.behaviour. Refuses, in one line, what no weight can fix: a truncating sampler (top-k, top-p) whose
        cut the engine makes on its own logits, so that its support need not cover the trainer's pi_s."""
        if behaviour not in ("sampler", "scorer"):
            raise ValueError(f"task.behaviour must be sampler or scorer, got {behaviour!r}")
        self.behaviour = behaviour
        if not spec.differs:
            self.engine = None
            return
        if self.sampling.truncates and behaviour == "sampler":
            raise ValueError(engine_truncation(spec.describe(), self.sampling.describe()))
        self.engine = self._engine(spec)

    def _engine(self, spec):
        raise NotImplementedError

    def sync_engine(self) -> None:
        """At a training step's rollout: the engine takes the weights of task.sampler.lag steps ago."""
        if self.engine is not None:
            self.engine.sync()

    def has_behaviour(self, ro: Rollout) -> bool:
        """Whether a batch of ro has a behaviour policy other than the one it scores: ro was drawn by an engine
        that is not the trainer, or from the tempered pi_s at task.kl_target=model."""
        return ro.by_engine or (self.kl_target == "model" and not self.sampling.is_plain)

    def behaviour_logp(self, ro: Rollout) -> torch.Tensor | None:
        """[B, T] the log-probs the KL batch carries as old_logp from the rollout (task.behaviour=sampler: the
        engine's own), or None: no behaviour policy, or task.behaviour=scorer (the trainer's recomputation)."""
        if self.behaviour != "sampler" or not self.has_behaviour(ro):
            return None
        if ro.sampled_logp is None:
            raise ValueError("task.behaviour=sampler: this rollout kept no log-probs of its own (its sampler returns "
                             "none), so the batch has no behaviour policy to carry; use a sampler that keeps them "
                             "or task.behaviour=scorer")
        return ro.sampled_logp

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
