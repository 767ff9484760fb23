#!/usr/bin/env bash
# Installs the pinned RL libraries that klbench-audit runs (the `libraries` extra) into the active venv,
# without letting pip replace torch or pull CUDA wheels: every package goes in with --no-deps, and only the
# small packages that the libraries' KL code needs at import time are added (TRL: accelerate, and datasets
# with its own pure-Python/wheel imports dill, multiprocess, xxhash, which TRL's trainers import; verl's
# package __init__: ray, tensordict and their pure-Python imports). OpenRLHF and AReaL need none: the
# adapters load their KL code without their heavy imports (see klbench/libraries/openrlhf.py, areal.py).
set -euo pipefail
pip install -q --no-deps \
  trl==1.16.0 verl==0.9.1 openrlhf==0.11.2 areal==1.0.4 torchtune==0.6.1 \
  accelerate==1.15.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
  ray==2.60.0 tensordict==0.15.3 pyvers==0.2.3 codetiming==1.4.0 orjson==3.13.0 msgpack==1.2.4 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
# skyrl-train's wheel says Python ==3.12 but is pure Python; the adapter loads its ppo_utils.py by path, which
# imports jaxtyping (with wadler-lindig) and loguru besides ray and omegaconf
pip install -q --no-deps --ignore-requires-python skyrl-train==0.3.1
pip install -q --no-deps jaxtyping==0.3.11 wadler-lindig==0.1.8 loguru==0.7.3
# tinker-cookbook's on-policy distillation module imports the tinker SDK (an HTTP client of the remote service,
# never called here: the adapter stands in for the teacher's client) and these small packages
pip install -q --no-deps tinker-cookbook==0.6.1 tinker==0.38.0 chz==0.4.0 httpx==0.28.1 sniffio==1.3.1 \
  distro==1.9.0 termcolor==3.3.0 blobfile==3.3.0 lxml==6.1.3
python - <<'PY'
import importlib.metadata as m
v = m.version("torch")
assert v.startswith("2.13.0"), f"installing the libraries changed torch to {v}; klbench pins torch==2.13.0"
print(f"libraries installed; torch still {v}")
PY
