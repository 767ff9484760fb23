"""Issue 44: the audit on several releases (scripts/audit_versions.py). The rendering is a fast test; installing and
auditing releases in their own venvs is `-m slow` (minutes, the network)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from klbench.libraries.versions import markdown

ROOT = Path(__file__).resolve().parents[1]


def _result(version: str, on: str, default: str) -> dict:
    return {"library": "trl", "version": version, "defaults": {"GRPOConfig.use_bias_correction_kl": default},
            "cells": [{"setting": "trl.grpo", "policy": "on", "match": on},
                      {"setting": "trl.grpo", "policy": "off", "match": "none of the above"}]}


def test_versions_section_bolds_what_changed_in_release_order():
    lines = markdown([_result("1.16.0", "partial_kl_pi_ref", "True"), _result("1.9.0", "partial_kl_ref_pi", "False")],
                     ["trl==0.0.1 does not install: no matching distribution"])
    text = "\n".join(lines)
    assert "| setting | 1.9.0 | 1.16.0 |" in text  # numeric order, not string order
    assert "| `trl.grpo` | partial_kl_ref_pi / none of the above | **partial_kl_pi_ref / none of the above** |" in text
    assert "| default `GRPOConfig.use_bias_correction_kl` | False | **True** |" in text
    assert "- trl==0.0.1 does not install" in text


def test_write_section_replaces_only_its_own_section(tmp_path):
    spec = importlib.util.spec_from_file_location("audit_versions", ROOT / "scripts" / "audit_versions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = tmp_path / "libraries.md"
    page.write_text("# head\n\n## A\n\na\n\n## Versions over time\n\nold\n\n## B\n\nb\n")
    mod.write_section(page, ["", "## Versions over time", "", "new"])
    text = page.read_text()
    assert "old" not in text and "new" in text and "## A" in text and "## B\n\nb" in text


@pytest.mark.slow
def test_two_releases_audit_and_a_missing_one_is_one_line(tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "audit_versions.py"), "trl==1.15.0", "verl==0.8.0",
                        "trl==0.0.1rc999", "--no-write", "--json", str(out)], capture_output=True, text=True,
                       timeout=1800, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    raw = json.loads(out.read_text())
    got = {(x["library"], x["version"]) for x in raw["results"]}
    assert got == {("trl", "1.15.0"), ("verl", "0.8.0")}
    assert len(raw["failures"]) == 1 and "trl==0.0.1rc999" in raw["failures"][0] and "\n" not in raw["failures"][0]
    trl = next(x for x in raw["results"] if x["library"] == "trl")
    assert any(c["setting"] == "trl.grpo" and c["policy"] == "on" and not c["match"].startswith("raised")
               for c in trl["cells"])
