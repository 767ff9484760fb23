"""Every option of every config group composes, and the run pieces it selects build."""
from __future__ import annotations

from pathlib import Path

import pytest

from klbench.compose import compose

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {g: sorted(p.stem for p in (ROOT / "conf" / g).glob("*.yaml"))
          for g in ("task", "estimator", "kl_ctl", "model", "dataset", "reward", "hardware", "logger", "store",
                    "experiment")}


def compose_cfg(tmp_path, overrides=()):
    """The tests' shorthand: `klbench <overrides>` with its outputs and run folders in tmp_path (never the repo's)."""
    return compose(overrides, outputs=tmp_path / "outputs", run_dir=tmp_path / "run")


def test_every_group_has_options():
    for group, options in GROUPS.items():
        assert options, f"conf/{group} is empty"
    assert set(GROUPS["estimator"]) == {"naive_mc", "naive_cv", "token", "seq", "cumulative", "loo", "rb",
                                        "in_reward", "in_loss"}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_option_composes(tmp_path, group, option):
    cfg = compose_cfg(tmp_path, [f"{group}={option}"])
    assert cfg.task.name and cfg.estimator.name and cfg.model.kind and cfg.reward.kind


@pytest.mark.parametrize("name", GROUPS["estimator"])
def test_estimator_option_builds(tmp_path, name):
    from klbench.estimators import GRADIENT_ESTIMATORS, gradient_estimator
    from klbench.train import check_config
    cfg = compose_cfg(tmp_path, [f"estimator={name}"])
    check_config(cfg)
    opts = {k: v for k, v in cfg.estimator.items() if k not in ("name", "beta")}
    assert gradient_estimator(name, **opts).name == name
    assert set(opts) <= set(GRADIENT_ESTIMATORS[name].defaults)
