"""task=pretrain: build (or, with task.force, rebuild) the embedded LM that model=embedded describes.

The building lives in klbench.models.embedded; this runner only picks the spec and prints the result.
"""
from __future__ import annotations

import json
import os
import shutil

from klbench.models.embedded import embedded_lm_dir, ensure_embedded_lm, preset_spec


def run_pretrain(cfg) -> dict[str, float]:
    if cfg.model.kind != "embedded":
        raise ValueError(f"task=pretrain builds the embedded LMs: it needs model=embedded, got model.kind={cfg.model.kind}")
    spec = preset_spec(cfg.model.preset, cfg.model.spec)
    path = embedded_lm_dir(spec, cfg.paths.cache)
    if cfg.task.force and os.path.isdir(path):
        shutil.rmtree(path)
    path = ensure_embedded_lm(spec, cfg.paths.cache)
    with open(os.path.join(path, "pretrain_metrics.json")) as f:
        metrics = json.load(f)
    print(f"klbench: embedded {spec['name']} LM at {path}")
    for k, v in sorted(metrics.items()):
        print(f"  {k:<24} {v}")
    return metrics
