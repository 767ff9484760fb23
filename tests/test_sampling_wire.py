"""Sampling as users sample (issue 29): the rollout engine draws pi_s (temperature, top-k, top-p) as generate()
does, every id of a stop-id list ends a response, LMPolicy scores the KL target, the config refuses what no
estimator can serve, a model's generation_config is honoured or named, and a run says which KL it targets."""
from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlflow
import pytest
import torch

from klbench.config.errors import ConfigError
from klbench.config.schema import validate
from klbench.estimators.sampling import KL_TARGETS, Sampling, target_batch, token_logprob
from klbench.models.hf import load_causal_lm
from klbench.models.policies import LMPolicy, build_policy, response_mask
from klbench.models.rollout import generate_sample, kv_cache_sample, position_ids_from_mask
from test_config import compose_cfg

PROMPTS = ["The movie", "I did not like it", "A"]
# T < 1 sharpens, T > 1 flattens; top-k and top-p cut; together as instruct models ship them
SAMPLINGS = {"T0.7-p0.9": Sampling(0.7, 0, 0.9), "T1.5-k5": Sampling(1.5, 5, 1.0), "T0.5": Sampling(0.5),
             "T0.7-k50-p0.9": Sampling(0.7, 50, 0.9)}


@pytest.fixture(scope="module")
def llama_dir(tiny_lm_dir, tmp_path_factory):
    """A tiny random Llama on the tiny GPT-2's tokenizer (the generic decode path: no fused step)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir, local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper than a fresh init, so that the cuts keep few tokens
        model.lm_head.weight.mul_(20.0)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _batch(tok, n=4):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    return enc.input_ids.repeat_interleave(n, 0), enc.attention_mask.repeat_interleave(n, 0)  # [B, P]


def _two_stops(model, tok, ids, attn, sampling, seed, new=20):
    """Two token ids that rows of this draw emit (a stop-id list of them ends some rows on each)."""
    torch.manual_seed(seed)
    free = kv_cache_sample(model, ids, attn, new, -1, tok.pad_token_id, sampling).tokens  # [B, new]
    counts = torch.bincount(free.flatten(), minlength=len(tok))
    counts[tok.pad_token_id] = 0
    return counts.topk(2).indices.tolist()


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("which", ["tiny_lm", "llama"], ids=["gpt2", "llama"])
def test_same_tokens_as_generate_under_sampling(which, sampling, request, single_thread):
    """generate(do_sample=True, temperature, top_k, top_p, eos_token_id=[a, b]) token for token, the RNG state
    after, the stops (every listed id ends a row) and the sampler's log pi_s."""
    model, tok = load_causal_lm(request.getfixturevalue(f"{which}_dir"))
    ids, attn = _batch(tok)
    new = 20
    stops = _two_stops(model, tok, ids, attn, sampling, 0, new)
    torch.manual_seed(0)
    ref = generate_sample(model, ids, attn, new, stops, tok.pad_token_id, sampling).tokens
    after = torch.rand(4)
    torch.manual_seed(0)
    got = kv_cache_sample(model, ids, attn, new, stops, tok.pad_token_id, sampling)
    assert torch.equal(got.tokens, ref)
    assert torch.equal(torch.rand(4), after)
    mask = response_mask(got.tokens, stops)
    first = [row[m].tolist()[-1] for row, m in zip(got.tokens, mask)]
    assert {stops[0], stops[1]} <= set(first)  # rows ended on each of the two ids
    # log pi_s of each drawn token, from a plain forward over prompt + response
    full = torch.cat([ids, got.tokens], 1)
    att = torch.cat([attn, torch.ones_like(got.tokens)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=att, position_ids=position_ids_from_mask(att)).logits
    L = got.tokens.shape[1]
    expect = token_logprob(sampling.process(logits[:, -(L + 1):-1]), got.tokens)  # [B, L]
    torch.testing.assert_close(got.logp[mask], expect[mask], atol=1e-4, rtol=1e-4)


def test_truncation_draws_only_kept_tokens(tiny_lm_dir, single_thread):
    """top-k = 3: every drawn token is among the 3 most likely of its step (the sampler's own logits)."""
    model, tok = load_causal_lm(tiny_lm_dir)
    ids, attn = _batch(tok)
    s = Sampling(1.0, 3, 1.0)
    torch.manual_seed(1)
    got = kv_cache_sample(model, ids, attn, 12, -1, tok.pad_token_id, s)
    full = torch.cat([ids, got.tokens], 1)
    att = torch.ones_like(full).masked_fill(torch.cat([attn, torch.ones_like(got.tokens)], 1) == 0, 0)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=att, position_ids=position_ids_from_mask(att)).logits[:, -13:-1]
    top3 = logits.topk(3, -1).indices  # [B, L, 3]
    assert (top3 == got.tokens[..., None]).any(-1).all()


def test_response_mask_ends_at_every_stop_id():
    resp = torch.tensor([[5, 7, 9, 9], [5, 9, 7, 8], [5, 6, 6, 6]])
    assert response_mask(resp, [7, 9]).tolist() == [[True, True, False, False], [True, True, False, False],
                                                     [True, True, True, True]]
    assert response_mask(resp, 9).tolist()[0] == [True, True, True, False]


@pytest.mark.parametrize("target", list(KL_TARGETS))
def test_policy_scores_the_target(tiny_lm_dir, other_sharp_dir, target, single_thread):
    """LMPolicy.score is target_batch on the scoring pass's logits; the sampler's log pi_s agrees with the
    scorer's (train/logp_gap ~ 0 in float32 on CPU); kl_target=model carries the sampler's log-probs as old_logp."""
    sampling = Sampling(0.7) if target == "model" else Sampling(0.7, 0, 0.9)
    (model, tok), (ref, _) = load_causal_lm(tiny_lm_dir), load_causal_lm(other_sharp_dir)
    policy = LMPolicy(model, ref, tok, 12, sampling=sampling, kl_target=target)
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 4)
    batch = policy.score(ro)
    resp = ro.tokens[:, ro.prompt_len:]
    pos, att = position_ids_from_mask(ro.attention), None
    with torch.no_grad():
        logits, ref_logits = policy._logits(model, ro, pos, att), policy._logits(ref, ro, pos, att)
    expect = target_batch(logits, ref_logits, resp, ro.mask, sampling, target, behaviour_logp=ro.sampled_logp)
    torch.testing.assert_close(batch.logp.detach(), expect.logp)
    torch.testing.assert_close(batch.ref_logp, expect.ref_logp)
    slogp = policy.scored_sampler_logp(ro, batch)
    gap = (ro.sampled_logp - slogp.detach())[ro.mask].abs()
    assert gap.max() < 1e-4
    if target == "model":
        assert torch.equal(batch.old_logp[ro.mask], ro.sampled_logp[ro.mask]) and batch.is_off_policy
        torch.testing.assert_close(batch.logp, token_logprob(batch.logits, resp))  # log pi, untempered
    else:
        assert batch.old_logp is None
    if target == "sampler":
        assert slogp is batch.logp  # the target scores pi_s itself
    else:
        assert not torch.allclose(batch.logp[ro.mask], slogp[ro.mask])
    slogp.masked_fill(~ro.mask, 0).sum().backward()  # the reward term's log-prob is differentiable
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.fixture(scope="module")
def other_sharp_dir(tiny_lm_dir, tmp_path_factory):
    from tiny_lms import save_sharpened_variant
    return save_sharpened_variant(tiny_lm_dir, tmp_path_factory.mktemp("sharp"), 32, 1, 7, 4.0)


# ---- config: one line naming the field ----

@pytest.mark.parametrize("override,words", [
    ("task.temperature=0", ["task.temperature", "greedy", "point mass"]),
    ("task.temperature=-1", ["task.temperature", "> 0"]),
    ("task.top_p=0", ["task.top_p", "(0, 1]"]),
    ("task.top_p=1.5", ["task.top_p", "(0, 1]"]),
    ("task.top_k=-1", ["task.top_k", ">= 0"]),
    ("task.kl_target=raw", ["task.kl_target", "sampler", "tempered_vs_raw"]),
    ("task.kl_target=model task.top_p=0.9", ["task.kl_target=model", "task.top_p=0.9", "task.kl_target=sampler"]),
    ("task.kl_target=model task.temperature=0.7 estimator=seq", ["task.kl_target=model", "estimator seq",
                                                                 "estimator=rb", "in_loss"]),
    ("task.kl_target=model task.temperature=0.7 kl_ctl=adaptive", ["kl_ctl=adaptive", "task.kl_target=model"]),
    ("task=probe task.kl_target=model task.temperature=0.7", ["task=probe", "task.kl_target=model"]),
    ("task.kl_target=model task.temperature=0.7 task.probe_every=40", ["task.probe_every=40", "task.kl_target"]),
    ("task=distill model@teacher=hf teacher.name_or_path=x teacher.generation_config=follow",
     ["teacher.generation_config=follow", "model.generation_config"]),
    ("model=hf model.name_or_path=x model.generation_config=yes", ["model.generation_config", "follow"]),
])
def test_bad_sampling_is_one_line_naming_the_field(tmp_path, override, words):
    cfg = compose_cfg(tmp_path, override.split())
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("override", ["task.kl_target=model task.temperature=0.7",
                                      "task.temperature=0.7 task.top_p=0.9 task.kl_target=tempered estimator=seq",
                                      "task=probe task.temperature=0.5 task.kl_target=tempered_vs_raw"])
def test_good_sampling_validates(tmp_path, override):
    validate(compose_cfg(tmp_path, override.split()))


# ---- the model's generation_config ----

@pytest.fixture(scope="module")
def instruct_dir(llama_dir, tmp_path_factory):
    """The tiny Llama with an instruct-style generation_config: sampling options and a list of stop ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
                                               eos_token_id=[tok.eos_token_id, 17], bos_token_id=tok.bos_token_id,
                                               pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("instruct")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_generation_config_stop_ids_and_options_are_said(tmp_path, instruct_dir, capsys):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={instruct_dir}"])
    policy = build_policy(cfg.model, 8)
    out = capsys.readouterr().out
    assert policy.eos_ids[1:] == [17] and policy.sampling == Sampling()
    line = [l for l in out.splitlines() if "generation_config" in l]
    assert len(line) == 1 and "temperature=0.7, top_k=50, top_p=0.9" in line[0] and "temperature=1" in line[0] \
        and "model.generation_config=follow" in line[0], out
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={instruct_dir}", "model.generation_config=follow"])
    policy = build_policy(cfg.model, 8)
    assert policy.sampling == Sampling(0.7, 50, 0.9)
    assert "follow: sampling with" in capsys.readouterr().out


def test_generation_config_follow_refuses_model_target_under_truncation(tmp_path, instruct_dir):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={instruct_dir}", "model.generation_config=follow"])
    with pytest.raises(ValueError, match="task.kl_target=model"):
        build_policy(cfg.model, 8, kl_target="model")


# ---- a run ----

def test_tempered_top_p_run_on_llama_says_its_target(tmp_path, instruct_dir, capsys):
    """task.temperature=0.7 task.top_p=0.9 on a Llama folder with a stop-id list: trains, logs the sampling and
    target as params, the logp gap, and names the target at start and end."""
    from klbench.tasks.train import run_task
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={instruct_dir}", "task.max_steps=2",
                                 "task.val_every=2", "task.prompts_per_step=2", "task.val_prompts=2",
                                 "task.max_new_tokens=6", "task.log_every=1", "task.temperature=0.7",
                                 "task.top_p=0.9"])
    out = run_task(cfg)
    printed = capsys.readouterr().out
    assert printed.count("KL target sampler: KL(pi_s || pi_ref,T)") == 2, printed  # start and end block
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    (r,) = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment).experiment_id])
    p = r.data.params
    assert (p["task.temperature"], p["task.top_p"], p["task.kl_target"]) == ("0.7", "0.9", "sampler")
    assert p["sampling.used"] == "temperature=0.7, top_p=0.9" and p["sampling.kl_target"] == KL_TARGETS["sampler"]
    m = r.data.metrics
    assert m["train/logp_gap_max"] < 1e-4 and "train/kl_rb" in m and math.isfinite(out["val/seq_kl"])


def test_model_target_run_trains_off_policy(tmp_path, tiny_lm_dir, other_sharp_dir):
    """kl_target=model at T = 0.7 against another reference: rb trains on the behaviour batch (old_logp = the
    sampler's log pi_s), and val/seq_kl, measured on y ~ pi, is the untempered pair's KL."""
    from klbench.tasks.train import run_task
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}", "task.max_steps=2",
                                 "task.val_every=2", "task.prompts_per_step=2", "task.val_prompts=2",
                                 "task.max_new_tokens=6", "task.log_every=1", "task.temperature=0.7",
                                 "task.kl_target=model", f"model.ref_name_or_path={other_sharp_dir}", "logger=none"])
    out = run_task(cfg)
    assert math.isfinite(out["val/seq_kl"]) and out["val/seq_kl"] > 0


def test_distill_and_probe_sample_pi_s(tmp_path, tiny_lm_dir, other_sharp_dir):
    """task=distill trains at T = 0.7 with top-k; task=probe measures the pair as sampled: its reference KL at
    T = 0.5, top-k 5 is not the plain pair's (the probe's rollouts and scoring follow task.*)."""
    from klbench.tasks.train import run_task
    lm = ["model=hf", f"model.name_or_path={tiny_lm_dir}", "task.max_new_tokens=6", "logger=none"]
    out = run_task(compose_cfg(tmp_path / "d", lm + ["task=distill", "reward=none", "estimator.beta=1",
                                                "model@teacher=hf", f"teacher.name_or_path={other_sharp_dir}",
                                                "task.max_steps=2", "task.val_every=2", "task.prompts_per_step=2",
                                                "task.val_prompts=2", "task.temperature=0.7", "task.top_k=20"]))
    assert math.isfinite(out["val/seq_kl"]) and out["val/seq_kl"] > 0
    probe = lm + ["task=probe", f"model.ref_name_or_path={other_sharp_dir}", "reward=none", "task.prompts=2",
                  "task.samples=4", "task.grad_samples=4", "task.replicates=4", "task.ref_batches=2",
                  "task.ref_samples=4", "task.bootstrap=20", "task.gradient_estimators=[rb]"]
    plain = run_task(compose_cfg(tmp_path / "p", probe))["kl_reference"]
    tempered = run_task(compose_cfg(tmp_path / "t", probe + ["task.temperature=0.5", "task.top_k=5"]))["kl_reference"]
    assert plain > 0 and tempered > 0 and abs(plain - tempered) > 0.05 * plain


def test_a_biased_target_is_said_when_built(tmp_path, tiny_lm_dir, capsys):
    """kl_target=tempered under top-p: every estimator is biased there; the run says so in one line."""
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}"])
    build_policy(cfg.model, 8, sampling=Sampling(0.7, 0, 0.9), kl_target="tempered")
    warned = [l for l in capsys.readouterr().out.splitlines() if "warning" in l]
    assert len(warned) == 1 and "task.kl_target=tempered" in warned[0] and "biased" in warned[0]
    build_policy(cfg.model, 8, sampling=Sampling(0.7), kl_target="tempered")  # no cut: tempered is sampler's pair
    assert "warning" not in capsys.readouterr().out


def test_followed_sampling_is_checked_against_the_estimator(tmp_path, llama_dir):
    """model.generation_config=follow at the folder's temperature 0.7 with kl_target=model: the rule the schema
    applies to task.temperature applies to the folder's value too (estimator=seq assumes y ~ pi)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from klbench.tasks.train import run_task
    model = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, eos_token_id=tok.eos_token_id)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tmp_path / 'm'}", "model.generation_config=follow",
                                 "task.kl_target=model", "estimator=seq", "logger=none"])
    with pytest.raises(ConfigError) as e:
        run_task(cfg)
    assert "model.generation_config=follow" in str(e.value) and "estimator seq" in str(e.value)
