"""AReaL: `areal.utils.data.KLEstimator` (k1/k2/k3), which AReaL uses in the reward only
(`areal/trainer/ppo/actor.py`: rewards = -kl_ctl * kl_estimator(old_logp, ref_logp), token-level).

`areal.utils.data` imports AReaL's whole runtime (httpx, torchdata, its platform layer) at module level. The
adapter compiles only the KLEstimator class from the installed file (the file's own text, line numbers kept,
so tracebacks and file:line point into it) with torch in its namespace.

Aggregation (klbench's, not AReaL's): the token-level KL reward, evaluated like AReaL on the behaviour
policy's log-probs and detached, enters a REINFORCE surrogate with return-to-go advantages (gamma = lambda = 1,
no critic, no PPO clip): loss = sum_t w_t * sg(sum_{s>=t} kl_s) with w_t = exp(logp_t - old_t) (1 on-policy).
"""
from __future__ import annotations

import ast

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import (Library, LibraryMissing, Setting, old_or_current, package_file, require,
                                   reward_to_go_surrogate)

DIST, SUPPORTED = "areal", "1.0.4"


def _load_class():
    path = package_file(DIST, "utils", "data.py")
    tree = ast.parse(open(path).read(), path)
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KLEstimator"]
    if len(nodes) != 1:
        raise LibraryMissing(f"{DIST}: class KLEstimator not found in {path}")
    namespace = {"torch": torch, "__name__": "klbench_areal_kl"}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), namespace)
    return namespace["KLEstimator"], f"areal/utils/data.py:{nodes[0].lineno}"


def load() -> Library:
    version = require(DIST, SUPPORTED)
    cls, src = _load_class()
    lib = Library(DIST, version)
    for est in ("k1", "k2", "k3"):
        estimator = cls(est)

        def loss(batch: KLBatch, estimator=estimator) -> torch.Tensor:
            return reward_to_go_surrogate(estimator(old_or_current(batch), batch.ref_logp), batch)

        lib.settings[f"areal.kl.{est}"] = Setting(
            f"areal.kl.{est}", loss, src, "in the reward: return-to-go REINFORCE, per-token ratio (klbench's)",
            "default kl_estimator" if est == "k1" else "")
    return lib
