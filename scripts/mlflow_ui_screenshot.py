"""Takes docs/mlflow.md's screenshots of the MLflow UI: runs the issue-21 quick sweep into a scratch outputs
folder, serves it with the `mlflow ui` command the sweep printed, opens the link it printed in headless
Chromium (Debian's package, driven by Playwright) and walks the pages docs/mlflow.md describes:

    docs/img/mlflow_ui_parent.png    the link: the sweep's parent run, Model training view
    docs/img/mlflow_ui_frontier.png  its Artifacts tab, pareto.html (reward against KL, the frontier)
    docs/img/mlflow_ui_runs.png      the runs table, the parent expanded: the trials told apart
    docs/img/mlflow_ui_compare.png   the trials ticked, Compare: params and parallel coordinates
    docs/img/mlflow_ui_sweep.png     the chart view, a val/seq_kl against val/reward scatter added by hand

    python scripts/mlflow_ui_screenshot.py [--out docs/img] [--keep DIR]

The page functions are tests/ui/mlflow_ui.py's, which the browser test (tests/ui/test_mlflow_browser.py)
asserts on; each step checks what it shows as the test does, so it fails loudly when the walk-through
no longer matches the UI.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "ui"))
import mlflow_ui as ui  # noqa: E402

SWEEP = ["sweep=rl_beta", "experiment=tabular", "hydra.sweeper.n_trials=4", "task.max_steps=40"]


def run_sweep(outputs: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "KLBENCH_PARENT_RUN_ID",
                                                            "KLBENCH_RESUME_CKPT")}
    env.update(KLBENCH_OUTPUTS=str(outputs), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    print(f"klbench -m {' '.join(SWEEP)}  (KLBENCH_OUTPUTS={outputs})", flush=True)
    proc = subprocess.run([sys.executable, "-m", "klbench.cli", "-m", *SWEEP], cwd=outputs.parent, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the sweep failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def walk(browser, link: str, children: list[str], out: Path) -> None:
    page = ui.first_visit(browser)
    ui.open_run(page, link)
    v = ui.view(page)
    if ui.genai_words(v) or "Models" not in v["sidebar"]:
        raise AssertionError(f"the printed link did not open in Model training: {v['sidebar']}")
    ui.shoot(page, out / "mlflow_ui_parent.png")

    fig = ui.frontier_figure(page)
    if not fig["file"] or fig["points"] < len(children):
        raise AssertionError(f"no frontier figure with every trial on the parent run: {fig}")
    page.wait_for_timeout(1000)
    ui.shoot(page, out / "mlflow_ui_frontier.png")

    page.get_by_role("tab", name="Overview").click()
    ui.to_runs_table(page)
    names = dict(ui.run_names(page))
    shown = [names[c] for c in children]
    if len(set(shown)) != len(shown):
        raise AssertionError(f"the runs table shows {shown} of {children}")
    ui.shoot(page, out / "mlflow_ui_runs.png")

    ui.select_and_compare(page, children)
    params = ui.compare_params(page)
    if any(k.startswith(("paths.", "ckpt")) for k in params):
        raise AssertionError(f"bookkeeping among the compare view's params: {sorted(params)}")
    ui.shoot(page, out / "mlflow_ui_compare.png")

    page.go_back()
    page.get_by_text("matching runs").wait_for()
    ui.run_names(page)
    titles = ui.scatter_chart(page)
    if "val/seq_kl vs. val/reward" not in titles:
        raise AssertionError(f"no scatter chart after the clicks; charts shown: {titles}")
    ui.shoot(page, out / "mlflow_ui_sweep.png")
    page.context.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="where the PNGs go")
    ap.add_argument("--keep", help="outputs folder for the sweep, kept (default: a temporary one, removed)")
    a = ap.parse_args()
    if (why := ui.missing()) is not None:
        raise SystemExit(why)
    import re
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="klbench-ui-") as tmp:
        outputs = Path(a.keep or Path(tmp) / "outputs").resolve()
        stdout = run_sweep(outputs)
        printed = ui.where_printed(stdout)
        children = [n for n in re.findall(r"^klbench: MLflow run\s+\w+ \((.*)\) in experiment", stdout, re.M)
                    if not n.endswith("the sweep's parent run")]
        with ui.chromium() as browser, ui.serve(printed["command"], Path(tmp) / "mlflow_ui.log") as base:
            walk(browser, ui.local(printed["links"][-1], base), children, Path(a.out))
    print(f"wrote {a.out}/mlflow_ui_{{parent,frontier,runs,compare,sweep}}.png in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
