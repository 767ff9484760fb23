"""The training progress bar: the optimisation step out of task.max_steps, with the reward and KL of the last
logged step and the last validation (the embedded pretraining: its loss).

Lightning's own bars count batches per epoch (`Epoch 7/-2 ... 1/1` for a step-bounded run) and show a bar
for every validation. This one counts steps over the whole run, resumed runs included, and leaves
validation to the summary the run prints at its end. It shows only on a terminal: a sweep's trial logs
and other redirected output get no bar (train.build_trainer).
"""
from __future__ import annotations

import sys

from lightning.pytorch.callbacks.progress import ProgressBar

# (label in the bar, metric keys in order of preference): the first key the task has logged is shown.
# KL: the sequence KL by rb (exact per token, needs logits), else the plain Monte Carlo estimate
SHOWN = (("reward", ("train/reward",)), ("KL", ("train/kl_rb", "train/kl_mc")),
         ("val reward", ("val/reward",)), ("val KL", ("val/seq_kl",)))


def wanted() -> bool:
    return sys.stderr.isatty()


class StepProgressBar(ProgressBar):
    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self.bar = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args, **kwargs) -> None:
        if self.bar is not None:
            self.bar.write(" ".join(map(str, args)), file=sys.stderr)
        else:
            print(*args, **kwargs)

    def on_train_start(self, trainer, pl_module) -> None:
        if not self._enabled:
            return
        from tqdm import tqdm
        self.bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, desc="step", unit="step",
                        dynamic_ncols=True, file=sys.stderr, leave=True,
                        bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}, {rate_fmt}]{postfix}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix_str(self.postfix(trainer, pl_module), refresh=False)
        self.bar.update(trainer.global_step - self.bar.n)  # rate-limited redraw (tqdm's mininterval)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix(trainer, pl_module), refresh=False)
            self.bar.update(trainer.global_step - self.bar.n)
            self.bar.close()
            self.bar = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    @staticmethod
    def postfix(trainer, pl_module) -> str:
        """The last values the task logged (RLTask.last_logged: every task.log_every steps) and the last
        validation's (trainer.callback_metrics)."""
        last = {**getattr(pl_module, "last_logged", {}),
                **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}}
        parts = []
        for label, keys in SHOWN:
            key = next((k for k in keys if k in last), None)
            if key is not None:
                parts.append(f"{label} {last[key]:.3g}")
        # what a module logs with self.log(..., prog_bar=True): the embedded pretraining's loss
        parts += [f"{k} {float(v):.3g}" for k, v in trainer.progress_bar_metrics.items()]
        return ", ".join(parts)
