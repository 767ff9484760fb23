"""OpenRLHF: `openrlhf.models.utils.compute_approx_kl`, k1/k2/k3, with and without unbiased_gradient, in the loss.

`openrlhf/models/utils.py` imports deepspeed at module level (and `openrlhf/models/__init__.py` imports the
actor, flash-attn and transformers models), while compute_approx_kl itself needs only torch. So this adapter
loads that one file by path with an empty stand-in module for `deepspeed` in sys.modules during the load (its
only use there, set_z3_leaf_modules, is never called); the code that runs is the installed file's own.

Aggregation: masked token sum of compute_approx_kl's [B, T] output per sequence (what the actor's KL loss
sums before its token mean; the token mean is a constant factor of it in the large-batch limit).
log_probs_old is KLBatch.old_logp (None on-policy, where OpenRLHF uses w = 1).
Not covered yet: the KL-in-reward path (compute_reward).
"""
from __future__ import annotations

import importlib.util
import sys
import types

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import Library, package_file, Setting, require, source_of, token_sum

DIST, SUPPORTED = "openrlhf", "0.11.2"


def _load_utils():
    path = package_file(DIST, "models", "utils.py")
    mod_spec = importlib.util.spec_from_file_location("klbench_openrlhf_models_utils", path)
    module = importlib.util.module_from_spec(mod_spec)
    had = "deepspeed" in sys.modules
    if not had:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # stand-in, removed again below
    try:
        mod_spec.loader.exec_module(module)
    finally:
        if not had:
            del sys.modules["deepspeed"]
    return module


def load() -> Library:
    version = require(DIST, SUPPORTED)
    utils = _load_utils()
    lib = Library(DIST, version)
    src = source_of(utils.compute_approx_kl)
    for est in ("k1", "k2", "k3"):
        for unbiased in (False, True):
            def loss(batch: KLBatch, est=est, unbiased=unbiased) -> torch.Tensor:
                kl = utils.compute_approx_kl(batch.masked_logp, batch.ref_logp, batch.old_logp,
                                             kl_estimator=est, unbiased_gradient=unbiased)
                return token_sum(kl.to(batch.logp.dtype), batch)

            name = f"openrlhf.{est}" + (".unbiased" if unbiased else "")
            note = "default kl_estimator" if est == "k1" and not unbiased else ""
            lib.settings[name] = Setting(name, loss, src, "token sum per sequence, in the loss (use_kl_loss)", note)
    return lib
