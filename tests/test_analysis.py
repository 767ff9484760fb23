"""How the analyses are layered: the maths (klbench.analysis.frontier, klbench.analysis.distill_curves) loads neither MLflow
nor matplotlib, the plots leave the caller's matplotlib backend alone, and both commands
(klbench-pareto, klbench-distill-report) find the store as klbench runs do."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from klbench.analysis import distill_report, pareto


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_the_maths_loads_no_mlflow_and_no_matplotlib():
    proc = run_python("""
        import sys
        import klbench.analysis.distill_curves, klbench.analysis.frontier
        heavy = sorted(m for m in ("mlflow", "matplotlib", "hydra", "torch", "lightning") if m in sys.modules)
        assert not heavy, heavy
    """)
    assert proc.returncode == 0, proc.stderr


def test_plots_leave_the_backend_alone(tmp_path):
    """A notebook or GUI has its own backend: drawing must neither switch it (matplotlib.use) nor start
    pyplot's global state."""
    proc = run_python(f"""
        import sys
        import matplotlib
        import numpy as np
        matplotlib.use("svg")  # a backend that is not Agg and needs no display

        def refuse(*args, **kwargs):
            raise AssertionError(f"matplotlib.use{{args}} called")
        matplotlib.use = refuse

        from pathlib import Path
        from klbench.analysis.distill_curves import Band
        from klbench.analysis.plots import plot_bands, plot_pareto
        bands = {{"token": Band(np.array([0, 10]), np.array([[8.0, 4.0], [8.0, 5.0]])),
                  "rb": Band(np.array([0, 10]), np.array([[8.0, 1.0], [8.0, 2.0]]))}}
        plot_bands(bands, Path({str(tmp_path)!r}) / "bands.png")
        plot_pareto({{"estimator": ["rb", "mc"], "reward": [0.2, 0.6], "seq_kl": [1.0, 3.0]}},
                    Path({str(tmp_path)!r}) / "pareto.png")
        assert "matplotlib.pyplot" not in sys.modules
        assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
    """)
    assert proc.returncode == 0, proc.stderr
    for name in ("bands.png", "pareto.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", [pareto, distill_report], ids=["klbench-pareto", "klbench-distill-report"])
def test_no_store_in_the_outputs_folder(command, tmp_path, monkeypatch, capsys):
    """$KLBENCH_OUTPUTS without an mlflow.db: a clear error naming the path, exit 1, and no empty store left
    behind that would know no experiment."""
    outputs = tmp_path / "empty"
    outputs.mkdir()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("KLBENCH_OUTPUTS", str(outputs))
    monkeypatch.chdir(tmp_path)
    assert command.main(["--experiment", "sweep-a"]) == 1
    err = capsys.readouterr().err
    assert f"no MLflow store at {outputs.resolve()}/mlflow.db" in err, err
    assert not (outputs / "mlflow.db").exists() and not (tmp_path / "outputs").exists()
