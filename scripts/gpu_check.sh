#!/usr/bin/env bash
# The GPU check of issue 31 item 5, on a machine with a CUDA device and no network: the `-m gpu` tests, then
# scripts/bench_gpu_step.py (klbench against TRL's GRPOTrainer, Qwen2-0.5B-shaped, bf16). Run from anywhere:
#
#     bash scripts/gpu_check.sh          # logs and the benchmark's JSON in $OUT (default: outputs/gpu_check)
#
# What the machine lacks comes as wheels in .whl/ (carried with the working tree; made with `pip download
# --no-deps` of the versions klbench's venv pins: transformers, peft, hydra-core, omegaconf, pydantic, trl,
# datasets and their few missing requirements). They are installed into /tmp/site, ahead of the system's
# packages on PYTHONPATH, and klbench runs from this checkout without being installed. Every stage has a time
# limit, so the whole check stays under about 9 minutes; a stage that fails does not stop the next.
# Settings from the environment: PYTHON (python3), SITE (/tmp/site), OUT, BENCH_ARGS (e.g. --tiny: the whole check on
# a machine without a GPU, where the gpu tests skip).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/outputs/gpu_check}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
start=$SECONDS
stage() { echo; echo "== $1 ($((SECONDS - start)) s so far)"; }

stage "installing .whl/ into $SITE"
if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
    echo "pip failed: unpacking the wheels instead"  # a wheel is a zip of what lands in site-packages
    $PY -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob('.whl/*.whl')]" "$SITE"
fi
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# the `klbench` command (pyproject: klbench = "klbench.cli:main") for anything that calls it by name; the tests
# themselves start `python -m klbench.cli`
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec %s -m klbench.cli "$@"\n' "$PY" > /tmp/bin/klbench && chmod +x /tmp/bin/klbench
export PATH=/tmp/bin:$PATH

stage "device and versions"
{
    nvidia-smi
    echo "C compiler (Triton builds TRL's fused LM head with it): $(command -v cc || command -v gcc || echo none)"
    $PY - <<'EOF'
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
for name in ("transformers", "peft", "trl", "datasets", "accelerate", "lightning", "hydra", "omegaconf", "pydantic",
             "huggingface_hub", "tokenizers", "safetensors", "numpy"):
    try:
        m = importlib.import_module(name)
        print(f"{name:16} {getattr(m, '__version__', '?'):12} {m.__file__}")
    except Exception as e:  # noqa: BLE001 - a missing package is what this line is for
        print(f"{name:16} MISSING: {type(e).__name__}: {e}")
import klbench.cli  # noqa: F401  the entry point's imports (Hydra, the config schema)
from klbench.models.policies import build_policy  # noqa: F401
print("klbench imports: ok")
EOF
    klbench --help | head -3
} 2>&1 | tee "$OUT/env.log"

stage "pytest -m gpu (tests/test_rollout_gpu.py holds every gpu-marked test) and the hardware options' trainers"
# addopts cleared: pyproject's `-m 'not slow and not gpu' -n 2` would deselect them
timeout -k 10 180 $PY -m pytest -p no:cacheprovider -o addopts='' -ra --durations=10 tests/test_rollout_gpu.py \
    'tests/test_instantiate.py::test_hardware_options_build_a_trainer[gpu]' \
    'tests/test_instantiate.py::test_hardware_options_build_a_trainer[bf16]' 2>&1 \
    | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

stage "scripts/bench_gpu_step.py"
# BENCH_ARGS: e.g. --tiny, to try the whole check on a machine without a GPU
timeout -k 10 300 $PY scripts/bench_gpu_step.py --json "$OUT/bench_gpu_step.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_gpu_step.log"
bench_rc=${PIPESTATUS[0]}

stage "done: tests exit $tests_rc, benchmark exit $bench_rc (124: timed out)"
