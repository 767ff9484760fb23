"""reward=answer (klbench/rewards/answer.py): extraction, normalisation, reference answers from jsonl and HF
datasets, bad rows, and a run that logs val/accuracy and train/no_answer."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from klbench.config.schema import ConfigError, validate
from klbench.rewards.answer import AnswerReward, extract_answer, same_answer
from klbench.data.prompts import load_answers
from test_config import compose_cfg
from test_schema import jsonl


@pytest.mark.parametrize("text,extract,pattern,want", [
    ("so 3 + 4 = 7", "last_number", None, "7"),
    ("owes -1,234.50 dollars.", "last_number", None, "-1,234.50"),
    ("no digits here", "last_number", None, None),
    ("Natalia sold 48 clips ... 48+24 = 72\n#### 72", "gsm8k", None, "72"),
    ("#### 1,000 then 5", "gsm8k", None, "1,000"),
    ("the answer is 5", "gsm8k", None, None),
    (r"thus \boxed{\frac{1}{2}} and \boxed{12}", "boxed", None, "12"),
    (r"\boxed{\frac{1}{2}}", "boxed", None, r"\frac{1}{2}"),
    (r"\boxed{12", "boxed", None, None),
    ("Answer: B. Answer: C", "regex", r"Answer: ([A-D])", "C"),
    ("x=4;", "regex", r"=\d", "=4"),
])
def test_extract(text, extract, pattern, want):
    assert extract_answer(text, extract, pattern) == want


@pytest.mark.parametrize("a,b,equal", [
    ("1,234.0", "1234", True), ("+5", "5", True), ("\u22123", "-3", True), ("$12.", "12", True),
    ("-0", "0", True), ("0.50", ".5", True), ("1,234", "1234.01", False), ("12", "21", False),
    (r"\frac{1}{2}", r"\frac{1}{2}", True), ("1,2", "12", False),
])
def test_same_answer(a, b, equal):
    assert same_answer(a, b) is equal


def _ro(prompts, texts):
    return SimpleNamespace(prompts=prompts, texts=texts)


def test_reward_scores_match_and_counts_no_answer():
    r = AnswerReward({"p": "1234", "q": "7"}, format_reward=0.1)
    ro = _ro(["p", "p", "q", "q"], ["it is 1,234.0", "it is 1233", "none", "7"])
    j = r.judge(ro)
    assert j["accuracy"].tolist() == [1, 0, 0, 1] and j["no_answer"].tolist() == [0, 0, 1, 0]
    assert [round(x, 6) for x in r(ro).tolist()] == [1.1, 0.1, 0.0, 1.1]
    with pytest.raises(KeyError, match="no reference answer for the prompt 'other'"):
        r(_ro(["other"], ["1"]))


# ---- reference answers from datasets ----

def _ds(**kw):
    """A `dataset` config with every key the loaders read (the composed config has them all)."""
    return OmegaConf.create({"chat_template": False, "system_prompt": None, **kw})


def test_jsonl_answers_and_a_row_without_the_field(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [{"q": "1+1=", "a": 2}, {"q": "2+5=", "a": "#### 7"}])
    val = jsonl(tmp_path / "val.jsonl", [{"q": "3+3=", "a": "6"}])
    cfg = _ds(source="jsonl", train_path=train, val_path=val, field="q", answer_field="a")
    assert load_answers(cfg) == {"1+1=": "2", "2+5=": "7", "3+3=": "6"}
    bad = jsonl(tmp_path / "bad.jsonl", [{"q": "1+1=", "a": 2}, {"q": "2+2="}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 has no field 'a' \(dataset.answer_field\)"):
        load_answers(_ds(source="jsonl", train_path=bad, val_path=val, field="q", answer_field="a"))


def test_hf_gsm8k_shaped_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = lambda k: {"question": [f"Q{k}{i}: what is {i} + {i}?" for i in range(3)],  # noqa: E731
                      "answer": [f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i:,}" for i in range(3)]}
    path = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows("t")),
                          "test": datasets.Dataset.from_dict(rows("v"))}).save_to_disk(str(path))
    cfg = _ds(source="hf", name=str(path), train_split="train", val_split="test", field="question",
              prompt_words=50, max_train=10, max_val=10, answer_field="answer")
    answers = load_answers(cfg)
    assert answers["Qt2: what is 2 + 2?"] == "4" and len(answers) == 6
    r = AnswerReward(answers, "gsm8k")
    assert r(_ro(["Qv1: what is 1 + 1?"] * 2, ["1+1=2 #### 2", "#### 3"])).tolist() == [1.0, 0.0]
    bad = {"question": ["a", "b"], "answer": ["#### 1", None]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(bad), "test": datasets.Dataset.from_dict(bad)}) \
        .save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"split 'train'\) row 1 has no value in field 'answer'"):
        load_answers(OmegaConf.merge(cfg, {"name": str(tmp_path / "bad")}))


@pytest.mark.parametrize("extra,match", [
    ([], "reward=answer needs dataset.answer_field"),
    (["dataset.answer_field=a", "reward.extract=regex"], "reward.pattern is read by reward.extract=regex only"),
    (["dataset.answer_field=a", "reward.pattern=x"], "reward.pattern is read by reward.extract=regex only"),
    (["dataset.answer_field=a", "reward.extract=regex", "reward.pattern='(a'"], "reward.pattern"),
    (["dataset.answer_field=a", "reward=vader"], "dataset.answer_field=a is read by reward=answer only"),
    (["dataset.answer_field=missing"], r"train\.jsonl:1 has no field 'missing' \(dataset.answer_field\)"),
])
def test_bad_answer_config(tmp_path, extra, match):
    train = jsonl(tmp_path / "train.jsonl", [{"q": f"{i}+1=", "a": i + 1} for i in range(8)])
    val = jsonl(tmp_path / "val.jsonl", [{"q": "9+1=", "a": 10}])
    over = ["reward=answer", "dataset=jsonl", f"dataset.train_path={train}", f"dataset.val_path={val}",
            "dataset.field=q"]
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(tmp_path, over + extra))


def test_embedded_dataset_has_no_answers(tmp_path):
    with pytest.raises(ConfigError, match="dataset=embedded .* has none"):
        validate(compose_cfg(tmp_path, ["reward=answer"]))


# ---- a run ----

def test_run_logs_accuracy_and_no_answer(tmp_path, tiny_lm_dir):
    import mlflow
    from klbench.tasks.train import run_task
    # reference "e" for every prompt, answer = the response's last letter e..z: the tiny random LM gets some
    # right, some wrong, and some with no such letter at all
    prompts = [f"the film was {w}" for w in ("good", "bad", "long", "odd", "fine", "dull", "great", "slow")]
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": p, "ans": "e"} for p in prompts])
    val = jsonl(tmp_path / "val.jsonl", [{"prompt": p, "ans": "e"} for p in prompts[:4]])
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}", "task.max_steps=2",
                                 "task.val_every=2", "task.prompts_per_step=4", "task.val_prompts=4",
                                 "task.val_samples=4", "task.n_sample_texts=16", "task.max_new_tokens=8",
                                 "task.log_every=1", "task.advantage=grpo", "reward=answer",
                                 "reward.extract=regex", "reward.pattern='[e-z]'", "dataset=jsonl",
                                 f"dataset.train_path={train}", f"dataset.val_path={val}",
                                 "dataset.answer_field=ans"])
    out = run_task(cfg)
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    (r,) = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment).experiment_id])
    for key in ("val/accuracy", "val/no_answer", "train/accuracy", "train/no_answer"):
        assert key in r.data.metrics, key
    # every validation row is in the sample table: recompute the accuracy from the responses themselves
    mlflow.set_tracking_uri(client.tracking_uri)
    table = client.load_table(r.info.experiment_id, "samples.json", run_ids=[r.info.run_id])
    last = table[table["step"] == 2]
    assert len(last) == 16
    right = [extract_answer(t, "regex", "[e-z]") == "e" for t in last["response"]]
    assert math.isclose(out["val/accuracy"], sum(right) / 16)
    assert math.isclose(out["val/reward"], out["val/accuracy"])  # no format reward
    none = [extract_answer(t, "regex", "[e-z]") is None for t in last["response"]]
    assert math.isclose(out["val/no_answer"], sum(none) / 16)
    assert 0 < out["val/accuracy"] < 1 or 0 < out["val/no_answer"]  # the check above saw both outcomes


def test_dataset_row_without_answer_at_run_start_names_file_row_field(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": f"p{i}", "ans": "1"} for i in range(7)] + [{"prompt": "x"}])
    val = jsonl(tmp_path / "val.jsonl", [{"prompt": "v", "ans": 1}])
    cfg = compose_cfg(tmp_path, ["reward=answer", "dataset=jsonl", f"dataset.train_path={train}",
                                 f"dataset.val_path={val}", "dataset.answer_field=ans"])
    with pytest.raises(ConfigError, match=r"train\.jsonl:8 has no field 'ans' \(dataset.answer_field\)"):
        validate(cfg)
    json.loads(open(train).readline())  # the file itself is fine JSON
