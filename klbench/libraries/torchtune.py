"""torchtune 0.6.1: no GRPO loss ships in this release (GRPOLoss is on the main branch only), so it has no
settings; `load` says so in one line. (Checked by file, since importing torchtune.rlhf needs torchao.)"""
from __future__ import annotations

import importlib.util
import os

from klbench.libraries.base import Library, LibraryMissing, require

DIST, SUPPORTED = "torchtune", "0.6.1"


def load() -> Library:
    require(DIST, SUPPORTED)
    root = list(importlib.util.find_spec("torchtune").submodule_search_locations)[0]
    for rel in ("rlhf/loss/grpo.py", "dev/grpo/loss.py"):
        if os.path.exists(os.path.join(root, rel)):
            raise LibraryMissing(f"{DIST} {SUPPORTED}: torchtune/{rel} exists here but has no adapter yet")
    raise LibraryMissing(f"{DIST} {SUPPORTED}: ships no GRPOLoss (torchtune/rlhf/loss has dpo.py and ppo.py only; "
                         "GRPOLoss is on the main branch); nothing to audit")
