"""Scoring a language model's rollout: the per-position quantities every estimator reads, a micro-batch at a time.

    scoring = Scoring(policy, ro, micro_batch_size, with_token_kl=True)
    for i, j, part in scoring.parts():        # rows i..j-1, a ScoredBatch with gradient
        loss_fn(scoring.splice(part, i, j))   # the whole batch, rows i..j-1 live, the others frozen stand-ins
    scoring.whole()                           # every row's scores, assembled

Two paths give the same numbers (tests/test_head_scores.py); by cost (model.scoring_path=auto, LMPolicy.takes_logits),
the logits path scores a micro-batch whose float32 [m, L, V] logits fit model.logits_budget and whose LM head is at
least 192 wide, the hidden states any other:
- **hidden states**: the policy's and the reference's final hidden states, and their LM heads
  (klbench.models.head), go to klbench.estimators.head_scores, which reduces the vocabulary a tile at a time.
  No [B, L, V] tensor exists, in forward or backward, for any estimator that reads log-probs, kappa and the
  entropy, at any temperature of the KL target.
- **logits**: the [m, L, V] logits of a micro-batch, for what needs more (top-k estimators read the whole
  distribution; a truncating sampler's pi_s is cut from the logits; target=model at T != 1 scores two
  temperatures; a head the fused path cannot read). LMPolicy names the path and why in one line at start-up.

Each sequence gets one forward of the policy with gradient. Whatever a loss reads across sequences (loo's and
grpo's groups, token_mean's token count, the KL fused into a reward) is detached and comes from `context`: the
reference pass (exact), and for the policy's log-probs the sampler's own (the rollout keeps them; float32 on a
CPU gives the scorer's to about 1e-6) or, only where the rollout's do not serve, one pass without gradient.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

import torch

from klbench.estimators import KLBatch
from klbench.estimators.vocab_exact import exact_token_entropy
from klbench.estimators.head_scores import head_logprob, head_scores
from klbench.estimators.sampling import target_batch
from klbench.models.head import final_hidden, gathered_heads
from klbench.models.rollout import attention_backends, position_ids_from_mask

# the fields of a ScoredBatch that hold one row per sequence
ROWS = ("logp", "ref_logp", "mask", "group", "old_logp", "token_kl", "scored_sampler_logp", "entropy")


@dataclass
class ScoredBatch(KLBatch):
    """A KLBatch of per-position reductions: token_kl (rb's kappa) where asked for, no [B, T, V] logits (unless a
    single part of the logits path keeps them).

    scored_sampler_logp: [B, T] log pi_s(y), differentiable, where it is not logp itself (Policy.scored_sampler_logp)
    entropy:      [B, T] exact per-position entropy of the batch's policy (train/entropy)
    """

    scored_sampler_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def detached(batch: KLBatch) -> KLBatch:
    """The same batch with every tensor detached (what a step logs and controls with, after backward)."""
    return replace(batch, **{f.name: v.detach() for f in fields(batch)
                             if isinstance(v := getattr(batch, f.name), torch.Tensor) and v.requires_grad})


class WholeBatch:
    """The scoring of a policy that scores a batch at once (the tabular model): one part, the batch itself."""

    def __init__(self, batch: KLBatch):
        self.batch = batch

    def parts(self, keep_graph: bool = False):
        yield 0, self.batch.mask.shape[0], self.batch

    def splice(self, part: KLBatch, i: int, j: int) -> KLBatch:
        return part

    def whole(self) -> KLBatch:
        return detached(self.batch)


@dataclass
class Reference:
    """The reference pass of a rollout, no gradient: log-probs and the normaliser (max, log-sum) [B, L] each, 0 off
    the mask, and the final hidden states [B, L, H]."""

    logp: torch.Tensor
    norm: tuple[torch.Tensor, torch.Tensor]
    hidden: torch.Tensor


def _scatter(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[m, L] with values [N] at the mask's N True positions, 0 elsewhere; differentiable in values."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


class Scoring:
    """One rollout's scoring by an LMPolicy (the module docstring). with_token_kl: compute the exact per-position KL
    (the estimator differentiates it, or the step logs or controls with rb). logits: True the logits path (the probe
    measures top-k estimators), False the hidden states wherever they serve, None as model.scoring_path says (auto: the cheaper)."""

    def __init__(self, policy, ro, micro_batch_size: int | None, with_token_kl: bool, logits: bool | None = None):
        self.policy, self.ro, self.with_token_kl = policy, ro, with_token_kl
        B = ro.tokens.shape[0]
        m = B if micro_batch_size is None else min(B, int(micro_batch_size))
        self.cuts = [(i, min(B, i + m)) for i in range(0, B, m)]
        # the logits path where it must serve (logits, a reason) or where model.scoring_path takes it for m rows
        self.from_hidden = (policy.logits_reason is None and policy.scoring_reason is None
                            and (logits is False or logits is None and not policy.takes_logits(m)))
        self.kept: list[ScoredBatch] = []
        self.keep_graph = False  # parts(keep_graph=): the caller may backpropagate a part's graph more than once
        self.ref = self._reference() if self.from_hidden else None
        self.context = self._context() if len(self.cuts) > 1 else None

    # ---- the passes ----

    def _inputs(self, sub) -> dict:
        T, L = sub.tokens.shape[1], sub.mask.shape[1]
        # left padding: positions count real tokens only, as the sampler did. The head projects the L response
        # positions (P - 1 ... P + L - 2) only. No KV cache: scoring never reads one, and a layer that writes it
        # would write it again when gradient checkpointing recomputes the layer
        return dict(input_ids=sub.tokens, attention_mask=sub.attention,
                    position_ids=position_ids_from_mask(sub.attention),
                    logits_to_keep=torch.arange(T - L - 1, T - 1, device=sub.tokens.device), use_cache=False)

    @torch.no_grad()
    def _reference(self) -> Reference:
        """The reference's hidden states, log-normaliser and log-probs of every row, a micro-batch at a time."""
        parts = []
        with gathered_heads(self.policy.ref):  # hardware=fsdp: the head's weight is a shard between forwards
            _, ref_head = self.policy.heads
            for i, j in self.cuts:
                sub = self.ro.rows(i, j)
                with attention_backends(sub.tokens.device):
                    h = final_hidden(self.policy.ref, sub.mask.shape[1], **self._inputs(sub))  # [m, L, H]
                tok = sub.tokens[:, self.ro.prompt_len:][sub.mask]  # [N]
                logp, (m, ls) = head_logprob(h[sub.mask], ref_head, tok)
                parts.append((_scatter(sub.mask, logp), _scatter(sub.mask, m), _scatter(sub.mask, ls), h))
        logp, m, ls, hidden = (torch.cat(x) for x in zip(*parts))
        return Reference(logp, (m, ls), hidden)

    def _context(self) -> ScoredBatch:
        """Every row's detached scores for what a loss reads across sequences: the sampler's own log-probs where
        they are the batch's log-probs (and log pi_s), otherwise one pass without gradient."""
        ro = self.ro
        if self.from_hidden and ro.sampled_logp is not None and not ro.by_engine:  # an engine's are not the trainer's
            logp = torch.where(ro.mask, ro.sampled_logp.float(), 0.0)
            return ScoredBatch(logp, self.ref.logp, ro.mask, group=ro.group)
        with torch.no_grad(), self._heads():
            return self._assemble([self._part(i, j) for i, j in self.cuts])

    def _heads(self, release: bool = True):
        """The block in which the hidden-state path reads both LM heads (klbench.models.head.gathered_heads)."""
        if not self.from_hidden:
            return nullcontext()
        return gathered_heads(self.policy.model, self.policy.ref, release=release)

    def _part(self, i: int, j: int) -> ScoredBatch:
        sub = self.ro.rows(i, j)
        self.policy.rows_forwarded += j - i
        return self._hidden_part(sub, i, j) if self.from_hidden else self._logits_part(sub)

    def _hidden_part(self, sub, i: int, j: int) -> ScoredBatch:
        head, ref_head = self.policy.heads
        with attention_backends(sub.tokens.device):
            h = final_hidden(self.policy.model, sub.mask.shape[1], **self._inputs(sub))  # [m, L, H]
        mask = sub.mask
        tok = sub.tokens[:, self.ro.prompt_len:][mask]  # [N]
        s = head_scores(h[mask], head, tok, self.ref.hidden[i:j][mask], ref_head, with_token_kl=self.with_token_kl,
                        ref_norm=tuple(x[i:j][mask] for x in self.ref.norm))
        kappa = None if s.kappa is None else _scatter(mask, s.kappa)
        logp, old = _scatter(mask, s.logp), self.policy.behaviour_logp(sub)  # task.behaviour: an engine's log-probs
        old = None if old is None else torch.where(mask, old.to(logp.dtype), logp.detach())
        return ScoredBatch(logp, self.ref.logp[i:j], mask, group=sub.group, token_kl=kappa, old_logp=old,
                           entropy=_scatter(mask, s.entropy).detach())

    def _logits_part(self, sub) -> ScoredBatch:
        policy = self.policy
        pos = position_ids_from_mask(sub.attention)
        with attention_backends(pos.device):  # a new [B, P + L] every step: no cuDNN planning on CUDA
            logits = policy._logits(policy.model, sub, pos)  # [m, L, V], differentiable
            with torch.no_grad():
                ref_logits = policy._logits(policy.ref, sub, pos)  # [m, L, V]
        resp = sub.tokens[:, sub.prompt_len:]
        # the reference's logits are this part's alone: rb's backward writes its gradient into them (donate_ref),
        # unless the caller keeps the graph (Policy.score: the probe takes several gradients of one graph, and a
        # second backward would read the first one's gradient as the reference's logits)
        b = target_batch(logits, ref_logits, resp, sub.mask, policy.sampling, policy.kl_target, group=sub.group,
                         behaviour_logp=policy.behaviour_logp(sub), with_token_kl=self.with_token_kl,
                         donate_ref=not self.keep_graph)
        slogp = policy.scored_sampler_logp(sub, b)
        whole = len(self.cuts) == 1  # one part keeps its logits: estimators that read them (top-k) can
        ent = None if whole else exact_token_entropy(b.logits.detach(), b.mask, b.chunk_rows)
        return ScoredBatch(b.logp, b.ref_logp, b.mask, *((b.logits, b.ref_logits) if whole else (None, None)),
                           group=b.group, chunk_rows=b.chunk_rows, old_logp=b.old_logp, token_kl=b.token_kl,
                           scored_sampler_logp=None if slogp is b.logp else slogp, entropy=ent)

    # ---- what a step reads ----

    def parts(self, keep_graph: bool = False):
        """(i, j, rows i..j-1 scored with gradient where grad is on), kept for whole() as they come: detached, or
        with their graphs (keep_graph: Policy.score, whose caller backpropagates the whole batch)."""
        self.keep_graph = keep_graph
        for i, j in self.cuts:
            # the heads stay gathered through the caller's backward of the part; with keep_graph that backward comes
            # after the last part, and FSDP's own post-backward releases the policy's
            with self._heads(release=not (keep_graph and torch.is_grad_enabled())):
                part = self._part(i, j)
                yield i, j, part
            self.kept.append(part if keep_graph else detached(part))

    def splice(self, part: ScoredBatch, i: int, j: int) -> ScoredBatch:
        """The whole batch with rows i..j-1 from `part` (live) and every other row from the context, detached."""
        if len(self.cuts) == 1:
            return part
        c = self.context
        out = {}
        for name in ROWS:
            p = getattr(part, name)
            if p is None:
                continue
            rest = getattr(c, name)
            if rest is None:  # read by no loss across sequences (kappa, entropy): a row's own value only
                rest = torch.zeros_like(self.ro.mask, dtype=p.dtype)
            out[name] = torch.cat([rest[:i], p, rest[j:]])
        return ScoredBatch(**out)

    def whole(self) -> ScoredBatch:
        return self.kept[0] if len(self.kept) == 1 else self._assemble(self.kept)

    @staticmethod
    def _assemble(parts: list[ScoredBatch]) -> ScoredBatch:
        if len(parts) == 1:
            return parts[0]
        cat = {name: torch.cat([getattr(p, name) for p in parts]) for name in ROWS
               if getattr(parts[0], name) is not None}
        return ScoredBatch(**cat)
