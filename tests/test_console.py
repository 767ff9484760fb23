"""What a newcomer meets on the console (docs/console.md): each Lightning message once, no library notices
at default verbosity (KLBENCH_VERBOSE=1 brings them back), a run's last lines say where it is, `--help`
lists the sweeps, the progress bar counts the run's steps, and a tabular run without MLflow imports neither
transformers nor MLflow.

The sweep's end (labelled Pareto trials, pareto.png/csv in its folder) is checked in tests/test_sweeps.py.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_sweeps import cli_env

from klbench.console import messages as console

ROOT = Path(__file__).resolve().parent.parent
TINY = ["experiment=tabular", "task.max_steps=4", "task.val_every=2"]
# the real CLI, reporting at exit which heavy packages the run imported
REPORT_MODULES = """
import atexit, sys
atexit.register(lambda: print("MODULES", sorted(m for m in ("transformers", "mlflow", "scipy", "matplotlib")
                                                 if m in sys.modules)))
from klbench.cli import main
main()
"""


def klbench(outputs: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", REPORT_MODULES, *overrides], cwd=outputs.parent,
                          env=cli_env(outputs, **(env or {})), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def where(stdout: str) -> dict[str, str]:
    """The run's last lines, `klbench: <label>  <value>`, by label."""
    return {m[1].strip(): m[2] for m in re.finditer(r"^klbench: (run folder|MLflow run|to see it)\s+(.*)$",
                                                    stdout, re.M)}


def test_tabular_run_without_mlflow_is_quiet_and_lean(tmp_path):
    outputs = tmp_path / "outputs"
    proc = klbench(outputs, *TINY, "logger=none")
    out = proc.stdout + proc.stderr
    assert out.count("Seed set to 0") == 1, out  # Lightning's own handler and Hydra's both printed it
    for notice in ("litlogger", "GPU available", "TPU available", "LeafSpec", "`srun` command", "`Trainer.fit` stopped"):
        assert notice not in out, notice
    assert "MODULES []" in proc.stdout  # no transformers, MLflow, scipy or matplotlib (klbench/tasks/lean.py)
    run_dir = Path(where(proc.stdout)["run folder"])
    assert run_dir.is_dir() and (run_dir / "klbench.log").is_file() and outputs in run_dir.parents
    assert "Seed set to 0" in (run_dir / "klbench.log").read_text()


def test_run_ends_with_where_its_record_is(tmp_path):
    outputs = tmp_path / "outputs"
    proc = klbench(outputs, *TINY)
    lines = where(proc.stdout)
    run_dir = Path(lines["run folder"])
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    assert lines["MLflow run"].startswith(run_id) and "in experiment 'klbench'" in lines["MLflow run"]
    assert lines["to see it"] == f"mlflow ui --backend-store-uri sqlite:///{outputs.resolve()}/mlflow.db"
    assert f"#/experiments/1/runs/{run_id}" in proc.stdout
    last = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("MODULES")][-1]
    assert last.endswith(run_id)  # they are the run's last lines


def test_where_lines_paste_into_a_shell_with_spaces_in_the_outputs_path(tmp_path):
    """The printed `mlflow ui` command, split by bash as a paste would be, names the run's store."""
    from mlflow.tracking import MlflowClient
    outputs = tmp_path / "my runs" / "out dir"
    outputs.mkdir(parents=True)
    lines = where(klbench(outputs, *TINY).stdout)
    assert Path(lines["run folder"]).is_dir() and outputs in Path(lines["run folder"]).parents
    argv = subprocess.run(["bash", "-c", lines["to see it"].replace("mlflow ui", "printf '%s\\n'", 1)],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert argv == ["--backend-store-uri", f"sqlite:///{outputs.resolve()}/mlflow.db"], lines["to see it"]
    run_id = lines["MLflow run"].split()[0]
    assert MlflowClient(tracking_uri=argv[1]).get_run(run_id).info.status == "FINISHED"


VERBOSITY = """
import logging, sys, warnings
logging.basicConfig(stream=sys.stdout, format="%(name)s: %(message)s", level=logging.INFO)
from klbench.console import messages as console
console.setup()
logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
logging.getLogger("lightning.pytorch.utilities.rank_zero").info("a message klbench keeps")
logging.getLogger("transformers.modeling_utils").warning("`loss_type=None` was set in the config but ...")
warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
warnings.warn("a warning klbench keeps", FutureWarning)
"""


def test_notices_are_silenced_by_message_and_come_back_with_klbench_verbose():
    def run(verbose: str) -> str:
        env = {"PATH": "/usr/bin:/bin", "KLBENCH_VERBOSE": verbose}
        proc = subprocess.run([sys.executable, "-c", VERBOSITY], env=env, capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout + proc.stderr

    quiet, loud = run(""), run("1")
    for kept in ("a message klbench keeps", "a warning klbench keeps"):
        assert kept in quiet and kept in loud
    for silenced in ("GPU available", "loss_type=None", "LeafSpec"):
        assert silenced not in quiet and silenced in loud


def test_help_names_klbench_and_lists_the_sweeps():
    proc = subprocess.run([sys.executable, "-m", "klbench.cli", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("klbench") and "cli is powered" not in proc.stdout
    sweeps = sorted(p.stem for p in (ROOT / "sweeps" / "sweep").glob("*.yaml"))
    assert f"sweep: {', '.join(sweeps)}" in proc.stdout


def test_mlflow_ui_lines():
    assert console.mlflow_ui_lines("sqlite:////o/mlflow.db", "3", "abc") == [
        "mlflow ui --backend-store-uri sqlite:////o/mlflow.db", "then open http://127.0.0.1:5000/#/experiments/3/runs/abc"]
    assert console.mlflow_ui_lines("sqlite:////my runs/it's/mlflow.db", "3", None)[0] == \
        "mlflow ui --backend-store-uri 'sqlite:////my runs/it'\"'\"'s/mlflow.db'"
    assert console.mlflow_ui_lines("http://mlflow-host:5000/", "3", None) == [
        "open http://mlflow-host:5000/#/experiments/3"]
    assert console.display_uri("postgresql://klbench:secret@db/klbench") == "postgresql://klbench:***@db/klbench"


def test_progress_bar_counts_steps_of_the_run_with_reward_and_kl(capsys):
    from types import SimpleNamespace

    from klbench.console.progress import StepProgressBar
    trainer = SimpleNamespace(max_steps=300, global_step=100, callback_metrics={}, progress_bar_metrics={})
    module = SimpleNamespace(last_logged={})
    bar = StepProgressBar()
    bar.on_train_start(trainer, module)  # a run resumed at step 100
    assert (bar.bar.n, bar.bar.total) == (100, 300)
    trainer.global_step = 105
    module.last_logged.update({"train/reward": 1.234, "train/kl_rb": 0.5, "train/kl_mc": 9.0, "train/beta": 0.1})
    trainer.callback_metrics = {"val/reward": 1.1, "val/seq_kl": 0.45}
    bar.on_train_batch_end(trainer, module, None, None, 0)
    assert bar.bar.n == 105
    assert bar.bar.postfix == "reward 1.23, KL 0.5, val reward 1.1, val KL 0.45"
    bar.on_train_end(trainer, module)
    assert "step 105/300" in capsys.readouterr().err
