"""LoRA: the policy is a low-rank adapter on a frozen base, and pi_ref is that same base with the adapter off.

    policy = add_lora(model, r=8, alpha=16, dropout=0.0, target_modules=None)   # peft.PeftModel, base frozen
    ref = WithoutAdapter(policy)          # the reference: the same weights, adapter disabled, no second copy
    lora_summary(policy) -> {"rank": 8, "alpha": 16, "modules": [...], "trainable": n, "total": N}

One copy of the weights is held, as TRL, OpenRLHF and ART do. pi_ref is exactly the base: a peft LoRA layer
with its adapter disabled returns the base layer's output as is (tests/test_lora.py checks the log-probs
against a separately loaded base, bit for bit, after the adapter has trained).

Checkpoints keep only what trains (RLTask.state_dict drops frozen parameters): the adapter, the optimizer
and the run's state; the base is the model folder the config names, loaded again on resume.
"""
from __future__ import annotations

import contextlib
import warnings

from torch import nn

from klbench.config.errors import ConfigError


def add_lora(model, r: int, alpha: float, dropout: float, target_modules: list[str] | None):
    """`model` wrapped in a peft LoRA adapter of rank r (base weights frozen). target_modules None: peft's
    default for the architecture. A ConfigError naming model.lora.target_modules, with the module names found,
    where peft cannot wrap the model."""
    import peft
    if dropout:
        # klbench scores with dropout off (LMPolicy.train): the log-probs differentiated must be those of the
        # distribution the samples came from, or every estimator is biased
        raise ConfigError(f"model.lora.dropout={dropout}: klbench trains with dropout off, so that the scored "
                          "log-probs are those of the sampling policy; set model.lora.dropout=0")
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                             target_modules=list(target_modules) if target_modules else None)
    try:
        with peft_deprecations_quiet():
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # peft: no default modules for this architecture, or names that match nothing
        raise ConfigError(f"model.lora.target_modules={target_modules}: peft cannot wrap "
                          f"{type(model).__name__} ({str(e).splitlines()[0]}); its linear modules are named "
                          f"{linear_module_names(model)}") from None
    return wrapped


# what peft 0.x asks of transformers 5 that transformers calls deprecated: peft's call, no setting of the user's
# changes it, and it printed in every LoRA run and export (issue 51)
PEFT_DEPRECATIONS = ((FutureWarning, r"`is_gradient_checkpointing` is deprecated"),)


@contextlib.contextmanager
def peft_deprecations_quiet():
    """PEFT_DEPRECATIONS silenced for the calls into peft inside the block only (a FutureWarning anywhere else
    still shows); KLBENCH_VERBOSE=1 shows them too."""
    from klbench.console.messages import verbose
    with warnings.catch_warnings():
        if not verbose():
            for category, message in PEFT_DEPRECATIONS:
                warnings.filterwarnings("ignore", message=message, category=category)
        yield


def lora_summary(model) -> dict[str, object]:
    """What a LoRA policy trains: {"rank": 4, "alpha": 16, "modules": ["q_proj", "v_proj"] (the names peft chose,
    or model.lora.target_modules), "trainable": adapter parameters, "total": every parameter, the base's included}."""
    config = model.peft_config[model.active_adapter]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"rank": config.r, "alpha": config.lora_alpha, "modules": sorted(config.target_modules or []),
            "trainable": trainable, "total": sum(p.numel() for p in model.parameters())}


def linear_module_names(model) -> list[str]:
    """The distinct last names of the model's linear layers (what model.lora.target_modules takes)."""
    from transformers.pytorch_utils import Conv1D
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    return sorted(names)


def is_lora(model) -> bool:
    return type(model).__name__.startswith("Peft")


class WithoutAdapter(nn.Module):
    """The reference policy: a PeftModel's base with the adapter disabled, called like any causal LM.

    The peft model is held outside the module tree (not a submodule), so that nothing that walks the
    reference (requires_grad_(False), state_dict, parameters) reaches the adapter being trained.
    """

    def __init__(self, peft_model):
        super().__init__()
        self.__dict__["peft_model"] = peft_model  # unregistered on purpose (see the class docstring)

    @property
    def config(self):
        return self.peft_model.config

    @property
    def generation_config(self):
        return self.peft_model.generation_config

    def parameters(self, recurse: bool = True):
        # the device and dtype of the reference are the base's; none of them is trained through it
        return (p for p in self.peft_model.parameters(recurse) if not p.requires_grad)

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model.generate(*args, **kwargs)
