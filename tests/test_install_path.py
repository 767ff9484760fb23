"""The README's install path reaches the audit: a fresh venv built exactly as the README says, then
`klbench-audit --all`; and a library whose import chain fails is one line of the table, never a traceback."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from klbench.libraries.audit import run, text_table

REPO = Path(__file__).resolve().parents[1]


def test_a_library_whose_import_fails_is_one_line_with_the_last_line_and_the_pip_line(monkeypatch):
    import klbench.libraries.trl as trl_adapter

    def broken():  # what TRL's lazy module raises when `datasets` is missing (trl/_lazy_module.py)
        raise RuntimeError("Failed to import trl.trainer.grpo_trainer because of the following error (look up "
                           "to see its traceback):\nNo module named 'datasets'")

    monkeypatch.setattr(trl_adapter, "load", broken)
    cells = run(["trl"])
    assert len(cells) == 1 and cells[0].policy == "-"
    line = text_table(cells).splitlines()[1]
    assert len(text_table(cells).splitlines()) == 2
    assert "skipped: trl: installed but cannot be imported (RuntimeError: No module named 'datasets')" in line
    assert "pip install --no-deps trl==1.16.0" in line and "Traceback" not in line


@pytest.mark.slow
def test_readme_install_path_runs_the_audit(tmp_path):
    """python3 -m venv, pip install torch==2.13.0, pip install -e <repo>, bash scripts/install_libraries.sh
    (the README's lines; no test extra), then klbench-audit --all: every pinned library audits."""
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    env["HF_HUB_OFFLINE"] = "1"
    steps = [["python3", "-m", "venv", str(venv)],
             ["pip", "install", "-q", "torch==2.13.0"], ["pip", "install", "-q", "-e", str(REPO)],
             ["bash", str(REPO / "scripts" / "install_libraries.sh")]]
    for cmd in steps:
        r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, f"{' '.join(cmd)}: {r.stderr[-2000:]}"
    r = subprocess.run(["klbench-audit", "--all"], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    for lib in ("trl 1.16.0", "verl 0.9.1", "openrlhf 0.11.2", "areal 1.0.4", "skyrl_train 0.3.1",
                "tinker_cookbook 0.6.1"):
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith(lib)]
        assert rows and not any("skipped" in ln for ln in rows), f"{lib}: {rows[:2]}"
    assert "trl.grpo " in r.stdout and "trl.distill.beta1 " in r.stdout and "partial_kl_pi_ref" in r.stdout
