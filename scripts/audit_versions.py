"""The library audit on several releases of TRL and verl (and skyrl 0.4.0): one venv per release, then the
"Versions over time" section of docs/libraries.md (issue 44).

    python scripts/audit_versions.py                      # the default releases below; rewrites the section
    python scripts/audit_versions.py trl==1.15.0 verl==0.8.0 --no-write

Each venv (under $KLBENCH_VERSIONS_DIR, default ~/.cache/klbench/versions) reads torch, transformers and klbench from
this project's venv through a .pth line (site.addsitedir), and holds only the release under test, installed
--no-deps as scripts/install_libraries.sh does: it shadows the pinned one. Installs are bounded (INSTALL_TIMEOUT);
a release that does not install or import is one line, and the others go on.
"""
from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from klbench.libraries.versions import markdown  # noqa: E402

# the last three minor releases of each that install here, and TRL 1.9.2 / 1.10.0 on either side of the switch of
# use_bias_correction_kl's default (False -> True in 1.10.0, read from the wheels' grpo_config.py)
RELEASES = ["trl==1.16.0", "trl==1.15.0", "trl==1.14.2", "trl==1.10.0", "trl==1.9.2", "verl==0.9.1", "verl==0.8.0",
            "verl==0.7.1", "skyrl==0.4.0"]
INSTALL_TIMEOUT, AUDIT_TIMEOUT = 300, 600
MARK = "## Versions over time"


def venv_for(spec: str, base: Path) -> Path:
    """A venv holding `spec` alone (the project's venv behind it); built once, reused."""
    path = base / spec.replace("==", "-")
    py = path / "bin" / "python"
    if (path / ".installed").exists():
        return py
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    sp = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                        capture_output=True, text=True).stdout.strip()
    # the project's site-packages after this venv's own: its .pth files (klbench's editable install) are read too
    Path(sp, "zz_klbench_base.pth").write_text(f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", sp, spec]
    if spec.startswith("skyrl=="):
        cmd.insert(4, "--ignore-requires-python")  # its wheel says Python >= 3.12 but is pure Python
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if r.returncode:
        lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        raise RuntimeError(f"{spec} does not install: {lines[-1] if lines else r.returncode}")
    (path / ".installed").write_text(spec)
    return py


def audit(spec: str, base: Path) -> dict:
    py = venv_for(spec, base)
    lib = spec.split("==")[0]
    r = subprocess.run([str(py), "-m", "klbench.libraries.versions", lib], capture_output=True, text=True,
                       timeout=AUDIT_TIMEOUT, cwd=ROOT, env={**os.environ, "KLBENCH_AUDIT_ANY_VERSION": "1"})
    if r.returncode:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        raise RuntimeError(f"{spec} installs but its audit fails: {lines[-1] if lines else r.returncode}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["cells"] and out["cells"][0]["policy"] == "-":  # the adapter's one-line reason (an import that fails)
        raise RuntimeError(f"{spec}: {out['cells'][0]['match']}")
    for c in out["cells"]:
        c["version"] = spec.split("==")[1]
    return {**out, "version": spec.split("==")[1]}


def write_section(page: Path, section: list[str]) -> None:
    """Replace the versions section of the generated libraries page (klbench-audit keeps it when it regenerates
    the page), or add it before the relative errors."""
    text, new = page.read_text(), "\n".join(section).strip("\n")
    if MARK in text:
        head, rest = text.split(MARK, 1)
        tail = rest[rest.find("\n## ") + 1:] if "\n## " in rest else ""
        page.write_text(head.rstrip("\n") + "\n\n" + new + "\n" + ("\n" + tail if tail else ""))
        return
    head, sep, tail = text.partition("\n## Relative errors")
    page.write_text(head.rstrip("\n") + "\n\n" + new + "\n" + sep + tail)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("releases", nargs="*", default=RELEASES)
    p.add_argument("--no-write", action="store_true", help="print the section instead of writing docs/libraries.md")
    p.add_argument("--json", metavar="PATH", help="also write the raw results here")
    p.add_argument("--from-json", metavar="PATH", help="render (and write) the section from earlier raw results")
    a = p.parse_args(argv)
    if a.from_json:
        raw = json.loads(Path(a.from_json).read_text())
        write_section(ROOT / "docs" / "libraries.md", markdown(raw["results"], raw["failures"]))
        print("wrote the versions section of docs/libraries.md")
        return 0
    base = Path(os.environ.get("KLBENCH_VERSIONS_DIR", Path.home() / ".cache" / "klbench" / "versions"))
    base.mkdir(parents=True, exist_ok=True)
    results, failures = [], []
    for spec in a.releases:
        start = time.perf_counter()
        try:
            results.append(audit(spec, base))
            print(f"{spec}: audited in {time.perf_counter() - start:.0f} s", flush=True)
        except (RuntimeError, subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
            failures.append(str(e).splitlines()[0])
            print(failures[-1], flush=True)
    section = markdown(results, failures)
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "failures": failures}, indent=1))
    if a.no_write:
        print("\n".join(section))
    else:
        write_section(ROOT / "docs" / "libraries.md", section)
        print("wrote the versions section of docs/libraries.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
