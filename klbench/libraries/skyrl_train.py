"""skyrl-train 0.3.1: `skyrl_train.utils.ppo_utils.compute_approx_kl` as the actor's KL loss (use_kl_loss=True,
the default, with kl_estimator_type k3, the default), each kl_estimator_type.

In this release compute_approx_kl is decorated with @torch.no_grad() (ppo_utils.py, the line above its def), so
the KL loss the actor adds (workers/worker.py: kl_loss = masked_mean(compute_approx_kl(...), loss_mask,
dim=-1).mean(), then loss = policy_loss + kl_loss * kl_loss_coef) carries no gradient at all: SkyRL issue
#1340, fixed in #1353 (the `skyrl` 0.4.0 distribution, which needs Python >= 3.12 and its skyrl.backends import
chain; listed, not run). The per-sequence loss here is what the worker computes before its batch mean: ppo_utils'
own masked_mean over each sequence's tokens, on the installed compute_approx_kl's output.

The wheel asks for Python 3.12 but is pure Python: scripts/install_libraries.sh installs it with --no-deps
--ignore-requires-python. `skyrl_train/utils/__init__.py` imports the whole runtime (ray placement groups of
another ray release, vllm helpers), so this adapter loads ppo_utils.py alone, by path, as the OpenRLHF adapter
does; its own imports (ray, jaxtyping, loguru, omegaconf, skyrl_train.training_batch) are installed."""
from __future__ import annotations

import importlib.util

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import Library, Setting, package_file, require, source_of

DIST, SUPPORTED = "skyrl-train", "0.3.1"
ESTIMATORS = ("k1", "abs", "k2", "k3")


def _load_ppo_utils():
    path = package_file("skyrl_train", "utils", "ppo_utils.py")
    spec = importlib.util.spec_from_file_location("klbench_skyrl_train_ppo_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> Library:
    version = require(DIST, SUPPORTED)
    ppo = _load_ppo_utils()
    lib = Library(DIST, version)
    src = source_of(ppo.compute_approx_kl)
    for est in ESTIMATORS:
        def loss(batch: KLBatch, est=est) -> torch.Tensor:
            mask = batch.mask.to(batch.logp.dtype)  # [B, T] SkyRL's float loss_mask
            kl = ppo.compute_approx_kl(batch.masked_logp, batch.ref_logp, loss_mask=mask, kl_estimator_type=est)
            return ppo.masked_mean(kl, mask, dim=-1)  # [B] the worker's per-sequence token mean

        name = f"skyrl_train.{est}"
        lib.settings[name] = Setting(
            name, loss, src, "per-sequence token mean (masked_mean, dim=-1), in the loss (use_kl_loss)",
            "use_kl_loss=True, kl_estimator_type=" + est + (" (defaults)" if est == "k3" else ""))
    return lib
