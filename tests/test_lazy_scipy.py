"""klbench.models.lazy_scipy: loading a causal LM does not import scipy.optimize for transformers' detection
losses, and those losses still get scipy's functions. Each case runs in a fresh interpreter: what it checks is
what a process imports."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("scipy.optimize")

LOSSES = ["loss_for_object_detection", "loss_deformable_detr", "loss_rt_detr", "loss_rf_detr", "loss_grounding_dino",
          "loss_lw_detr"]


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_loading_an_lm_leaves_scipy_optimize_unimported(tiny_lm_dir):
    out = run(f"""
        import importlib, sys
        import numpy as np
        from klbench.models import lazy_scipy
        from klbench.models.hf import load_causal_lm
        load_causal_lm({tiny_lm_dir!r})
        assert "transformers.loss.loss_utils" in sys.modules  # the losses were imported, with the model
        assert "scipy.optimize" not in sys.modules, "scipy.optimize imported by loading an LM"
        assert lazy_scipy._FINDER not in sys.meta_path  # it acted once and left
        cost = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
        got = [importlib.import_module("transformers.loss." + m).linear_sum_assignment(cost) for m in {LOSSES!r}]
        import scipy.optimize
        assert type(scipy.optimize).__module__ != "klbench.models.lazy_scipy" and hasattr(scipy.optimize, "minimize")
        want = scipy.optimize.linear_sum_assignment(cost)
        assert all(np.array_equal(g[0], want[0]) and np.array_equal(g[1], want[1]) for g in got)
        print("ok", want[1].tolist())
    """)
    assert out.split() == ["ok", "[1,", "0,", "2]"]


def test_an_imported_scipy_optimize_is_used_as_it_is(tiny_lm_dir):
    run(f"""
        import scipy.optimize
        from klbench.models.hf import load_causal_lm
        load_causal_lm({tiny_lm_dir!r})
        import transformers.loss.loss_rt_detr as loss
        assert loss.linear_sum_assignment is scipy.optimize.linear_sum_assignment
    """)
