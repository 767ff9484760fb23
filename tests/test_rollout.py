"""The rollout engine (klbench/models/rollout.py): the same tokens as generate(), the same log-probs as scoring."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from klbench.models.embedded import ensure_embedded_lm
from klbench.models.hf import load_causal_lm
from klbench.models.policies import LMPolicy
from klbench.models.rollout import exp_noise, generate_sample, kv_cache_sample

# prompts of different lengths: the batch is left-padded
PROMPTS = ["The movie", "I did not like it", "A"]
# the embedded recipe at its smallest: pretrained briefly, so some tokens are frequent
EMBEDDED = {"name": "tiny-rollout", "corpus_size": 200, "corpus_seed": 0, "positive_fraction": 0.5, "vocab_size": 300,
            "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64, "steps": 30, "batch_size": 8, "lr": 1e-2,
            "seed": 0, "max_len": 32}


@pytest.fixture(scope="module")
def embedded_dir():
    return ensure_embedded_lm(EMBEDDED, None, progress=False)  # the session cache: its tokenizer is shared


@pytest.fixture(scope="module")
def gpt2_dir(tiny_lm_dir, tmp_path_factory):
    """tiny_lm_dir's GPT-2, saved again with a final-layer-norm bias along EOS's embedding: it ends texts often
    (about 1 token in 10), so rows end at different steps and a batch ends before max_new_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir, local_files_only=True)
    with torch.no_grad():
        e = model.transformer.wte.weight[tok.eos_token_id]
        model.transformer.ln_f.bias.copy_(30.0 * e / e.norm())
    path = tmp_path_factory.mktemp("eos_gpt2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _batch(tok, n=4):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    return enc.input_ids.repeat_interleave(n, 0), enc.attention_mask.repeat_interleave(n, 0)  # [B, P]


def _frequent_token(model, tok, ids, attn, new, seed):
    """A token id that, under `seed`, every row samples within `new` tokens, the soonest to do so: as eos it ends
    the batch early. Rows are independent (a finished row changes neither the other rows' logits nor their
    draws), so a run that never stops shows where each row first samples each token."""
    torch.manual_seed(seed)
    free = kv_cache_sample(model, ids, attn, new, eos_ids=-1, pad_id=tok.pad_token_id).tokens  # [B, new]
    first = {}  # token -> [B] its first step in each row (new where absent)
    for t in set(free.flatten().tolist()) - {tok.pad_token_id}:
        hit = free == t
        first[t] = torch.where(hit.any(1), hit.int().argmax(1), new)
    return min(first, key=lambda t: int(first[t].max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["embedded", "gpt2"])
def test_same_tokens_as_generate(which, dtype, request, single_thread):
    """Token for token, including EOS, the pads after it and the batch's early stop; and the RNG state after."""
    model, tok = load_causal_lm(request.getfixturevalue(f"{which}_dir"), dtype)
    ids, attn = _batch(tok)
    assert (attn == 0).any(), "the prompts must be left-padded"
    new = model.config.n_positions - ids.shape[1]
    for seed in range(2):
        if which == "gpt2":  # its own eos, and GPT-2's convention for a tokenizer without a pad token: pad = eos
            eos = pad = tok.eos_token_id
        else:  # the embedded model rarely ends a text this early: a frequent token stands in; its own pad
            eos, pad = _frequent_token(model, tok, ids, attn, new, seed), tok.pad_token_id
        torch.manual_seed(seed)
        ref = generate_sample(model, ids, attn, new, eos, pad).tokens
        after_ref = torch.rand(4)
        torch.set_num_threads(2)  # generate() ran on one thread; the engine's tokens do not depend on it
        torch.manual_seed(seed)
        got = kv_cache_sample(model, ids, attn, new, eos, pad, threads=1 + seed)
        assert torch.get_num_threads() == 2  # restored
        torch.set_num_threads(1)
        assert torch.equal(got.tokens, ref)
        assert torch.equal(torch.rand(4), after_ref)  # the same draws consumed: later steps do not move
        hit = got.tokens == eos
        assert hit.any(1).all()
        ended = hit.int().argmax(1)  # [B] each row's first EOS
        assert len(set(ended.tolist())) > 1  # rows ended at different steps ...
        length = got.tokens.shape[1]
        assert length == int(ended.max()) + 1 < new  # ... and the batch stopped at the last of them
        steps = torch.arange(length)
        assert (got.tokens[steps > ended[:, None]] == pad).all()  # pads after each row's EOS
        assert (got.logp[steps > ended[:, None]] == 0).all()
        assert (got.logp[steps <= ended[:, None]] < 0).all()


def test_sample_logp_is_the_scoring_logp(gpt2_dir, single_thread):
    """The log-probs kept while sampling are those the scoring pass (one forward over prompt + response) gives."""
    (model, tok), (ref, _) = load_causal_lm(gpt2_dir), load_causal_lm(gpt2_dir)
    policy = LMPolicy(model, ref, tok, max_new_tokens=20)
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 4)
    batch = policy.score(ro)
    assert ro.sampled_logp.shape == batch.logp.shape == ro.mask.shape
    torch.testing.assert_close(ro.sampled_logp[ro.mask], batch.logp.detach()[ro.mask], atol=2e-5, rtol=1e-5)
    assert batch.logp.requires_grad and not ro.tokens.is_inference()  # the scoring pass can backpropagate


def test_policy_rollouts_equal_with_either_sampler(embedded_dir, single_thread):
    model, tok = load_causal_lm(embedded_dir)
    rollouts = []
    for sampler in ("generate", "kv_cache"):
        torch.manual_seed(3)
        rollouts.append(LMPolicy(model, model, tok, max_new_tokens=16, sampler=sampler).rollout(PROMPTS, 2))
    a, b = rollouts
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.attention, b.attention) and a.texts == b.texts
    assert a.sampled_logp is None and b.sampled_logp is not None
    with pytest.raises(ValueError, match="sampler must be one of"):
        LMPolicy(model, model, tok, max_new_tokens=16, sampler="vllm")


def test_non_finite_logits_stop_the_rollout(gpt2_dir, single_thread):
    """torch.multinomial refuses NaN probabilities; the loop, which does its arithmetic, must refuse them too."""
    model, tok = load_causal_lm(gpt2_dir)
    with torch.no_grad():
        model.lm_head.weight[5] = float("nan")  # tied to wte: token 5's logit is NaN from the prefill on
    ids, attn = _batch(tok, n=1)
    with pytest.raises(FloatingPointError, match="non-finite logits at response step 0"):
        kv_cache_sample(model, ids, attn, 4, tok.eos_token_id, tok.pad_token_id, threads=2)


@pytest.mark.parametrize("shape", [(32, 2000), (3, 7), (1,)])
def test_exp_noise_is_exponential_bit_for_bit(shape):
    """The vectorised draw gives exponential_()'s values and leaves the generator where exponential_() does."""
    for seed in range(20):
        torch.manual_seed(seed)
        want = torch.empty(shape).exponential_()
        after = torch.get_rng_state()
        torch.manual_seed(seed)
        got = exp_noise(shape, torch.device("cpu"))
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert torch.equal(torch.get_rng_state(), after)
