"""scripts/bench_rollout.py runs end to end on a tiny GPT-2 folder: its two samplers draw the same tokens
(the script stops otherwise), it prints every variant's median and ratio, the floor and the bare job."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_rollout_runs_and_its_samplers_agree(tiny_lm_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_rollout.py"), "--model", tiny_lm_dir,
                           "--rounds", "1", "--threads", "1", "--steps", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^  (.+?)\s+([\d.]+) (ms|us)\s+([\d.]+)x$", proc.stdout, re.M)
    assert [r[0].split(" (")[0].split(",")[0] for r in rows] == [
        "generate()", "kv_cache_sample", "Tensor.exponential_()", "exp_noise",
        "estimator=loo", "estimator=rb"]
    assert all(float(r[1]) > 0 for r in rows)
    # the floor, and the bare job (the same steps and both validations as a whole process of its own)
    seconds = dict(re.findall(r"^(floor|bare)_seconds ([\d.]+)$", proc.stdout, re.M))
    assert set(seconds) == {"floor", "bare"} and all(float(v) > 0 for v in seconds.values()), proc.stdout[-1500:]
    assert re.search(r"the two validations: [\d.]+ s\): [\d.]+ s, [\d.]+x the floor", proc.stdout)
