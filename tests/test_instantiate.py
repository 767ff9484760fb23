"""Every option of every config group instantiates: the object that option selects is actually built."""
from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from klbench.models.policies import LMPolicy, Rollout, TabularPolicy, build_policy
from klbench.rewards.reward import build_reward
from klbench.tasks import TASKS, TRAINING, build_task, runner
from klbench.tasks.train import build_data, build_trainer, check_config
from klbench.record.tracking import build_logger
from test_config import GROUPS, compose_cfg

# a spec that pretrains in seconds: only the plumbing of model=embedded is under test here
TINY_SPEC = ["model.spec.corpus_size=200", "model.spec.n_embd=16", "model.spec.n_layer=1", "model.spec.n_head=2",
             "model.spec.steps=3", "model.spec.batch_size=8", "model.spec.max_len=32"]


@pytest.fixture(scope="module")
def tiny_classifier_dir(tmp_path_factory, tiny_lm_dir):
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertForSequenceClassification
    path = tmp_path_factory.mktemp("clf")
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    cfg = DistilBertConfig(vocab_size=len(tok), dim=16, hidden_dim=32, n_layers=1, n_heads=2, max_position_embeddings=64,
                           pad_token_id=tok.pad_token_id, id2label={0: "NEGATIVE", 1: "POSITIVE"},
                           label2id={"NEGATIVE": 0, "POSITIVE": 1})
    DistilBertForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def model_overrides(option, tiny_lm_dir):
    return {"tabular": ["experiment=tabular"], "embedded": ["model=embedded", *TINY_SPEC],
            "hf": ["model=hf", f"model.name_or_path={tiny_lm_dir}"]}[option]


@pytest.mark.parametrize("option", GROUPS["model"])
def test_model_options_build(tmp_path, option, tiny_lm_dir):
    cfg = compose_cfg(tmp_path, model_overrides(option, tiny_lm_dir))
    check_config(cfg)
    policy = build_policy(cfg.model, 4, cfg.paths.cache)
    assert isinstance(policy, TabularPolicy if option == "tabular" else LMPolicy)
    ro = policy.rollout(["The movie", "I watched"], 2)
    batch = policy.score(ro)
    assert batch.logp.shape == batch.mask.shape and batch.mask[:, 0].all()
    # the reference is the policy's starting point: the exact per-position KL is zero before training
    assert batch.kappa.abs().max() < 1e-5


@pytest.mark.parametrize("option", GROUPS["dataset"])
def test_dataset_options_build(tmp_path, option):
    over = [f"dataset={option}"]
    if option == "jsonl":
        for split, n in (("train", 12), ("val", 3)):
            (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(n)))
        over += [f"dataset.train_path={tmp_path}/train.jsonl", f"dataset.val_path={tmp_path}/val.jsonl"]
    if option == "hf":
        import datasets
        d = datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": [f"a {s} review number {i} is here ok"
                                                                         for i in range(20)]}) for s in ("train", "test")})
        d.save_to_disk(str(tmp_path / "ds"))
        over += [f"dataset.name={tmp_path}/ds", "dataset.prompt_words=3"]
    cfg = compose_cfg(tmp_path, over)
    data = build_data(cfg)
    batch = next(iter(data.train_dataloader()))
    assert len(batch) == cfg.task.prompts_per_step and all(isinstance(p, str) and p for p in batch)
    assert len(data.val) > 0
    if option == "hf":
        assert all(len(p.split()) == 3 for p in batch)


@pytest.mark.parametrize("option", GROUPS["reward"])
def test_reward_options_build(tmp_path, option, tiny_classifier_dir):
    over = {"tabular": ["experiment=tabular"], "none": ["reward=none"], "vader": ["reward=vader"],
            "hf_classifier": ["reward=hf_classifier", f"reward.name_or_path={tiny_classifier_dir}"],
            "answer": ["reward=answer", "dataset=jsonl", f"dataset.train_path={tmp_path}/train.jsonl",
                       f"dataset.val_path={tmp_path}/val.jsonl", "dataset.answer_field=answer"]}[option]
    texts = ["a wonderful film", "an awful film", "a film"]
    prompts = ["p"] * 3
    if option == "answer":  # prompts with reference answers; the texts answer the first right, the second wrong
        for split in ("train", "val"):
            (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": i + 1})
                                                             + "\n" for i in range(3)))
        texts, prompts = ["1", "so it is 5", "no idea"], ["0 + 1 =", "1 + 1 =", "2 + 1 ="]
    cfg = compose_cfg(tmp_path, over)
    policy = TabularPolicy.__new__(TabularPolicy)
    if option == "tabular":
        policy = build_policy(cfg.model, 4, cfg.paths.cache)
    reward = build_reward(cfg.reward, policy, cfg.dataset)
    if option == "none":
        assert reward is None
        return
    if option == "tabular":
        ro = policy.rollout([policy.fixed_prompt], 3)
    else:
        ro = Rollout(torch.zeros(3, 1), torch.ones(3, 1), 0, torch.ones(3, 1, dtype=torch.bool), torch.arange(3),
                     texts, prompts)
    r = reward(ro)
    assert r.shape == (3,) and torch.isfinite(r).all()
    if option == "vader":
        assert r[0] > 0 > r[1]
    if option == "answer":
        assert r.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("option", GROUPS["hardware"])
def test_hardware_options_build_a_trainer(tmp_path, option):
    if option == "gpu" and not torch.cuda.is_available():
        pytest.skip("no GPU here (the no-GPU error is tested in test_rl)")
    cfg = compose_cfg(tmp_path, [f"hardware={option}", "experiment=tabular"])
    trainer = build_trainer(cfg, False, 10, 5)
    assert isinstance(trainer, pl.Trainer)
    assert str(trainer.precision) == cfg.hardware.precision.split("-")[0] + ("-mixed" if "mixed" in
                                                                              cfg.hardware.precision else "-true")


@pytest.mark.parametrize("option", GROUPS["logger"])
def test_logger_options_build(tmp_path, option):
    cfg = compose_cfg(tmp_path, [f"logger={option}", "experiment=tabular"])
    logger = build_logger(cfg)
    kind = {"mlflow": "RecordLogger", "csv": "CSVLogger", "none": "bool"}[option]
    assert type(logger).__name__ == kind


@pytest.mark.parametrize("option", GROUPS["task"])
def test_task_options_build(tmp_path, option):
    over = {"rl": ["experiment=tabular"], "distill": ["experiment=distill_tabular"],
            "pretrain": ["task=pretrain", *TINY_SPEC],
            "probe": ["task=probe", "model=tabular", "reward=tabular", "logger=none", "task.prompts=2",
                      "task.samples=4", "task.grad_samples=2", "task.replicates=4", "task.bootstrap=20"]}[option]
    cfg = compose_cfg(tmp_path, over)
    check_config(cfg)
    if option == "probe":  # measures, trains nothing: its runner is the whole task
        assert runner(option)(cfg)["kl_reference"] == 0  # the untrained policy is its reference
        return
    if option == "pretrain":
        metrics = runner(option)(cfg)
        assert metrics["steps"] == 3 and metrics["heldout_loss"] > 0
        return
    policy = build_policy(cfg.model, 4, cfg.paths.cache, cfg.get("teacher"))
    module = build_task(cfg, policy, build_reward(cfg.reward, policy))
    assert module.beta == cfg.estimator.beta and module.estimator.name == cfg.estimator.name


def test_every_task_is_found_through_one_registry():
    """Each option of the `task` group has its runner in klbench.tasks.TASKS, a function that imports; a name
    outside it is refused with the valid ones, read from the registry; the training tasks build a module."""
    assert set(TASKS) == set(GROUPS["task"])
    for name in TASKS:
        assert callable(runner(name)), name
    with pytest.raises(ValueError, match="task.name='nope' is unknown; valid: " + ", ".join(TASKS)):
        runner("nope")
    # the runners import their task's module in their body: importing the registry imports none of them
    from test_imports import import_graph
    assert not {m for m in import_graph(include_functions=False)["klbench.tasks"] if m.startswith("klbench.tasks.")}
    assert set(TRAINING) < set(TASKS)
