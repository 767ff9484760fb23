"""Libraries that ship a KL loss or an on-policy distillation loss but cannot be installed and run here: each
is one row of the audit's table with the reason, never a transcription of its code. The reasons were checked
against PyPI with pip (Python 3.11, --no-deps) when the row was added; `klbench-audit --all` prints them."""
from __future__ import annotations

# name -> (distribution and release the reason refers to, the reason)
UNAVAILABLE = {
    "skyrl": ("skyrl 0.4.0", "the release with SkyRL #1353's fix (compute_approx_kl without @torch.no_grad()) "
              "requires Python >=3.12 (its wheel is pure Python: it installs with --ignore-requires-python), and its "
              "ppo_utils imports skyrl.backends and skyrl.train.config, a runtime klbench does not install: not run "
              "in this venv; `python scripts/audit_versions.py skyrl==0.4.0` audits its compute_approx_kl in a venv "
              "of its own (docs/libraries.md, Versions over time)"),
    "nemo_rl": ("nemo-rl", "not on PyPI as a release (the name holds a 0.0.0 placeholder); installed from "
                "GitHub with its CUDA stack only"),
    "slime": ("slime", "not on PyPI (THUDM/slime is installed from its repository inside a Megatron image)"),
    "roll": ("ROLL", "not on PyPI (the PyPI name `roll` is an unrelated package)"),
    "prime_rl": ("prime-rl", "not on PyPI (installed from its repository with uv)"),
}
