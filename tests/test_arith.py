"""experiment=arith's corpus (klbench/models/embedded/arith.py): worked answers add up, slips are wrong, the
validation problems never reach pretraining or the training prompts, answers come from the prompts."""
from __future__ import annotations

import random

import pytest

from klbench.rewards.answer import extract_answer, same_answer
from klbench.models.embedded.arith import (PROMPT, ArithAnswers, _is_val, arith_answer, arith_prompts,
                                           generate_arith, worked_answer)


def test_worked_answers_by_hand():
    assert worked_answer(47, "+", 85) == " 7+5=12, 4+8+1=13, =132"
    assert worked_answer(98, "+", 459) == " 8+9=17, 9+5+1=15, 0+4+1=5, =557"
    assert worked_answer(900, "-", 502) == " 10-2=8, 9-0=9, 8-5=3, =398"
    assert worked_answer(47, "-", 85) == " 85-47: 15-7=8, 7-4=3, =-38"
    assert worked_answer(47, "+", 85, slip_at=1, slip=-1) == " 7+5=12, 4+8+1=12, =122"


def test_every_worked_answer_is_right_and_every_slip_wrong():
    rng = random.Random(0)
    for _ in range(3000):
        a, b, op = rng.randrange(10, 1000), rng.randrange(10, 1000), rng.choice("+-")
        truth = arith_answer(f"{a}{op}{b}=")
        assert truth == str(a + b if op == "+" else a - b)
        assert same_answer(extract_answer(worked_answer(a, op, b)), truth)
        col = rng.randrange(len(str(max(a, b))))
        assert not same_answer(extract_answer(worked_answer(a, op, b, col, rng.choice((-1, 1)))), truth)


def test_noise_fraction_and_held_out_problems():
    texts = generate_arith(4000, seed=1, noise_fraction=0.3, digits=3)
    prompts = [t.split(" ", 1)[0] for t in texts]
    wrong = sum(not same_answer(extract_answer(t.split("=", 1)[1]), arith_answer(p)) for t, p in zip(texts, prompts))
    assert 0.26 < wrong / len(texts) < 0.34  # binomial sd 0.007 around 0.3
    val = arith_prompts("val", 500)
    train = set(prompts) | set(arith_prompts("train", 5000))
    assert not train & set(val) and len(set(val)) > 400
    assert all(_is_val(int(m[1]), m[2], int(m[3])) for m in map(PROMPT.match, val))


def test_arith_answers_mapping():
    answers = ArithAnswers()
    assert answers["12-40="] == "-28" and "12+3=" in answers and "hello" not in answers
    with pytest.raises(KeyError, match="not an arithmetic prompt"):
        answers["12*3="]


def test_experiment_arith_runs_and_logs_accuracy(tmp_path):
    """experiment=arith end to end on a briefly pretrained arith LM (the preset's corpus and model shape, 40
    steps): the run builds it, trains with grpo and reward=answer, and logs val/accuracy as the sweep's
    objective. How far the real preset gets: docs/rlvr.md."""
    from klbench.tasks.train import run_task
    from test_config import compose_cfg
    cfg = compose_cfg(tmp_path, ["experiment=arith", "model.spec.steps=40", "model.spec.corpus_size=3000",
                                 "task.max_steps=2", "task.val_every=2", "task.prompts_per_step=2",
                                 "task.n_samples=2", "task.val_prompts=4", "task.val_samples=2", "logger=csv"])
    assert list(cfg.optimized_metrics) == ["val/accuracy", "val/seq_kl"]
    out = run_task(cfg)
    assert 0 <= out["val/accuracy"] <= 1 and 0 <= out["val/no_answer"] <= 1 and out["val/seq_kl"] >= 0
    assert out["val/reward"] == out["val/accuracy"]  # no format reward
