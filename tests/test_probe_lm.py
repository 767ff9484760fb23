"""`klbench task=probe` on language models, end to end through the CLI: the embedded LM (the default run's pair,
pi = pi_ref at step 0) and the embedded distillation pair (student against teacher). Every gradient estimator takes
its gradient of one scored batch's graph (the probe's retained graph), the top-k ones through the logits path: a
backward that gave up the reference's logits to the first gradient broke the second (issue 54, part 0)."""
from __future__ import annotations

import csv
import os

import cli_inprocess
import pytest

# the probe's smallest useful size: 2 prompts x 4 samples, 2 replicates, a few ref batches, short responses
SMALL = ["task=probe", "task.prompts=2", "task.samples=4", "task.grad_samples=4", "task.replicates=2",
         "task.ref_batches=1", "task.ref_samples=4", "task.bootstrap=10", "task.max_new_tokens=8", "logger=csv"]
# the distillation pair's presets, pretrained briefly: the probe's arithmetic is what is under test, not the pair's KL
BRIEF_PAIR = ["experiment=distill", "model.spec.steps=30", "teacher.spec.steps=30"]


@pytest.mark.parametrize("pair", [[], BRIEF_PAIR], ids=["embedded", "distill_pair"])
def test_probe_runs_on_lm_pairs(tmp_path, pair):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = cli_inprocess.run(pair + SMALL + [f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grads = {r["estimator"]: r for r in csv.DictReader(open(tmp_path / "run" / "probe_gradients.csv"))}
    # every gradient estimator was measured, the top-k ones (the logits path) and rb among them, none skipped
    assert {"naive_mc", "naive_cv_seq", "rb", "loo", "topk_tail", "topk_trunc", "vopd"} <= set(grads), sorted(grads)
    values = {r["estimator"] for r in csv.DictReader(open(tmp_path / "run" / "probe_values.csv"))}
    assert {"mc", "k3", "rb"} <= values
