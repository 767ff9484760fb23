"""Instruct models: chat templates (dataset.chat_template, dataset.system_prompt, messages-shaped prompts, one BOS)
and the loading options model.trust_remote_code and model.attn_implementation, each error naming a setting."""
from __future__ import annotations

import json

import pytest
import torch

from klbench.config.errors import ConfigError
from klbench.data.prompts import load_prompts
from klbench.models.policies import build_policy
from klbench.tasks.train import build_data, check_config
from test_config import compose_cfg

SYSTEM = "Write a short review."


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat_cfg(tmp_path, model_dir, rows, *more):
    train = _jsonl(tmp_path / "train.jsonl", rows)
    return compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={model_dir}", "dataset=jsonl",
                                  f"dataset.train_path={train}", f"dataset.val_path={train}", "dataset.field=prompt",
                                  "task.prompts_per_step=2", "task.max_new_tokens=8", *more])


ROWS = [{"prompt": "The movie was"},
        {"prompt": [{"role": "user", "content": "Was the plot good?"}]},
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Rate the film"}]}]


def test_chat_template_renders_each_prompt_with_one_bos(tmp_path, tiny_arch):
    """Texts and messages alike, with the system prompt; the rollout's prompts begin with exactly one BOS (the
    template's), where tokenizing the rendered text as plain prompts are tokenized would give two."""
    cfg = _chat_cfg(tmp_path, tiny_arch("llama")[0], ROWS, "dataset.chat_template=true",
                    f"dataset.system_prompt={SYSTEM!r}")
    check_config(cfg)
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    train, val = load_prompts(cfg.dataset, policy)
    assert train == val and len(train) == 3
    turn = "<|im_start|>{}\n{}<|im_end|>\n"
    system = turn.format("system", SYSTEM)
    assert train[0] == "<s>" + system + turn.format("user", "The movie was") + "<|im_start|>assistant\n"
    assert train[2] == ("<s>" + system + turn.format("user", "Hi") + turn.format("assistant", "Hello.")
                        + turn.format("user", "Rate the film") + "<|im_start|>assistant\n")
    tok, bos = policy.tok, policy.tok.bos_token_id
    assert tok(train[0]).input_ids[:2] == [bos, bos]  # what tokenizing with special tokens did: BOS doubled
    torch.manual_seed(0)
    ro = policy.rollout(train, 2)
    prompts = ro.tokens[:, :ro.prompt_len]  # [6, P] left-padded
    real = ro.attention[:, :ro.prompt_len].bool()
    assert ((prompts == bos) & real).sum(1).tolist() == [1] * 6
    first = real.int().argmax(1)  # each row's first real token
    assert (prompts.gather(1, first[:, None]) == bos).all()
    assert policy.reference().add_special_tokens is False  # the probe's pi_ref rollouts tokenize alike
    data = build_data(cfg, policy.fixed_prompt, policy)  # the run's path: checked against the context too
    assert data.train == train


def test_messages_need_the_chat_template(tmp_path, tiny_arch):
    cfg = _chat_cfg(tmp_path, tiny_arch("llama")[0], ROWS)
    with pytest.raises(ConfigError, match=r"^dataset\.train_path: .*train\.jsonl:2 field 'prompt' is a list "
                                          r"\(messages\?\).*set dataset\.chat_template=true$"):
        check_config(cfg)


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": []}], "is an empty list of messages"),
    ([{"prompt": [{"role": "user"}]}], r"message 0 is not a \{'role': str, 'content': str\} dict"),
    ([{"prompt": 3}], "is not a string or a list of messages: 3"),
])
def test_malformed_messages_are_named(tmp_path, tiny_arch, rows, message):
    cfg = _chat_cfg(tmp_path, tiny_arch("llama")[0], rows * 2, "dataset.chat_template=true")
    with pytest.raises(ConfigError, match=r"^dataset\.train_path: .*train\.jsonl:1 field 'prompt' " + message):
        check_config(cfg)


def test_a_tokenizer_without_a_template_is_refused(tmp_path, tiny_lm_dir):
    cfg = _chat_cfg(tmp_path, tiny_lm_dir, ROWS[:1] * 2, "dataset.chat_template=true")
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    with pytest.raises(ConfigError, match=r"^dataset\.chat_template=true, but the tokenizer \(.*\) has no chat "
                                          r"template: .*set dataset\.chat_template=false for plain prompts$"):
        load_prompts(cfg.dataset, policy)


def test_a_second_system_message_is_refused(tmp_path, tiny_arch):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}] * 2
    cfg = _chat_cfg(tmp_path, tiny_arch("llama")[0], rows, "dataset.chat_template=true",
                    f"dataset.system_prompt={SYSTEM!r}")
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    with pytest.raises(ConfigError, match=r"prompt #1 has its own system message and dataset\.system_prompt is set"):
        load_prompts(cfg.dataset, policy)


@pytest.mark.parametrize("overrides,message", [
    (["dataset.system_prompt=Hi"], r"^dataset\.system_prompt is set, but dataset\.chat_template=false: .* set "
                                   r"dataset\.chat_template=true$"),
    (["experiment=tabular", "dataset.chat_template=true"], r"^dataset\.chat_template=true does nothing with "
                                                           r"model=tabular"),
    (["dataset.chat_template=yes please"], r"dataset\.chat_template"),
])
def test_chat_options_are_checked_before_anything_loads(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(compose_cfg(tmp_path, overrides))


# ---- loading options ----

CUSTOM_CONFIG = '''from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
'''
CUSTOM_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_tiny_custom import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
'''


@pytest.fixture
def remote_code_dir(tiny_arch, tmp_path, monkeypatch):
    """tiny_arch's Llama saved as a folder with its own modelling code (auto_map), as remote-code models ship."""
    import shutil

    import transformers.dynamic_module_utils as dyn
    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # never the user's HF cache
    path = tmp_path / "custom"
    shutil.copytree(tiny_arch("llama")[0], path)
    (path / "configuration_tiny_custom.py").write_text(CUSTOM_CONFIG)
    (path / "modeling_tiny_custom.py").write_text(CUSTOM_MODEL)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="tiny_custom", architectures=["TinyCustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
                            "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_remote_code_needs_trust_remote_code(tmp_path, remote_code_dir):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={remote_code_dir}"])
    check_config(cfg)
    with pytest.raises(ConfigError, match=r"^model\.trust_remote_code=false, but .*custom.* ships its own Python "
                                          r"code .*: set model\.trust_remote_code=true to run that code"):
        build_policy(cfg.model, 8)
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={remote_code_dir}", "model.trust_remote_code=true"])
    policy = build_policy(cfg.model, 8)
    assert type(policy.model).__name__ == type(policy.ref).__name__ == "TinyCustomForCausalLM"


def test_a_teacher_with_remote_code_names_the_teacher_setting(tmp_path, remote_code_dir, tiny_arch):
    cfg = compose_cfg(tmp_path, ["task=distill", "reward=none", "estimator.beta=1.0", "model=hf",
                                 f"model.name_or_path={tiny_arch('llama')[0]}", "model@teacher=hf",
                                 f"teacher.name_or_path={remote_code_dir}"])
    with pytest.raises(ConfigError, match=r"^teacher\.trust_remote_code=false, .*set teacher\.trust_remote_code=true"):
        build_policy(cfg.model, 8, teacher=cfg.teacher)


def test_attn_implementation_is_the_models(tmp_path, tiny_arch):
    for impl in ("eager", "sdpa"):
        cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_arch('llama')[0]}",
                                     f"model.attn_implementation={impl}"])
        check_config(cfg)
        policy = build_policy(cfg.model, 8)
        assert policy.model.config._attn_implementation == policy.ref.config._attn_implementation == impl


def test_a_bad_attn_implementation_is_named(tmp_path, tiny_arch):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_arch('llama')[0]}",
                                 "model.attn_implementation=fast"])
    with pytest.raises(ConfigError, match=r"^model\.attn_implementation"):
        check_config(cfg)
    # a known name the machine cannot run (the flash-attn package is not installed in the test venv): its setting
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_arch('llama')[0]}",
                                 "model.attn_implementation=flash_attention_2"])
    check_config(cfg)
    valid = r"\(valid: null, eager, sdpa, flex_attention, flash_attention_2, flash_attention_3\)$"
    with pytest.raises(ConfigError, match=r"^model\.attn_implementation=flash_attention_2 cannot load .*" + valid):
        build_policy(cfg.model, 8)


def test_bf16_with_sdpa_says_the_log_probs_differ(tiny_arch, caplog):
    """One line naming the setting that makes the sampler's and the scorer's log-probs agree; none in eager or
    in float32 (the measured gap: tests/test_architectures.py, docs/instruct.md)."""
    import logging

    from klbench.models.hf import load_causal_lm
    path = tiny_arch("llama")[0]
    with caplog.at_level(logging.WARNING, logger="klbench.models.hf"):
        load_causal_lm(path, "bfloat16", setting="teacher")
        assert [r.getMessage() for r in caplog.records] == [
            "teacher.dtype=bfloat16 with sdpa attention: the sampler's and the scorer's log-probs of a token differ "
            "(up to 0.14 nats on tiny models, docs/instruct.md); teacher.attn_implementation=eager makes them agree"]
        caplog.clear()
        load_causal_lm(path, "bfloat16", attn_implementation="eager")
        load_causal_lm(path, "float32")
        assert not caplog.records


def test_an_hf_dataset_of_messages(tmp_path, tiny_arch):
    """A save_to_disk folder whose column holds conversations: rendered whole; dataset.prompt_words (which cuts
    texts) must be null for it."""
    datasets = pytest.importorskip("datasets")
    rows = [[{"role": "user", "content": f"Review film {i}"}] for i in range(4)]
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"messages": rows}) for s in ("train", "test")}) \
        .save_to_disk(tmp_path / "chat")
    base = ["model=hf", f"model.name_or_path={tiny_arch('llama')[0]}", "dataset=hf", f"dataset.name={tmp_path}/chat",
            "dataset.field=messages", "dataset.chat_template=true"]
    cfg = compose_cfg(tmp_path, [*base, "dataset.prompt_words=null"])
    check_config(cfg)
    policy = build_policy(cfg.model, 8)
    train, _ = load_prompts(cfg.dataset, policy)
    assert sorted(train) == sorted(f"<s><|im_start|>user\nReview film {i}<|im_end|>\n<|im_start|>assistant\n"
                                   for i in range(4))
    cfg = compose_cfg(tmp_path, base)  # prompt_words=8 from conf/dataset/hf.yaml
    with pytest.raises(ConfigError, match=r"^dataset\.prompt_words=8 cuts text prompts, but dataset\.field=messages "
                                          r"holds messages: set dataset\.prompt_words=null$"):
        load_prompts(cfg.dataset, policy)


def test_a_chat_folder_ends_responses_at_each_listed_stop_id(tmp_path, tiny_arch):
    """The issue's instruct folder: a chat template and a generation_config listing two stop ids (</s> and
    <|im_end|>). On templated prompts (one BOS each), responses end at either id, the mask covers the response
    up to and including it, and pads follow."""
    cfg = _chat_cfg(tmp_path, tiny_arch("llama")[0], ROWS, "dataset.chat_template=true", "task.max_new_tokens=40")
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    tok = policy.tok
    stops = [tok.convert_tokens_to_ids("</s>"), tok.convert_tokens_to_ids("<|im_end|>")]
    assert list(policy.eos_ids) == stops
    train, _ = load_prompts(cfg.dataset, policy)
    ended = set()
    for seed in range(10):
        torch.manual_seed(seed)
        ro = policy.rollout(train, 8)
        resp = ro.tokens[:, ro.prompt_len:]  # [24, L]
        for row, keep in zip(resp, ro.mask):
            hits = [t for t, tok_id in enumerate(row.tolist()) if tok_id in stops]
            if not hits:
                assert keep.all()
                continue
            first = hits[0]
            ended.add(int(row[first]))
            assert keep[:first + 1].all() and not keep[first + 1:].any()
            assert (row[first + 1:] == tok.pad_token_id).all()
        if ended == set(stops):
            break
    assert ended == set(stops), ended


def test_a_missing_or_unreadable_model_names_its_setting(tmp_path, tiny_arch):
    """One line naming the key the path came from: model.name_or_path, model.ref_name_or_path, teacher.name_or_path
    (a missing folder, an uncached hub id under HF_HUB_OFFLINE=1, a folder that holds no model)."""
    good = tiny_arch("llama")[0]
    (tmp_path / "empty").mkdir()
    cases = [(["model.name_or_path=/nonexistent/x"], r"^model\.name_or_path: local path '/nonexistent/x' does not"),
             (["model.name_or_path=nobody-here/no-model"], r"^model\.name_or_path \(tokenizer\): 'nobody-here/no-model' "
                                                          r"not in the local Hugging Face cache and HF_HUB_OFFLINE=1"),
             ([f"model.name_or_path={good}", f"model.ref_name_or_path={tmp_path}/empty"],
              rf"^model\.ref_name_or_path: the folder {tmp_path}/empty is empty: no config\.json; ")]
    for overrides, message in cases:
        cfg = compose_cfg(tmp_path, ["model=hf", *overrides])
        with pytest.raises(ConfigError, match=message) as e:
            build_policy(cfg.model, 8)
        assert "\n" not in str(e.value)
    cfg = compose_cfg(tmp_path, ["task=distill", "reward=none", "estimator.beta=1.0", "model=hf",
                                 f"model.name_or_path={good}", "model@teacher=hf", "teacher.name_or_path=/nonexistent/t"])
    with pytest.raises(ConfigError, match=r"^teacher\.name_or_path: local path '/nonexistent/t' does not exist; "
                                        r"give a folder written by save_pretrained or a hub id \(owner/name\)$"):
        build_policy(cfg.model, 8, teacher=cfg.teacher)
