"""Presets and tasks compose (issue 19): a preset (conf/experiment/) chooses a setting, the model, teacher,
reward and data, and any task runs on it. The preset's values for a task live in
conf/experiment/task/<preset>/<task>.yaml and apply only to that task."""
from __future__ import annotations

from pathlib import Path

import pytest

from klbench.config.compose import compose
from klbench.config.schema import ConfigError, validate

CONF = Path(__file__).resolve().parent.parent / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_the_probe(tmp_path, preset):
    """`experiment=<preset> task=probe` used to be refused ("task.prompts_per_step does not apply to task
    'probe'") for every preset that tunes its training task."""
    cfg = compose([f"experiment={preset}", "task=probe"], outputs=tmp_path)
    validate(cfg)
    assert cfg.task.name == "probe"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_and_task_composes_or_names_a_real_rule(tmp_path, preset):
    """Any task on any preset either validates, or fails on a rule of the setting itself (pretrain builds
    embedded LMs; distillation needs a teacher), never on a key the preset set for another task."""
    for task in ("rl", "distill", "pretrain", "probe"):
        cfg = compose([f"experiment={preset}", f"task={task}"], outputs=tmp_path)
        try:
            validate(cfg)
        except ConfigError as e:
            assert "does not apply to" not in str(e), (preset, task, str(e))


def test_the_tabular_distillation_pair_is_probed_as_the_preset_sets_it(tmp_path):
    """The pair the issue had to spell out by hand: student table (seed 0) against teacher table (seed 1)."""
    cfg = compose(["experiment=distill_tabular", "task=probe"], outputs=tmp_path)
    assert (cfg.model.kind, cfg.teacher.kind, cfg.reward.kind) == ("tabular", "tabular", "none")
    assert (cfg.model.ref_seed, cfg.teacher.ref_seed, cfg.model.ref_scale, cfg.teacher.ref_scale) == (0, 1, 2.0, 2.0)


def test_a_preset_tunes_only_its_own_task(tmp_path):
    """experiment=tabular's training values reach task=rl, and task=distill on it keeps distill's own."""
    rl = compose(["experiment=tabular"], outputs=tmp_path)
    assert (rl.task.lr, rl.task.max_steps, rl.task.prompts_per_step) == (0.1, 300, 16)
    plain = compose(["task=distill"], outputs=tmp_path)
    distill = compose(["experiment=tabular", "task=distill"], outputs=tmp_path)
    assert (distill.task.lr, distill.task.max_steps) == (plain.task.lr, plain.task.max_steps)
