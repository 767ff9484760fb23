"""The validation of RLTask (klbench/tasks/rl.py), a mixin: held-out prompts, fresh samples, val/ metrics.

val/seq_kl is rb's value of the KL target on samples of its own policy; where the truth is computable (the tabular
model) it is reported under the metric's own name and the sampled estimate under <name>_sampled.
"""
from __future__ import annotations

import torch


class Validation:
    """Mixed into RLTask (a LightningModule with policy, reward_fn, cfg, values, rewards(), judged())."""

    def on_validation_epoch_start(self) -> None:
        self.val_rows = []

    @torch.no_grad()
    def validation_step(self, prompts: list[str], batch_idx: int) -> None:
        # validation draws from its own seeded stream: it never shifts the training samples (so a resumed
        # run repeats an uninterrupted one), and every validation of every run sees comparable noise
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.cfg["val_seed"] + batch_idx)
            ro = self.policy.rollout(prompts, self.cfg["val_samples"])
            # val/seq_kl is the KL target's KL. kl_target=model off plain sampling: its rollouts are pi_s's, and
            # rb needs y ~ pi, so the KL is measured on a second draw from pi itself (the same stream, after)
            target = self.policy.on_target()
            ro_kl = ro if target is self.policy else target.rollout(prompts, self.cfg["val_samples"])
        # the view scores its own draws: y ~ pi, an on-policy batch of the target; its exact per-position KL for rb's val/seq_kl
        batch = target.score(ro_kl, self.micro_batch_size, with_token_kl=True)
        reward = self.rewards(ro)
        seq_kl = self.values["rb"](batch)  # [B]: unbiased, low variance, never the training estimator
        judged = {k: v.tolist() for k, v in self.judged(ro).items()}
        for i, (text, prompt, r, k, n, nk) in enumerate(zip(ro.texts, ro.prompts, reward.tolist(), seq_kl.tolist(),
                                                            ro.mask.sum(-1).tolist(), batch.mask.sum(-1).tolist())):
            self.val_rows.append({"prompt": prompt, "response": text, "reward": r, "seq_kl": k, "tokens": n,
                                  "kl_tokens": nk, **{key: v[i] for key, v in judged.items()}})

    def on_validation_epoch_end(self) -> None:
        rows = self.val_rows
        judged = [k for k in ("accuracy", "no_answer") if rows and k in rows[0]]  # a verifiable reward's
        # sums over all processes, so the metric is the same whatever the number of devices
        totals = torch.tensor([sum(r["reward"] for r in rows), sum(r["seq_kl"] for r in rows),
                               sum(r["tokens"] for r in rows), sum(r["kl_tokens"] for r in rows), len(rows),
                               *(sum(r[k] for r in rows) for k in judged)], dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            totals = self.all_gather(totals).reshape(-1, 5 + len(judged)).sum(0)
        reward, kl, n_tok, n_kl_tok, n, *judged_sums = totals.tolist()
        m = {"val/reward": reward / n, "val/seq_kl": kl / n, "val/token_kl": kl / max(n_kl_tok, 1),
             "val/response_len": n_tok / n, **{f"val/{k}": v / n for k, v in zip(judged, judged_sums)}}
        m.update(self._exact_metrics(m))
        # logged at the number of optimiser steps taken (Lightning would use that number minus one)
        self.log_dict(m, logger=False, sync_dist=True)  # already identical on every process
        if self.trainer.is_global_zero and self.logger is not None:
            self.logger.log_metrics(m, step=self.global_step)
        self.sample_tables.append((self.global_step, [{k: v for k, v in r.items() if k != "kl_tokens"}
                                                      for r in rows[: self.cfg["n_sample_texts"]]]))
        every = self.cfg["probe_every"]
        if every and self.global_step % every == 0 and self.trainer.is_global_zero and self.logger is not None:
            # estimator variance as pi moves from pi_ref; its own RNG stream, so training is not shifted
            from klbench.tasks.probe import probe_during_training
            probe = probe_during_training(self.policy, [r["prompt"] for r in rows], self.cfg["probe"])
            self.logger.log_metrics(probe, step=self.global_step)

    def _exact_metrics(self, sampled: dict[str, float]) -> dict[str, float]:
        """Where the truth is computable (the tabular model) it is reported under the metric's own name, and the
        sampled estimate it replaces under <name>_sampled; elsewhere nothing."""
        out = {}
        for key, value in self.policy.exact_metrics(self.reward_fn).items():
            if f"val/{key}" in sampled:
                out[f"val/{key}_sampled"] = sampled[f"val/{key}"]
            out[f"val/{key}"] = value
        self.exact_keys = {k for k in out if not k.endswith("_sampled")}  # the run's summary marks them exact
        return out
