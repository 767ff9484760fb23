"""The probe's options, declared once and without torch: read by the measurement (klbench.probe.measure),
by task=probe and by task.probe of rl/distill (klbench.tasks.probe), by the config schema before torch is
imported (klbench.config.schema), and by Hydra, which takes the defaults from here
(klbench.config.resolvers.register: conf/task/probe.yaml holds nothing of its own, rl.yaml's `probe:` only
grad_samples' interpolation).
StepProbeOptions: the smaller defaults of task.probe, the probe of rl/distill at validations (task.probe_every).

    ProbeOptions(samples=32, replicates=128)   # a bad value raises pydantic's ValidationError, a ValueError

Estimator labels are checked against the registries when the probe starts (that needs torch).
"""
from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field, model_validator

from klbench.estimators.options import Expect, Options

Labels = Annotated[Optional[list[Annotated[str, Field(min_length=1)]]], Field(min_length=1),
                   Expect("null or a non-empty list of estimator labels")]


class ProbeOptions(Options):
    prompts: int = Field(8, ge=1)  # held-out prompts (the dataset's val split; tabular: copies of its one prompt)
    samples: int = Field(32, ge=1)  # M_max: samples per prompt per replicate; value std for M = 1, 2, 4, .. M_max
    grad_samples: int = Field(4, ge=1)  # samples per prompt in one per-batch gradient (<= samples)
    replicates: int = Field(64, ge=2)  # R independent replicates (CIs shrink like 1/sqrt(R)); 2 for a variance
    # LM references (tabular: exact): ref_batches batches of ref_samples per prompt, for rb (the value and the
    # kl_pi_ref gradient) and for -grad log pi on pi_ref's samples (the kl_ref_pi gradient)
    ref_batches: int = Field(8, ge=1)
    ref_samples: int = Field(32, ge=1)
    seed: int = Field(4321, ge=0)  # the probe's own stream
    bootstrap: int = Field(1000, ge=1)  # bootstrap resamples of the R replicates
    ci_level: float = Field(0.95, gt=0, lt=1)
    boot_dim: int = Field(2048, ge=1)  # CountSketch size for the gradient bootstrap's cross term (exact below it)
    # null: the gradient moments over every trainable parameter; k: in a fixed k-dim CountSketch
    project_dim: Optional[int] = Field(None, ge=1)
    value_estimators: Labels = None  # labels of measure.value_variants(); null: all
    gradient_estimators: Labels = None  # labels of measure.gradient_variants(); null: all, plus naive_cv_seq

    @model_validator(mode="after")
    def _gradient_batch_fits(self) -> "ProbeOptions":
        if self.grad_samples > self.samples:
            raise ValueError(f"grad_samples={self.grad_samples} must be <= samples={self.samples}: the gradient "
                             "batch reuses the first grad_samples of each prompt's samples")
        return self

    @property
    def sizes(self) -> list[int]:
        """M = 1, 2, 4, ... up to M_max (M_max included even when it is not a power of two)."""
        out, m = [], 1
        while m <= self.samples:
            out.append(m)
            m *= 2
        return out if out[-1] == self.samples else out + [self.samples]


class StepProbeOptions(ProbeOptions):
    """task.probe of rl/distill: the probe at validations (task.probe_every), smaller than task=probe's so that
    it costs a training run little; logged as probe/* metrics. grad_samples has no default here: conf/task/rl.yaml
    sets it to ${..n_samples}, the training batch's samples per prompt."""
    prompts: int = Field(4, ge=1)
    samples: int = Field(8, ge=1)
    grad_samples: int = Field(ge=1)
    replicates: int = Field(16, ge=2)
    ref_batches: int = Field(2, ge=1)
    ref_samples: int = Field(16, ge=1)
    bootstrap: int = Field(200, ge=1)
