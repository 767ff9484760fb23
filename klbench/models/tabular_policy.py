"""TabularPolicy: the enumerable tabular model (klbench.exact.tabular) behind the Policy interface
(klbench.models.interface), so that the RL task runs against exact ground truth. With klbench.exact and
klbench.rewards.reward, the one module that knows the tabular model (tests/test_imports.py)."""
from __future__ import annotations

import torch
from torch import nn

from klbench.estimators import KLBatch
from klbench.estimators.sampling import Sampling, check_target
from klbench.exact.tabular import Frontier, TabularModel, TabularReward, pareto_frontier
from klbench.models.interface import Policy, Rollout
from klbench.models.pair_rules import check_tabular_pair


class TabularPolicy(Policy):
    """Logit table [P, K] in float64, starting at pi_ref (or `start`); prompts are ignored (one implicit prompt).

    Everything is enumerable here, so the exact_* methods give the truth that sampled estimates are judged by.
    sampling (temperature, top-k, top-p) and kl_target (klbench.estimators.sampling): rollouts draw from pi_s,
    score() builds the target's batch with target_batch, and the exact metrics and gradients are the target's.
    """

    fixed_prompt = "<tabular>"

    def __init__(self, model: TabularModel, start: torch.Tensor | None = None, sampling: Sampling | None = None,
                 kl_target: str = "sampler"):
        super().__init__()
        self.table = model
        self.theta = nn.Parameter((model.ref_logits if start is None else start).clone())  # [P, K]
        self.sampling = Sampling() if sampling is None else sampling
        check_target(self.sampling, kl_target)  # refuses what cannot be estimated; bias warnings are the run's
        self.kl_target = kl_target
        self._frontier = None  # ((reward table, sampling, target), Frontier): traced once, read at every validation

    @property
    def _sampled(self) -> Sampling | None:
        """The sampling the tabular model's methods take: None at plain sampling, where every target is the
        one pair (pi, pi_ref) and the plain path is kept bit for bit."""
        return None if self.sampling.is_plain else self.sampling

    def _engine(self, spec):
        if spec.attn_implementation != "same":
            raise ValueError(f"task.sampler.attn_implementation={spec.attn_implementation}: model=tabular is a table "
                             "of logits, with no attention; use a language model or attn_implementation=same")
        from klbench.models.sampler_engine import Engine
        return Engine(spec, {"theta": self.theta})

    @torch.no_grad()
    def rollout(self, prompts: list[str], n: int, engine: bool = False) -> Rollout:
        by_engine = engine and self.engine is not None  # task.sampler: the engine's table draws
        theta = self.engine.table() if by_engine else self.theta
        probs = self.table.sample_probs(theta, sampling=self._sampled)  # [N], under pi_s (the engine's)
        ids = torch.multinomial(probs, len(prompts) * n, replacement=True)  # [B*n]
        return self.rollout_of(ids, [p for p in prompts for _ in range(n)], n, by_engine)

    @torch.no_grad()
    def rollout_of(self, ids: torch.Tensor, prompts: list[str], n: int, by_engine: bool = False) -> Rollout:
        """The Rollout of sequences `ids` [B] as drawn, n per prompt (prompts: one per sequence). Where the batch
        has a behaviour policy (an engine's rollout; kl_target=model off plain sampling) the sampler keeps its own
        log-probs of its tokens (Rollout.sampled_logp), as an LM's does. The exact tests enumerate every sequence."""
        tokens = self.table.tokens[ids]
        mask = self.table.mask[ids]
        # lists first: iterating tensors element by element costs more than the whole training step
        texts = [" ".join(str(v) for v, m in zip(row, keep) if m) for row, keep in zip(tokens.tolist(), mask.tolist())]
        group = torch.arange(len(prompts) // n).repeat_interleave(n)
        sampled = None
        if by_engine or (self.kl_target == "model" and self._sampled is not None):
            table = self.engine.table() if by_engine else self.theta.detach()  # [P, K]
            if self._sampled is not None:
                table = self._sampled.process(table)
            logp = torch.log_softmax(table, -1)[self.table.seq_prefix[ids]].gather(-1, tokens[..., None])[..., 0]
            sampled = torch.where(mask, logp, torch.zeros((), dtype=logp.dtype))  # [B, T] log pi_s of the engine
        return Rollout(tokens, mask.long(), 0, mask, group, texts, prompts, ids,
                       sampled_logp=sampled, by_engine=by_engine)

    def score(self, ro: Rollout, micro_batch_size: int | None = None, with_token_kl: bool = True,
              logits: bool = False) -> KLBatch:
        # micro_batch_size: the schema refuses it here (the table is the whole model: nothing to save); kappa
        # is computed on first use from the [B, T, K] table logits, which exist whole already
        batch = self.table.batch(self.theta, ro.seq_ids, group=ro.group, sampling=self._sampled,
                                 target=self.kl_target)
        # the exact per-position KL in one block: its [B, T, K] logits exist whole already, and the default
        # chunking (2^20 / K rows) would fall back to a Python loop over sequences past 2^18 rows at K = 4
        # (what that cost: docs/estimators.md, "Small vocabularies")
        batch.chunk_rows = max(1, batch.mask.numel())
        behaviour = self.behaviour_logp(ro)  # task.behaviour=sampler on an engine's rollout: its own log-probs
        if behaviour is not None:
            batch.old_logp = torch.where(batch.mask, behaviour.to(batch.logp.dtype), batch.logp.detach())
        return batch

    def trainable(self) -> list[nn.Parameter]:
        return [self.theta]

    def reference(self) -> "TabularPolicy":
        """pi_ref sampled as the policy is sampled (the probe's kl_ref_pi reference draws from it)."""
        return TabularPolicy(self.table, self.table.ref_logits, self.sampling, self.kl_target)

    @property
    def device(self) -> torch.device:
        return self.theta.device

    @torch.no_grad()
    def exact_metrics(self, reward=None) -> dict[str, float]:
        """seq_kl: the exact KL of the run's target (KL(pi || pi_ref) at plain sampling); kl_ref_pi: the target
        pair's other direction; reward: E[r] under the sampler pi_s, which is what the run earns. Away from plain
        sampling also model_kl = KL(pi || pi_ref) of the untempered models (seq_kl itself at target=model)."""
        theta, s = self.theta.detach(), self._sampled
        if s is None:
            out = {"seq_kl": float(self.table.kl_pi_ref(theta)), "kl_ref_pi": float(self.table.kl_ref_pi(theta))}
        else:
            p, q = self.table.target_tables(theta, s, self.kl_target)
            out = {"seq_kl": float(self.table.pair_kl(p, q)), "kl_ref_pi": float(self.table.pair_kl(q, p))}
            if self.kl_target != "model":  # at target=model seq_kl is that KL already
                out["model_kl"] = float(self.table.kl_pi_ref(theta))
        frontier = self.exact_frontier(reward)
        if isinstance(reward, TabularReward):
            r = float((self.table.sample_probs(theta, sampling=s) * reward.table).sum())
            out["reward"] = r
            if frontier is not None:
                out["frontier_gap"] = frontier.reward_gap(r, out["seq_kl"])
        return out

    def exact_frontier(self, reward) -> Frontier | None:
        """The exact frontier of E_{pi_s}[r] against the target's KL, where it has a closed form: plain sampling;
        a temperature alone with target sampler or tempered (the frontier of the tempered reference pi_ref,T,
        since pi_T ranges over every table) or tempered_vs_raw (that of pi_ref itself). None for target=model at
        T != 1 (the reward is earned by pi_T, the KL paid by pi) and under truncation (pi_s ranges over tables
        with cut tokens, whose optimum has no closed form)."""
        if not isinstance(reward, TabularReward):  # no reward, or one that cannot be enumerated
            return None
        s, m = self.sampling, self.table
        if s.is_plain or self.kl_target == "tempered_vs_raw" and not s.truncates:
            model = m
        elif self.kl_target in ("sampler", "tempered") and not s.truncates:
            model = TabularModel(m.K, m.T, m.ref_logits / s.temperature, eos=m.eos)
        else:
            return None
        key = (reward.table, s, self.kl_target)  # a copy of this policy with another sampling must not reuse it
        if self._frontier is None or self._frontier[0][0] is not key[0] or self._frontier[0][1:] != key[1:]:
            self._frontier = (key, pareto_frontier(model, reward.table))
        return self._frontier[1]

    def exact_gradients(self) -> dict[str, torch.Tensor]:
        return self.table.exact_gradients(self.theta.detach(), sampling=self._sampled, target=self.kl_target)


def tabular_policy(cfg, teacher, sampling: Sampling | None = None, kl_target: str = "sampler") -> "TabularPolicy":
    """The tabular policy of model=tabular (a teacher's table as pi_ref for distillation), sampling pi_s and
    scoring the KL target (build_policy passes task_sampling(cfg.task))."""
    ref_cfg = cfg if teacher is None else teacher
    check_tabular_pair(cfg, ref_cfg)
    table = TabularModel(cfg.K, cfg.T, eos=cfg.eos, seed=ref_cfg.ref_seed, ref_scale=ref_cfg.ref_scale)
    start = None
    if teacher is not None:  # the student starts from its own table, the teacher's is pi_ref
        start = TabularModel(cfg.K, cfg.T, eos=cfg.eos, seed=cfg.ref_seed, ref_scale=cfg.ref_scale).ref_logits
    return TabularPolicy(table, start, sampling, kl_target)
