"""The training progress bar: the optimisation step out of task.max_steps, with the reward and KL of the last
logged step and the last validation (the embedded pretraining: its loss).

Lightning's own bars count batches per epoch (`Epoch 7/-2 ... 1/1` for a step-bounded run) and show a bar
for every validation. This one counts steps over the whole run, resumed runs included, and leaves
validation to the summary the run prints at its end. It shows only on a terminal: a sweep's trial logs
and other redirected output get no bar (train.build_trainer).

StepLines is the bar's stand-in for long work whose output is not a terminal (the embedded pretraining,
minutes on a CPU): a line every tenth of the steps, with the same values, the time taken and the time left.
TrainingLines is the training's (SLURM logs, nohup, CI): also every `seconds` (KLBENCH_PROGRESS_SECONDS,
default 60) when a tenth takes longer, with the rate, and in a sweep the trial it belongs to.
"""
from __future__ import annotations

import os
import sys
import time

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.progress import ProgressBar

# (label in the bar, metric keys in order of preference): the first key the task has logged is shown.
# KL: the sequence KL by rb (exact per token, needs logits), else the plain Monte Carlo estimate
SHOWN = (("reward", ("train/reward",)), ("KL", ("train/kl_rb", "train/kl_mc")),
         ("val reward", ("val/reward",)), ("val KL", ("val/seq_kl",)))


SECONDS_ENV = "KLBENCH_PROGRESS_SECONDS"


def wanted() -> bool:
    return sys.stderr.isatty()


def lines() -> list:
    """The training's progress where there is no bar (train.build_trainer): output that is not a terminal."""
    return [] if wanted() else [TrainingLines()]


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


class StepLines(Callback):
    """`klbench: <what>: step 80/800 (10%), loss 3.1, 21 s so far, about 190 s left` on stderr, at every tenth
    of trainer.max_steps and at the end: progress a log file or a pipe can show, where a bar cannot."""

    def __init__(self, what: str, parts: int = 10, seconds: float | None = None) -> None:
        self.what, self.parts, self.seconds = what, parts, seconds
        self.t0 = self.last = 0.0
        self.first = 0  # the step training started (or resumed) at: the rate counts steps from it
        self.next = 0  # the step of the next line

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = self.last = time.time()
        self.first = trainer.global_step
        self.next = self._after(trainer.global_step, trainer.max_steps)

    def _after(self, step: int, total: int) -> int:
        """The first tenth of `total` past `step`."""
        k = step * self.parts // total + 1
        return -(-k * total // self.parts)  # ceil

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, total = trainer.global_step, trainer.max_steps
        due = self.seconds is not None and time.time() - self.last >= self.seconds
        if (step < self.next and not due) or step >= total:  # the last step's line comes from on_train_end
            return
        self.next = self._after(step, total)
        self.due(trainer, pl_module)

    def due(self, trainer, pl_module) -> None:
        """A line is due after this step: printed now (TrainingLines waits for the step's validation)."""
        self.line(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.line(trainer, pl_module)

    def line(self, trainer, pl_module) -> None:
        self.last = time.time()
        step, total = trainer.global_step, trainer.max_steps
        took = self.last - self.t0
        done = step - self.first
        left = f", about {took / done * (total - step):.0f} s left" if 0 < done and step < total else ""
        values = [self.rate(done, took), self.values(trainer, pl_module)]
        print(f"klbench: {self.what}: step {step}/{total} ({step / total:.0%}){self.clock()}"
              + "".join(f", {v}" for v in values if v) + f", {took:.0f} s so far{left}", file=sys.stderr, flush=True)

    def rate(self, done: int, took: float) -> str:
        return ""  # the pretraining's lines show the time left only

    def values(self, trainer, pl_module) -> str:
        return StepProgressBar.postfix(trainer, pl_module)  # the pretraining's loss: logged at every step

    def clock(self) -> str:
        return ""


class TrainingLines(StepLines):
    """`klbench: training: step 12/120 (10%), 1.31 steps/s, reward 0.412, KL 0.52, 9 s so far, about 83 s left`
    on stderr where it is not a terminal: at every tenth of the steps, and every `seconds` when a tenth takes
    longer, so that a log watcher sees the run alive. In a sweep `training` is `trial 3 (<its run name>)`, 3
    being its folder's number. Rank zero only (DDP)."""

    def __init__(self, seconds: float | None = None) -> None:
        if seconds is None:
            from klbench.console.env_checks import progress_seconds
            seconds = progress_seconds()  # a bad value was refused before the run (klbench.cli.check)
        super().__init__(trial_label() or "training", seconds=seconds)

    # the step of the validation whose values the lines show (a validation before training included)
    val_at: int | None = None
    # a line is due but waits for this step's validation, which Lightning runs after on_train_batch_end: printed
    # at once, it showed the validation of the step before (issue 51)
    pending: bool = False

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.pending = False
        if getattr(trainer, "is_global_zero", True):  # said once, so that a stall before step 1 shows too
            print(f"klbench: {self.what}: step {trainer.global_step}/{trainer.max_steps}{self.clock()}, a line every "
                  f"{max(1, trainer.max_steps // self.parts)} steps or {self.seconds:g} s ({SECONDS_ENV})",
                  file=sys.stderr, flush=True)

    def line(self, trainer, pl_module) -> None:
        if getattr(trainer, "is_global_zero", True):
            super().line(trainer, pl_module)

    def rate(self, done: int, took: float) -> str:
        return f"{done / took:.3g} steps/s" if done > 0 and took > 0 else ""

    def due(self, trainer, pl_module) -> None:
        self.pending = True  # printed after this step's validation, or before the next step where there is none

    def on_validation_end(self, trainer, pl_module) -> None:
        self.val_at = trainer.global_step
        self.flush(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.flush(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.pending = False  # the last line says all of it
        super().on_train_end(trainer, pl_module)

    def flush(self, trainer, pl_module) -> None:
        if self.pending:
            self.pending = False
            self.line(trainer, pl_module)

    def values(self, trainer, pl_module) -> str:
        return labelled_values(trainer, pl_module, self.val_at)

    def clock(self) -> str:
        # as Hydra's lines in the same log give it (to the second): a SLURM log reads as one timeline
        return f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.last or time.time()))}"


def labelled_values(trainer, pl_module, val_at: int | None) -> str:
    """`reward 0.412, KL 0.52 (step 10), val reward 0.838, val KL 3.18 (step 12)`: the values SHOWN, each group
    followed by the step it was logged at (RLTask.logged_at; MLflow's step), since train/ values are logged every
    task.log_every steps only and a line may come between: a stale `KL 0` read as "not computed" (issue 51).
    val_at: the step of the last validation (TrainingLines.on_validation_end); None: unlabelled."""
    last, at = getattr(pl_module, "last_logged", {}), getattr(pl_module, "logged_at", {})
    val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    groups: list[tuple[int | None, list[str]]] = []  # (step, texts): consecutive values of one step share a label
    for label, keys in SHOWN:
        source = val if label.startswith("val ") else last
        key = next((k for k in keys if k in source), None)
        if key is None:
            continue
        step = val_at if source is val else at.get(key)
        text = f"{label} {source[key]:.3g}"
        if groups and groups[-1][0] == step:
            groups[-1][1].append(text)
        else:
            groups.append((step, [text]))
    parts = [", ".join(texts) + ("" if step is None else f" (step {step})") for step, texts in groups]
    parts += [f"{k} {float(v):.3g}" for k, v in trainer.progress_bar_metrics.items()]
    return ", ".join(parts)


def trial_label() -> str | None:
    """`trial 3 (rb b=0.0443 s0 rl-tabular)` in a sweep's trial (Hydra's job number, which names its folder,
    and the run name the sweep gave it), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return None
        num = HydraConfig.get().job.num
    except Exception:  # no Hydra job: a Python caller
        return None
    name = os.environ.get("KLBENCH_RUN_NAME")  # set by the sweep for each trial (klbench.sweep.trial)
    return f"trial {num}" + (f" ({name})" if name else "")
