"""A typo never runs the wrong job: an option that is no config of its group is refused, with the valid
names, before anything runs (klbench/config/choices.py; issue 32).

The groups are found by walking conf/ and sweeps/, so a group added later is covered without editing this
file: each must be reachable from some defaults list, and an unknown option of it must be refused. Each is
composed in-process through klbench.config.compose, which makes the check the CLI's callback makes; two
real `klbench` processes check the exit code, the one line, and that no folder, store or heavy import
came of it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException
from test_sweeps import cli_env

from klbench.config.compose import compose
from klbench.config.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TOPS = (ROOT / "conf", ROOT / "sweeps")
TYPO = "no_such_option"


def walked_groups() -> dict[str, list[str]]:
    """Every config group under conf/ and sweeps/: a folder holding yaml files, named by its path below
    the top (`experiment/task/tabular`), with its options. The tops themselves hold the primary config
    and sweep_common, which are no group."""
    return {d.relative_to(top).as_posix(): sorted(p.stem for p in d.glob("*.yaml"))
            for top in TOPS for d in sorted(top.rglob("*")) if d.is_dir() and any(d.glob("*.yaml"))}


GROUPS = walked_groups()


@pytest.fixture(scope="module")
def selections() -> dict[str, list[str]]:
    """How each group is selected: the key a user types (`model@teacher`, `experiment/task/tabular@task`)
    -> the overrides that put its group in the defaults list. The keys of the composed config's choices
    with no overrides, then, until nothing new is reached, with each option of a reached group whose
    file names a group not reached yet (experiment=tabular reaches experiment/task/tabular)."""
    reached = {key: [] for key in compose(hydra=True).hydra.runtime.choices}
    while True:
        missing = [g for g in GROUPS if not any(k.split("@")[0] == g for k in reached)]
        new = {}
        for key, before in reached.items():
            group = key.split("@")[0]
            for top in TOPS:
                for path in sorted((top / group).glob("*.yaml")):
                    if any(g in path.read_text() for g in missing):
                        over = [*before, f"{key}={path.stem}"]
                        new.update({k: over for k in compose(over, hydra=True).hydra.runtime.choices
                                    if k not in reached and k not in new})
        if not new:
            return reached
        reached.update(new)


def test_the_walk_finds_the_groups_a_user_types():
    """The walk is what the tests below stand on: it finds the groups the issue named, nested ones too."""
    for group in ("experiment", "sweep", "model", "hydra/launcher", "experiment/task/tabular"):
        assert group in GROUPS, sorted(GROUPS)
    assert "tabular" in GROUPS["experiment"] and "rl_beta" in GROUPS["sweep"]


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_an_unknown_option_is_refused_with_the_valid_names(group, selections, tmp_path):
    keys = [k for k in selections if k.split("@")[0] == group]
    assert keys, f"no defaults list reaches the group {group}: a user cannot select it"
    for key in keys:  # model and model@teacher alike
        with pytest.raises((ConfigError, MissingConfigException)) as e:
            compose([*selections[key], f"{key}={TYPO}"], outputs=tmp_path)
        message = str(e.value)
        missing = [o for o in GROUPS[group] if o not in message]
        assert TYPO in message and not missing, f"{key}={TYPO}: {message!r} lacks {missing}"
        if isinstance(e.value, ConfigError):  # klbench's own line; Hydra's own (non-optional groups) is longer
            assert message.startswith(f"{key}={TYPO} is unknown; valid: ") and "\n" not in message, message


@pytest.mark.parametrize("overrides,refused", [
    (["experiment=tabular,tabualr"], "experiment=tabualr"),  # each value of a sweep over a group
    (["sweep=estimators_grid", "hydra.sweeper.params.estimator='choice(seq,rbb)'"], "estimator=rbb"),  # each trial's
])
def test_a_sweep_is_refused_for_any_value_it_would_run(overrides, refused, tmp_path):
    with pytest.raises(ConfigError, match=f"^{refused} is unknown; valid: "):
        compose(overrides, outputs=tmp_path, multirun=True)


@pytest.mark.parametrize("overrides,refused", [
    (["experiment=tabualr"], "experiment=tabualr"),
    (["-m", "sweep=rl_betaa", "experiment=tabular"], "sweep=rl_betaa"),
    (["-m", "sweep=rl_beta", "experiment=tabualr"], "experiment=tabualr"),  # before the sweep's own callback
    (["task=distill", "model@teacher=hff"], "model@teacher=hff"),  # a null default: Hydra's 11 lines before
])
def test_the_cli_refuses_before_anything_runs(tmp_path, overrides, refused):
    """The real `klbench`: exit 1, one line naming the option and the valid names, and nothing made (no
    run or sweep folder, no MLflow or Optuna store) or imported (no torch, MLflow, Optuna)."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('HEAVY', [m for m in ('torch', 'lightning', 'mlflow', 'optuna') "
            "if m in sys.modules]))\n"
            "from klbench.cli import main\nmain()\n")
    outputs = tmp_path / "outputs"
    proc = subprocess.run([sys.executable, "-c", code, *overrides], cwd=tmp_path, env=cli_env(outputs),
                          capture_output=True, text=True, timeout=120)  # the 2 s target is a benchmark
    group = refused.split("=")[0].split("@")[0]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr == f"klbench: error: {refused} is unknown; valid: {', '.join(GROUPS[group])}\n", proc.stderr
    assert proc.stdout == "HEAVY []\n", proc.stdout
    assert sorted(tmp_path.iterdir()) == [], sorted(tmp_path.rglob("*"))


@pytest.mark.parametrize("overrides,multirun", [
    (["experiment=tabular", "task=probe"], False),  # a preset without values for a task: that default stays optional
    (["estimator=glob(r*)", "experiment=tabular,distill"], True),  # a glob picks existing options only
    (["sweep=estimators_grid"], True),  # its params name estimators that exist
])
def test_what_is_no_typo_composes(overrides, multirun, tmp_path):
    compose(overrides, outputs=tmp_path, multirun=multirun)
