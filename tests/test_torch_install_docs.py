"""The README says the truth about torch wheels (issue 42, item 7): `pip install torch==2.13.0` resolves PyPI's
CUDA build on stock Linux x86_64 whether or not a GPU is there (only this VM's local wheel folder made it the
CPU one), so the docs must say so and give the CPU-only install as PyTorch documents it, while `.ci/run`
keeps running the README's command unchanged (tests/test_docs_commands.py checks that the two agree)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_ONLY = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_the_readme_and_the_testing_page_give_the_cpu_only_install_and_say_what_the_plain_one_does():
    for page in ("README.md", "docs/testing.md"):
        text = (ROOT / page).read_text()
        assert CPU_ONLY in text, page
        assert "CUDA build" in text and "without" in text, page  # what it does with and without a GPU
        assert "so that pip takes the CPU wheel" not in text, page  # the claim that held only on this VM


def test_ci_still_installs_the_plain_pin():
    assert "pip install torch==2.13.0 && pip install -e" in (ROOT / ".ci" / "run").read_text()
