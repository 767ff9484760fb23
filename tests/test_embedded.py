"""The offline embedded default: corpus, tokenizer, cached tiny GPT-2, loading rules, rewards."""
import os
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub in tests

import pytest
import torch

import klbench.models.embedded.cache as embedded_cache
import klbench.models.embedded.spec as embedded_spec
from klbench.models.embedded import embedded_lm_dir, ensure_embedded_lm
from klbench.models.embedded.build import train_tokenizer
from klbench.models.embedded.corpus import embedded_prompts, generate_reviews
from klbench.models.hf import check_same_vocab, load_causal_lm
from klbench.models.rollout import position_ids_from_mask
from klbench.rewards.reward import HFClassifierReward, VaderReward

# A spec small enough to pretrain in a couple of seconds: only the plumbing is under test.
TINY = {"name": "tiny", "corpus_size": 200, "corpus_seed": 0, "positive_fraction": 0.5, "vocab_size": 300,
        "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64, "steps": 4, "batch_size": 8, "lr": 1e-3,
        "seed": 0, "max_len": 32}


@pytest.fixture(scope="module")
def vader():
    return VaderReward()


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(generate_reviews(500, seed=1), vocab_size=300)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cache"))
    path = ensure_embedded_lm(TINY, root, progress=False)
    return root, path


# ----------------------------------------------------------------------------- corpus


def test_corpus_is_deterministic_and_seeded():
    assert generate_reviews(50, seed=3) == generate_reviews(50, seed=3)
    assert generate_reviews(50, seed=3) != generate_reviews(50, seed=4)
    assert len(generate_reviews(7)) == 7


def test_corpus_has_both_sentiments(vader):
    r = vader.score_texts(generate_reviews(400, seed=0))
    assert (r > 0.05).float().mean() > 0.35 and (r < -0.05).float().mean() > 0.25
    skewed = vader.score_texts(generate_reviews(400, seed=0, positive_fraction=1.0))
    assert skewed.mean() > r.mean() + 0.2  # positive_fraction moves the sentiment
    with pytest.raises(ValueError, match="positive_fraction"):
        generate_reviews(3, positive_fraction=1.5)


def test_prompts_split_and_neutral(vader):
    train, val = embedded_prompts("train"), embedded_prompts("val")
    assert len(train) >= 128 and len(val) >= 32
    assert not set(train) & set(val)
    assert (vader.score_texts(train + val) == 0).all()  # openings carry no sentiment of their own
    reviews = generate_reviews(2000, seed=0)
    assert any(r.startswith(val[0] + " ") for r in reviews)  # val prompts are in-distribution prefixes
    with pytest.raises(ValueError, match="split"):
        embedded_prompts("test")


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tok):
    for text in ["The movie was great.", "I watched Iron Valley twice, and I hated it!", "Ünïcode 🎬 works"]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id  # bos is prepended, as in pretraining
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.bos_token_id == tok.eos_token_id == 0 and tok.pad_token_id == 1
    assert tok.padding_side == "left"
    batch = tok(["The movie", "I watched this film last night"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0 and batch["input_ids"][0, 0] == tok.pad_token_id


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 1, 0, 0]]


# ----------------------------------------------------------------------------- embedded LM cache


def test_ensure_embedded_lm_reuses_cache(cache, monkeypatch):
    root, path = cache
    assert path == embedded_lm_dir(TINY, root) and os.path.isdir(path)
    assert os.path.basename(path).startswith("tiny-")
    for f in ("config.json", "tokenizer.json", "spec.json", "pretrain_metrics.json"):
        assert os.path.exists(os.path.join(path, f))
    stamp = os.path.getmtime(os.path.join(path, "config.json"))

    import klbench.models.embedded.pretrain as pt

    def must_not_run(*a, **k):
        raise AssertionError("cache was not reused")

    monkeypatch.setattr(pt, "pretrain", must_not_run)
    assert ensure_embedded_lm(dict(TINY), root, progress=False) == path
    assert os.path.getmtime(os.path.join(path, "config.json")) == stamp
    with pytest.raises(AssertionError, match="not reused"):  # a different spec is a different model
        ensure_embedded_lm({**TINY, "steps": 5}, root, progress=False)
    assert not [d for d in os.listdir(os.path.dirname(path)) if d.startswith(".tmp")]  # failed build left nothing


def test_different_spec_builds_other_dir_with_shared_tokenizer(cache):
    root, path = cache
    other = ensure_embedded_lm({**TINY, "steps": 2, "seed": 1}, root, progress=False)
    assert other != path and os.path.isdir(other)
    tok_dirs = [d for d in os.listdir(os.path.join(root, "embedded")) if d.startswith("tokenizer-")]
    assert len(tok_dirs) == 1  # both models trained with the one shared tokenizer
    _, ta = load_causal_lm(path)
    _, tb = load_causal_lm(other)
    check_same_vocab(ta, tb)


def test_racing_builders_build_once(tmp_path):
    """Two builders of the same directory: one builds, the other waits on the lock and reuses it."""
    import threading

    final, calls = str(tmp_path / "embedded" / "x-123"), []

    def build(tmp):
        calls.append(tmp)
        time.sleep(0.3)  # long enough for the other thread to arrive and wait
        with open(os.path.join(tmp, "done"), "w") as f:
            f.write("ok")

    results = []
    threads = [threading.Thread(target=lambda: results.append(embedded_cache.build_cached(final, build)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, True] and len(calls) == 1
    assert os.path.exists(os.path.join(final, "done"))

    def crash(tmp):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):  # a failed build leaves no directory behind
        embedded_cache.build_cached(str(tmp_path / "embedded" / "y-456"), crash)
    assert sorted(os.listdir(tmp_path / "embedded")) == [".locks", "x-123"]


def test_a_builder_that_waits_says_so(tmp_path, capsys):
    """While another process holds the build lock, a builder says in one line that it waits, then builds."""
    import fcntl
    import threading

    final = str(tmp_path / "embedded" / "z-789")
    os.makedirs(tmp_path / "embedded" / ".locks")
    results = []
    with open(tmp_path / "embedded" / ".locks" / "z-789.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other process, mid-build
        thread = threading.Thread(target=lambda: results.append(
            embedded_cache.build_cached(final, lambda tmp: None, what="the embedded z LM")))
        thread.start()
        err, deadline = "", time.time() + 30
        while "waiting" not in err and time.time() < deadline:
            time.sleep(0.05)
            err += capsys.readouterr().err
        fcntl.flock(held, fcntl.LOCK_UN)
    thread.join()
    err += capsys.readouterr().err
    assert err.splitlines() == [f"klbench: waiting for another process that is building {final}",
                                f"klbench: building the embedded z LM (once per machine), cached in {final}",
                                "klbench: built the embedded z LM in 0 s"]
    assert results == [True] and os.path.isdir(final)


def test_cache_dir_is_per_user(monkeypatch, tmp_path):
    """$KLBENCH_CACHE, else $XDG_CACHE_HOME/klbench, else ~/.cache/klbench; never the working directory."""
    monkeypatch.setenv("KLBENCH_CACHE", str(tmp_path / "mine"))
    assert embedded_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("KLBENCH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded_cache.cache_dir() == tmp_path / "xdg" / "klbench"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # the XDG spec ignores a relative path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded_cache.cache_dir() == tmp_path / "home" / ".cache" / "klbench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert embedded_cache.cache_dir() == tmp_path / "home" / ".cache" / "klbench"


def test_two_outputs_folders_share_one_cache(tmp_path):
    """`klbench task=pretrain` started from two directories (two outputs folders): built once, in the
    user's cache, saying so in one line; the second run reuses it and writes no model under its outputs."""
    import cli_inprocess

    env = {k: v for k, v in os.environ.items() if k not in ("KLBENCH_OUTPUTS", "XDG_CACHE_HOME")}
    env.update(KLBENCH_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    tiny = [f"model.spec.{k}={v}" for k, v in TINY.items()]
    runs = []
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        proc = cli_inprocess.run(["task=pretrain", *tiny], cwd=tmp_path / where, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(proc)
    path = embedded_lm_dir(TINY, tmp_path / "cache")
    tokenizer = embedded_cache.embedded_tokenizer_dir(TINY, tmp_path / "cache")
    building = [line for line in runs[0].stderr.splitlines() if line.startswith("klbench: buil")]
    assert building == [f"klbench: building the embedded tokenizer (300 tokens) (once per machine), cached in {tokenizer}",
                        building[1], f"klbench: building the embedded tiny LM (once per machine), cached in {path}",
                        building[3]], building
    for line in building[1::2]:  # the time each build took
        assert re.fullmatch(r"klbench: built the embedded (tokenizer \(300 tokens\)|tiny LM) in \d+ s", line), line
    # progress where stderr is no terminal: a line per tenth of the 4 steps, the last one at step 4
    assert re.search(r"^klbench: pretraining the embedded tiny LM: step 4/4 \(100%\), loss [\d.]+, \d+ s so far$",
                     runs[0].stderr, re.M), runs[0].stderr[-2000:]
    assert "klbench: buil" not in runs[1].stderr  # the second outputs folder reuses the model
    for proc in runs:
        assert f"klbench: embedded tiny LM at {path}" in proc.stdout
    assert sorted(os.listdir(tmp_path / "cache" / "embedded")) == sorted(
        [".locks", os.path.basename(path), os.path.basename(tokenizer)])
    for where in ("a", "b"):
        assert not (tmp_path / where / "outputs" / "embedded").exists()


def test_unknown_spec_key_raises(tmp_path):
    with pytest.raises(ValueError, match="n_embed"):
        ensure_embedded_lm({**TINY, "n_embed": 8}, str(tmp_path))
    with pytest.raises(ValueError, match="steps must be int"):
        ensure_embedded_lm({**TINY, "steps": "5"}, str(tmp_path))


def test_load_causal_lm_generates(cache):
    _, path = cache
    model, tok = load_causal_lm(path)
    assert tok.padding_side == "left" and tok.pad_token_id == model.config.pad_token_id
    enc = tok(["The movie", "I watched this film"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, top_k=0, max_new_tokens=5, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 2 and out.shape[1] > enc["input_ids"].shape[1]
    assert all(isinstance(t, str) for t in tok.batch_decode(out, skip_special_tokens=True))


def test_missing_path_raises_fast(tmp_path):
    missing = str(tmp_path / "no_such_model")
    for loader in (load_causal_lm, lambda p: HFClassifierReward(p, "POSITIVE")):
        t0 = time.time()
        with pytest.raises(FileNotFoundError, match="no_such_model"):
            loader(missing)
        assert time.time() - t0 < 5
    t0 = time.time()
    with pytest.raises(FileNotFoundError, match="nobody-here/no-such-model"):  # offline hub id, not cached
        load_causal_lm("nobody-here/no-such-model")
    assert time.time() - t0 < 5
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(missing, dtype="float8")


def test_check_same_vocab_raises(tok):
    check_same_vocab(tok, tok)
    other = train_tokenizer(generate_reviews(500, seed=2), vocab_size=320)
    with pytest.raises(ValueError, match="student.*teacher"):
        check_same_vocab(other, tok, "student", "teacher")


def test_spec_hash_depends_on_spec_and_code_version(tmp_path, monkeypatch):
    a = embedded_lm_dir(TINY, str(tmp_path))
    assert embedded_lm_dir({**TINY, "lr": 2e-3}, str(tmp_path)) != a
    monkeypatch.setattr(embedded_spec, "EMBEDDED_CODE_VERSION", embedded_spec.EMBEDDED_CODE_VERSION + 1)
    assert embedded_lm_dir(TINY, str(tmp_path)) != a


# ----------------------------------------------------------------------------- rewards


def test_vader_sign(vader):
    r = vader.score_texts(["This movie was wonderful, I loved it.", "A terrible, boring waste of time.", "It runs two hours."])
    assert r.shape == (3,) and r.dtype == torch.float32
    assert r[0] > 0.5 and r[1] < -0.5 and r[2] == 0


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory, tok):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    path = str(tmp_path_factory.mktemp("clf"))
    config = DistilBertConfig(vocab_size=len(tok), dim=16, n_layers=1, n_heads=2, hidden_dim=32,
                              max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                              id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})
    torch.manual_seed(0)
    DistilBertForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_text_rewards_score_a_rollouts_texts(vader):
    """The RL task calls reward(rollout): a text reward scores rollout.texts, in order."""
    from klbench.models.policies import Rollout
    texts = ["This movie was wonderful.", "A terrible waste of time.", "It runs two hours."]
    ro = Rollout(torch.zeros(3, 1), torch.ones(3, 1), 0, torch.ones(3, 1, dtype=torch.bool), torch.arange(3),
                 texts, ["p"] * 3)
    torch.testing.assert_close(vader(ro), vader.score_texts(texts))
    assert vader(ro)[0] > 0 > vader(ro)[1]


def test_hf_classifier_reward(tiny_classifier):
    texts = ["The movie was great.", "Awful.", "I watched it twice and it was a mess."]
    logit = HFClassifierReward(tiny_classifier, "POSITIVE", batch_size=2).score_texts(texts)
    assert logit.shape == (3,) and torch.isfinite(logit).all()
    prob = HFClassifierReward(tiny_classifier, 1, score="prob").score_texts(texts)
    assert ((prob > 0) & (prob < 1)).all()
    with pytest.raises(ValueError, match="NEGATIVE"):  # the message lists id2label
        HFClassifierReward(tiny_classifier, "positive")
    with pytest.raises(ValueError, match="score"):
        HFClassifierReward(tiny_classifier, "POSITIVE", score="margin")
