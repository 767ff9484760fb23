"""task=rl: maximise E[r] - beta * KL(pi || pi_ref). One optimiser step, readable here: rollout, reward,
scoring a micro-batch at a time, loss, logging, beta's update.

Reward gradient: REINFORCE with the advantage task.advantage (rloo by default: a leave-one-out baseline over
the n samples of a prompt) aggregated over tokens as task.loss_agg (klbench/estimators/advantages.py), on the
sampler's log pi_s (the reward is that of the policy as it samples, task.temperature/top_k/top_p).
KL gradient: beta * the configured gradient estimator's surrogate on the KL target's batch (task.kl_target,
docs/sampling.md); with estimator=in_reward kl_norm=before the KL value enters the reward before the advantage
instead, and there is no separate KL term. Every value estimator is logged on the same batch so that their
disagreement is visible step by step, where the batch's samples are y ~ its policy (not for kl_target=model off
plain sampling).

task.inner_steps = k > 1 reuses each rollout for k optimiser steps (GRPO num_iterations, PPO epochs). Step i of a
rollout (i = global_step mod k) trains on samples from pi_old, the policy at step 0 of the rollout. The reward term
is then PPO's clipped surrogate with the per-token ratio w_t = pi_s(y_t|y_<t) / pi_s,old(y_t|y_<t) and the
rollout's advantage A (fixed for the rollout), aggregated as task.loss_agg (seq_sum shown):

    loss_reward = -mean_i sum_t min(w_t A_i, clip(w_t, 1 - clip_eps, 1 + clip_eps) A_i)

At w = 1 (step 0) its gradient is the on-policy one. The KL term is beta x the configured gradient estimator on a
KLBatch that carries old_logp (schema.py admits only estimators that correct for pi_old). The rollout lives in
memory only: schema.py requires task.val_every and task.max_steps to be multiples of k, so every checkpoint falls
on a rollout boundary and a resume draws the next rollout exactly as the uninterrupted run does.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import lightning.pytorch as pl
import torch

from klbench.estimators import gradient_estimator, value_estimator
from klbench.estimators.advantages import advantage, ppo_reward_loss, reward_loss
from klbench.estimators.options import REPORTED_VALUES
from klbench.tasks.kl_control import build_kl_control
from klbench.models.interface import Policy, Rollout, has_distributions
from klbench.tasks.rl_metrics import TrainMetrics
from klbench.tasks.rl_validation import Validation
from klbench.tasks.step import backward_in_parts


@dataclass
class CachedRollout:
    """task.inner_steps > 1: what the later steps of a rollout reuse from its step 0 (pi_old)."""
    ro: Rollout
    reward: torch.Tensor  # [B]
    adv: torch.Tensor  # [B] task.advantage
    old_logp: torch.Tensor  # [B, T] the KL batch's behaviour log-probs at the rollout, detached
    old_sampler_logp: torch.Tensor  # [B, T] log pi_s,old of the sampled tokens (the reward's PPO ratio), detached


class RLTask(TrainMetrics, Validation, pl.LightningModule):
    """The RL and distillation LightningModule: the step here; its train/ metrics (klbench/tasks/rl_metrics.py)
    and its validation (klbench/tasks/rl_validation.py) are mixed in."""

    def __init__(self, policy: Policy, reward_fn, estimator_cfg: dict, task_cfg: dict, kl_ctl_cfg: dict | None = None):
        super().__init__()
        self.policy, self.reward_fn = policy, reward_fn
        opts = {k: v for k, v in estimator_cfg.items() if k not in ("name", "beta")}
        if estimator_cfg["name"] == "library":
            import klbench.libraries.estimator  # noqa: F401  registers "library" (estimators may not import it)
        self.estimator = gradient_estimator(estimator_cfg["name"], **opts)
        # beta lives in the controller (klbench/tasks/kl_control.py): estimator.beta when kl_ctl=fixed
        self.kl_ctl = build_kl_control(kl_ctl_cfg, float(estimator_cfg["beta"]))
        self.cfg = dict(task_cfg)
        from klbench.estimators.pg_correction import PGCorrection
        # the reward term's weight for an engine that is not the trainer (absent from distill/older configs: none)
        pg = task_cfg.get("pg_correction")
        self.pg_correction = PGCorrection() if pg is None else PGCorrection.from_options(dict(pg))
        # the KL fused into the reward before the advantage (in_reward kl_norm=before): no separate KL term
        self.kl_in_reward_adv = getattr(self.estimator, "options", {}).get("kl_norm") == "before"
        self.values = {label: value_estimator(name, **o) for label, (name, o) in REPORTED_VALUES.items()}
        from klbench.models.sampler_engine import engine_spec
        # task.sampler: the rollout engine, where it is not the trainer, and task.behaviour (docs/mismatch.md)
        policy.set_engine(engine_spec(task_cfg), str(task_cfg.get("behaviour", "sampler")))
        if policy.engine is not None:
            from klbench.models.policies import engine_text
            print("klbench: " + engine_text(policy))
        line = getattr(policy, "scoring_line", None)  # a language model says how it scores, once
        if line is not None:
            reads = getattr(self.estimator, "reads_logits", False)
            rows = int(task_cfg["prompts_per_step"]) * int(task_cfg["n_samples"])  # a micro-batch's m (the budget's)
            rows = min(rows, int(self.micro_batch_size or rows))
            print("klbench: " + line(f"estimator={estimator_cfg['name']} reads the whole next-token distribution"
                                     if reads else None, rows))
        self.strict_loading = False  # the frozen reference is not checkpointed
        self.val_rows: list[dict] = []
        self.sample_tables: list[tuple[int, list[dict]]] = []
        self.last_logged: dict[str, float] = {}  # the latest value of each train/ metric
        self.logged_at: dict[str, int] = {}  # the step each of them was logged at (the progress lines say it)
        self.cached_rollout: CachedRollout | None = None  # task.inner_steps > 1: the rollout the steps reuse
        self.metrics_read = True  # on_fit_start: whether a logger or a step bar reads the train/ metrics

    # ---- training: one optimiser step ----

    def training_step(self, prompts: list[str], batch_idx: int) -> torch.Tensor:
        step, k = self.global_step, self.inner_steps
        i = step % k  # the step's place in its rollout: 0 draws a fresh one (on-policy), > 0 reuses pi_old's
        ro, reward = self.step_rollout(prompts, step, i)
        where = f"step {step}" if k == 1 else f"step {step} (step {i} of its rollout)"
        scoring = self.policy.scoring(ro, self.micro_batch_size, self.needs_token_kl(step))
        # backward runs here, a micro-batch at a time (klbench/tasks/step.py); Lightning's own then applies its sum
        batch, loss, (n_clamped, slogp, pi_old, ppo_stats) = backward_in_parts(
            self.policy, scoring, lambda b: self.step_loss(b, ro, reward, i, where))
        if k > 1 and i == 0:
            self.cached_rollout = CachedRollout(ro, reward, *pi_old)
        if self.logging_step(step):
            # value estimators assume y ~ pi: off-policy steps (i > 0) log the reward, loss and length only
            self.log_train(batch, reward, ro, loss, n_clamped, slogp, on_policy=i == 0, extra=ppo_stats)
        self.control_beta(batch)  # kl_ctl=fixed only at k > 1 (schema.py): nothing is read off-policy
        return loss

    def step_rollout(self, prompts: list[str], step: int, i: int) -> tuple[Rollout, torch.Tensor]:
        """(the rollout, its rewards [B]) of a step: drawn now at a rollout's first step, else the cached one."""
        if i == 0:
            self.policy.sync_engine()  # task.sampler.lag: the engine takes the weights of lag steps ago
            ro = self.policy.rollout(prompts, self.cfg["n_samples"], engine=True)
            return ro, self.rewards(ro)
        if self.cached_rollout is None:
            raise RuntimeError(f"step {step} is step {i} of a rollout, but no rollout is cached: a checkpoint off a "
                               f"rollout boundary? task.val_every and task.max_steps must be multiples of "
                               f"{self.inner_steps}")
        return self.cached_rollout.ro, self.cached_rollout.reward

    def step_loss(self, batch, ro: Rollout, reward: torch.Tensor, i: int, where: str) -> tuple[torch.Tensor, tuple]:
        """The step's loss on a whole batch (klbench.tasks.step.backward_in_parts), and (the estimator's clamp
        count, the scorer's log pi_s [B, T] detached, pi_old's (adv, old_logp, old_sampler_logp) at task.inner_steps
        > 1, PPO's ratio statistics). i: the step's place in its rollout (always 0 at task.inner_steps=1)."""
        slogp = self.policy.scored_sampler_logp(ro, batch)  # [B, T] log pi_s: batch.logp unless the target scores another
        slogp = torch.where(batch.mask, slogp, torch.zeros((), dtype=slogp.dtype, device=slogp.device))
        if self.inner_steps == 1:  # on-policy: REINFORCE on log pi_s
            adv = self.reward_advantage(batch, reward, ro.group)  # [B]
            loss_reward, stats = self.corrected_reward_loss(adv, slogp, batch.mask, ro)
            loss, n_clamped = self.total_loss(batch, loss_reward, where)
            return loss, (n_clamped, slogp.detach(), None, stats)
        if i == 0:  # pi_old is this very policy: the behaviour log-probs are the batch's own, detached
            # (log pi_s for kl_target=model off plain sampling, which the batch carries already)
            old = batch.old_logp if batch.old_logp is not None else batch.logp.detach()
            old_s, adv = slogp.detach(), self.reward_advantage(batch, reward, ro.group)
        else:
            c = self.cached_rollout
            old, old_s, adv = c.old_logp, c.old_sampler_logp, c.adv
        loss_reward, stats = ppo_reward_loss(slogp, old_s, batch.mask, adv, float(self.cfg["clip_eps"]), self.loss_agg)
        loss, n_clamped = self.total_loss(replace(batch, old_logp=old), loss_reward, where)
        return loss, (n_clamped, slogp.detach(), (adv, old, old_s), stats)

    def corrected_reward_loss(self, adv, slogp, mask, ro: Rollout) -> tuple[torch.Tensor, dict]:
        """The reward term: REINFORCE on log pi_s, weighted by task.pg_correction's importance weights of the
        trainer's log-probs over the engine's own (klbench.estimators.pg_correction; mode none: no weight)."""
        if self.pg_correction.is_none:
            return reward_loss(adv, slogp, mask, *self.loss_agg), {}
        if ro.sampled_logp is None:
            raise ValueError(f"task.pg_correction.mode={self.pg_correction.mode}: this rollout kept no log-probs of "
                             "its own, so no weight pi / pi_s exists; use a sampler that keeps them or mode=none")
        from klbench.estimators.pg_correction import corrected_reward_loss
        loss, stats = corrected_reward_loss(adv, slogp, ro.sampled_logp, mask, self.pg_correction, *self.loss_agg)
        return loss, {f"train/{k}": v for k, v in stats.items()}

    def rewards(self, ro: Rollout) -> torch.Tensor:
        """[B] the reward of each response (zeros without a reward: distillation)."""
        if self.reward_fn is None:
            return torch.zeros(len(ro.texts), device=self.device)
        return self.reward_fn(ro).to(self.device, torch.float32)

    def judged(self, ro: Rollout) -> dict[str, torch.Tensor]:
        """[B] per-response indicators of a verifiable reward (reward=answer: accuracy, no_answer); else none."""
        judge = getattr(self.reward_fn, "judge", None)
        return {} if judge is None else {k: v.to(self.device) for k, v in judge(ro).items()}

    @property
    def inner_steps(self) -> int:
        """task.inner_steps: optimiser steps per rollout (1: on-policy)."""
        return int(self.cfg["inner_steps"])

    def needs_token_kl(self, step: int) -> bool:
        """Whether a step's scoring computes the exact per-position KL: the estimator differentiates it, or the step
        logs rb's value (train/kl_rb) or controls beta with it."""
        return self.loss_reads_token_kl or self.logging_step(step) or self.kl_ctl.signal == "rb"

    @property
    def micro_batch_size(self) -> int | None:
        """task.micro_batch_size: sequences scored at once (klbench.models.lm_policy.LMPolicy.score); None: all."""
        return self.cfg["micro_batch_size"]

    @property
    def loss_reads_token_kl(self) -> bool:
        """Whether the loss reads the exact per-position KL (rb, vopd): the policy scores it with the log-probs."""
        return getattr(self.estimator, "reads_kappa", False)

    @property
    def loss_agg(self) -> tuple[str, int]:
        """task.loss_agg and its L_max (task.max_new_tokens), as klbench.estimators.advantages.aggregate takes them."""
        return self.cfg["loss_agg"], int(self.cfg["max_new_tokens"])

    def reward_advantage(self, batch, reward: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """[B] task.advantage of the rewards [B]; with the KL fused (in_reward kl_norm=before), of
        reward_coef r - beta v, v the estimator's detached per-sequence value."""
        if self.kl_in_reward_adv:
            reward = self.cfg["reward_coef"] * reward - self.beta * self.estimator.sequence_value(batch).to(reward.dtype)
        return advantage(reward, group, self.cfg["advantage"], float(self.cfg["adv_eps"])).to(batch.logp.dtype)

    @property
    def beta(self) -> float:
        return self.kl_ctl.beta

    @torch.no_grad()
    def control_beta(self, batch) -> None:
        """Logs the beta this step used, then lets the controller set the next one from the step's own
        samples (no extra rollout). The signal is averaged over DDP processes, so every process keeps
        the same beta, and n counts the sequences of all of them."""
        m = {"train/beta": self.beta}
        signal = self.kl_ctl.signal
        if signal is not None:
            if signal == "rb" and not has_distributions(batch):
                raise ValueError("kl_ctl.signal=rb needs the policy's logits, which this model does not give")
            v = self.values[signal](batch)  # [B] nats per sequence
            kl = self.trainer.strategy.reduce(v.double().mean(), reduce_op="mean")
            m["train/kl_ctl_signal"] = kl
            self.kl_ctl.update(float(kl), len(v) * self.trainer.world_size)
        self.log_now(m)

    def total_loss(self, batch, loss_reward: torch.Tensor, where: str) -> tuple[torch.Tensor, int | None]:
        """reward_coef * the reward part + beta * the mean KL surrogate, and the estimator's clamp count (None
        without a clamp). A non-finite loss stops the run here, naming both parts, before it reaches the weights.
        With the KL fused into the reward, loss_reward already holds reward_coef and beta: it is the loss."""
        if self.kl_in_reward_adv:
            est, loss_kl, loss = None, torch.zeros(()), loss_reward
        else:
            est = self.estimator.estimate(batch)
            loss_kl = est.values.mean()
            loss = self.cfg["reward_coef"] * loss_reward + self.beta * loss_kl
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss at {where}: reward part {loss_reward.item()}, "
                f"KL surrogate {loss_kl.item()} (estimator {self.estimator!r}, beta {self.beta})")
        return loss, None if est is None else est.n_clamped

    def configure_model(self) -> None:
        # hardware=fsdp: FSDP2 on the policy and the reference, before the optimizer sees the parameters
        # (klbench/tasks/sharding.py); nothing under any other strategy
        from klbench.tasks.sharding import configure_model
        configure_model(self)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.trainable(), lr=self.cfg["lr"], weight_decay=self.cfg["weight_decay"])

    # ---- checkpoints: RNG state travels with the step and the optimizer ----

    def state_dict(self, *args, **kwargs):
        # neither the frozen reference nor frozen policy weights (a LoRA base): the config's model folder has them
        sd = super().state_dict(*args, **kwargs)
        frozen = {name for name, p in self.named_parameters() if not p.requires_grad}
        return {k: v for k, v in sd.items() if not k.startswith("policy.ref.") and k not in frozen}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # every rank's own RNG state (klbench/tasks/sharding.py): ddp's and fsdp's ranks resume their own streams
        from klbench.tasks.sharding import save_rank_rng
        save_rank_rng(checkpoint, {"torch": torch.get_rng_state(), "python": random.getstate()})
        checkpoint["kl_ctl"] = self.kl_ctl.state_dict()  # the adapted beta: a resume continues it
        if self.policy.engine is not None and self.policy.engine.spec.lag:
            # task.sampler.lag: the weights the next steps' rollouts are drawn by (klbench.record.resume checks them)
            checkpoint["sampler_engine"] = self.policy.engine.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from klbench.tasks.sharding import rank_rng
        if (rng := rank_rng(checkpoint, self)) is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
        if "kl_ctl" in checkpoint:  # absent from checkpoints made before kl_ctl existed: beta was fixed
            self.kl_ctl.load_state_dict(checkpoint["kl_ctl"])
        if "sampler_engine" in checkpoint and self.policy.engine is not None:  # refused before when missing
            self.policy.engine.load_state_dict(checkpoint["sampler_engine"])
