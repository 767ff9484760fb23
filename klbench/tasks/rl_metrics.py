"""The train/ metrics of RLTask (klbench/tasks/rl.py), a mixin: what a logging step logs, and when.

Every task.log_every steps, when a logger, a step bar or the plain progress lines read them: every value estimator on
the step's batch (so their disagreement is visible), the reward, the loss, the response length, the entropy, the
gap and the mismatch meter between the sampler's and the scorer's log pi_s (docs/mismatch.md), the gradient norm.
"""
from __future__ import annotations

import torch

from klbench.estimators.mismatch import MISMATCH_CHI2_LARGE, mismatch_metrics
from klbench.models.interface import has_distributions, token_entropy


class TrainMetrics:
    """Mixed into RLTask (a LightningModule with policy, cfg, values, judged(), last_logged, metrics_read)."""

    def on_fit_start(self) -> None:
        # with no logger, no step bar and no plain progress lines nothing reads the train/ metrics, and every value
        # estimator plus the entropy cost a part of a step each time. Decided once for all processes (a bar can
        # exist on one rank only): the metrics' reduce is a collective
        from klbench.console.progress import TrainingLines
        read = self.logger is not None or self.trainer.progress_bar_callback is not None or \
            any(isinstance(c, TrainingLines) for c in self.trainer.callbacks)
        self.metrics_read = bool(self.trainer.strategy.reduce(torch.tensor(float(read), device=self.device),
                                                              reduce_op="max") > 0)

    def logging_step(self, step: int) -> bool:
        """Whether `step` logs the train/ metrics: every task.log_every steps, when anything reads them."""
        return self.metrics_read and step % self.cfg["log_every"] == 0

    @torch.no_grad()
    def log_train(self, batch, reward, ro, loss, n_clamped, slogp=None, on_policy: bool = True,
                  extra: dict | None = None) -> None:
        """slogp: [B, T] the scorer's log pi_s (Policy.scored_sampler_logp), for train/logp_gap_*. on_policy: False on a
        rollout's later steps (task.inner_steps > 1), whose samples come from pi_old: the reward, the loss and the
        length only. extra: more metrics of the step (PPO's ratio statistics)."""
        m = {"train/reward": reward.mean(), "train/loss": loss.detach(),
             "train/response_len": batch.mask.sum(-1).float().mean(), **(extra or {})}
        if n_clamped is not None:
            m["train/n_clamped"] = float(n_clamped)
        if not on_policy:
            self.log_now(m)
            return
        # value estimators that assume y ~ pi are left out on a behaviour batch (kl_target=model off plain sampling)
        off = batch.is_off_policy
        m.update({f"train/kl_{label}": est(batch).float().mean() for label, est in self.values.items()
                  if (label != "rb" or has_distributions(batch)) and (not off or est.supports_off_policy())})
        if ro.sampled_logp is not None and slogp is not None:
            # the sampler's own log pi_s against the scoring pass's, real tokens only: 0 where both run the same
            # arithmetic (float32 on CPU), not in bf16 with SDPA (docs/sampling.md, "Sampler and scorer")
            gap = (ro.sampled_logp.to(slogp.dtype) - slogp.detach())[batch.mask].abs()
            if gap.numel():
                m["train/logp_gap_max"], m["train/logp_gap_mean"] = gap.max(), gap.mean()
                # the meter: k1, k3 and chi^2 of pi_s as sampled against pi_s as scored (docs/mismatch.md)
                m.update({f"train/{k}": v for k, v in
                          mismatch_metrics(ro.sampled_logp.to(slogp.dtype), slogp.detach(), batch.mask).items()})
        for key, v in self.judged(ro).items():  # no_answer: how many of the step's responses had none
            m[f"train/{key}"] = v.sum() if key == "no_answer" else v.mean()
        entropy = token_entropy(batch)  # [B, T] or None
        if entropy is not None:
            m["train/entropy"] = entropy.sum() / batch.mask.sum()
        self.log_now(m)

    def on_train_end(self) -> None:
        chi2 = self.last_logged.get("train/mismatch_chi2")
        if self.trainer.is_global_zero and chi2 is not None and chi2 > MISMATCH_CHI2_LARGE:
            print(f"klbench: the sampler and the scorer disagree: train/mismatch_chi2 {chi2:.3g} at the last logged "
                  f"step (above {MISMATCH_CHI2_LARGE:g}, about {chi2 / (1 + chi2):.0%} of the samples' effective "
                  f"size lost): docs/mismatch.md")

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.logging_step(self.global_step):
            from klbench.tasks.sharding import grad_norm  # Lightning's, or hardware=fsdp's from the shards
            norm = grad_norm(self.policy)
            self.log_now({"train/grad_norm": norm})

    def log_now(self, metrics: dict) -> None:
        """Logs at this step only: Lightning's self.log would repeat the last values on every later step.
        Averaged over DDP processes, as validation metrics are; nothing where nothing reads them (on_fit_start)."""
        if not self.metrics_read:
            return
        keys = list(metrics)
        values = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32, device=self.device).reshape(())
                              for k in keys])
        values = self.trainer.strategy.reduce(values, reduce_op="mean")
        if self.trainer.is_global_zero:
            logged = dict(zip(keys, values.tolist()))
            self.last_logged.update(logged)  # what the progress bar shows (klbench.console.progress)
            self.logged_at.update(dict.fromkeys(logged, self.global_step))
            if self.logger is not None:
                self.logger.log_metrics(logged, step=self.global_step)
