"""The MLflow UI as a person sees it, in headless Chromium (issue 21): a tiny tabular sweep writes a
store, the `mlflow ui` command it printed serves it, and the links it printed are opened.

- every printed link, and the runs table reached from it, opens in the Model training view, not GenAI's;
- the sweep's children are told apart by the part of their names the runs table shows;
- the parent run's Artifacts hold an interactive reward-against-KL figure with the frontier;
- the compare view's params are the experiment's design: no path among them.

Skips, saying why, where Playwright or Debian's Chromium is missing (.ci/install_servers.sh installs it).
The page functions are tests/ui/mlflow_ui.py's, which scripts/mlflow_ui_screenshot.py also uses.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import mlflow_ui as ui
from test_sweeps import cli_env

# three trials of 10 steps: children to tell apart and a frontier to draw, in seconds of training
SWEEP = ["sweep=rl_beta", "experiment=tabular", "hydra.sweeper.n_trials=3", "task.max_steps=10",
         "task.val_every=5"]

if (why := ui.missing()) is not None:
    pytest.skip(why, allow_module_level=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The sweep's printed lines, its store served by the printed command, and a browser. The browser
    starts while the sweep runs; the UI once the store exists."""
    outputs = tmp_path_factory.mktemp("ui") / "outputs"
    sweep = subprocess.Popen([sys.executable, "-m", "klbench.cli", "-m", *SWEEP], cwd=outputs.parent,
                             env=cli_env(outputs), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with ui.chromium() as browser:
        out, err = sweep.communicate(timeout=300)
        assert sweep.returncode == 0, out[-3000:] + err[-3000:]
        printed = ui.where_printed(out)
        assert printed["command"] and printed["links"], out[-3000:]
        with ui.serve(printed["command"], outputs.parent / "mlflow_ui.log") as base:
            # the trials' run names, as each trial printed its own (`klbench: MLflow run  <id> (<name>) in ...`)
            children = [n for n in re.findall(r"^klbench: MLflow run\s+\w+ \((.*)\) in experiment", out, re.M)
                        if not n.endswith("the sweep's parent run")]
            yield {"stdout": out, "links": [ui.local(link, base) for link in printed["links"]],
                   "browser": browser, "outputs": outputs, "children": children}


def test_printed_links_open_in_the_model_training_view(site):
    """The sweep prints one link, its parent run's; it and the runs table behind its breadcrumb show the
    Model training sidebar (Runs, Models) with no GenAI entry, and no traces pop-up."""
    assert len(site["links"]) == 1, site["stdout"][-2000:]  # the trials print none (issue 21, item 6)
    for link in site["links"]:
        page = ui.first_visit(site["browser"])
        ui.open_run(page, link)
        v = ui.view(page)
        assert {"Runs", "Models"} <= set(v["sidebar"]) and not ui.genai_words(v), (link, v["sidebar"], v["breadcrumb"])
        ui.to_runs_table(page)
        v = ui.view(page)
        assert {"Runs", "Models"} <= set(v["sidebar"]) and not ui.genai_words(v), (page.url, v["sidebar"])
        page.context.close()


def test_children_are_told_apart_in_the_runs_table(site):
    page = ui.first_visit(site["browser"])
    ui.open_run(page, site["links"][0])
    ui.to_runs_table(page)
    names = ui.run_names(page)
    page.context.close()
    children = [(full, shown) for full, shown in names if full in site["children"]]
    assert len(children) == 3, (names, site["children"])
    shown = [s for _, s in children]
    assert len(set(shown)) == len(shown), f"the runs table shows {shown} of {[f for f, _ in children]}"


def test_parent_run_shows_the_frontier_figure(site):
    page = ui.first_visit(site["browser"])
    ui.open_run(page, site["links"][0])
    fig = ui.frontier_figure(page)
    page.context.close()
    assert fig["file"], f"no interactive (.html) figure among the parent run's artifacts: {fig['artifacts']}"
    names = " ".join(fig["traces"] + fig["legend"])
    assert "rb" in names and "frontier" in names.lower(), fig  # the estimator's points, the frontier
    assert fig["points"] >= 3, fig  # every trial drawn


def test_compare_view_params_hold_no_paths(site):
    page = ui.first_visit(site["browser"])
    ui.open_run(page, site["links"][0])
    ui.to_runs_table(page)
    ui.run_names(page)  # the parent expanded
    ui.select_and_compare(page, site["children"])
    params = ui.compare_params(page)
    page.context.close()
    axes = params.pop("__axes__")
    assert "estimator.beta" in params, sorted(params)
    outputs = str(site["outputs"].resolve())
    paths = {k: v for k, v in params.items()
             if k.startswith(("paths.", "ckpt")) or any(x.startswith("/") or outputs in x for x in v)}
    assert not paths, f"path-valued params in the compare view: {paths}"
    assert not [a for a in axes if a.startswith(("paths.", "ckpt"))], axes
