"""Scoring from final hidden states (klbench.estimators.head_scores, klbench.models.head, klbench.models.scoring)
gives the logits path's numbers: values and gradients of log pi(y), log pi_ref(y), the exact KL kappa and the
entropy, on GPT-2 (tied embeddings), Llama, Qwen2 and Gemma 2 (final-logit softcapping), with LoRA, at T != 1;
no tensor of [N, V] is kept for backward; heads it cannot read keep the logits path and say why."""
from __future__ import annotations

import pytest
import torch

import klbench.estimators.head_scores as hs
from klbench.estimators import gradient_estimator
from klbench.estimators.head_scores import LMHead, head_scores
from klbench.models.policies import build_policy, task_sampling
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["the film was", "a slow and", "i liked"]


def _unfused(h, head, y, h_ref, ref_head):
    lp, lq = head.logits(h).log_softmax(-1), ref_head.logits(h_ref).log_softmax(-1)  # [N, V] each
    return (lp.gather(-1, y[:, None])[:, 0], lq.gather(-1, y[:, None])[:, 0], (lp.exp() * (lp - lq)).sum(-1),
            -(lp.exp() * lp).sum(-1))


@pytest.mark.parametrize("cap,scale,temperature", [(None, 1.0, 1.0), (5.0, 1.3, 0.7), (None, 0.5, 1.5)])
def test_head_scores_equal_the_unfused_formula_in_float64(monkeypatch, cap, scale, temperature):
    # tiles of 5 rows x 7 tokens: every row block and vocabulary chunk boundary is crossed, the last ones ragged
    monkeypatch.setattr(hs, "tile_shape", lambda rows, vocab, device: (5, 7))
    g = torch.Generator().manual_seed(0)
    N, H, V = 23, 6, 40
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = (3 * torch.randn(V, H, generator=g, dtype=torch.float64)).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    h_ref = torch.randn(N, H + 2, generator=g, dtype=torch.float64)
    ref = LMHead(3 * torch.randn(V, H + 2, generator=g, dtype=torch.float64),
                 torch.randn(V, generator=g, dtype=torch.float64), scale, cap, temperature)
    head, y = LMHead(w, b, scale, cap, temperature), torch.randint(0, V, (N,), generator=g)
    s = head_scores(h, head, y, h_ref, ref, with_token_kl=True)
    want = _unfused(h, head, y, h_ref, ref)
    for got, exp in zip((s.logp, s.ref_logp, s.kappa, s.entropy), want):
        assert torch.allclose(got, exp, atol=1e-12), float((got - exp).abs().max())
    up = [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3)]  # upstream gradients
    got = torch.autograd.grad(sum((x * u).sum() for x, u in zip((s.logp, s.kappa, s.entropy), up)), (h, w, b))
    exp = torch.autograd.grad(sum((x * u).sum() for x, u in zip((want[0], want[2], want[3]), up)), (h, w, b))
    for a, e in zip(got, exp):
        assert e.abs().max() > 1e-3 and torch.allclose(a, e, atol=1e-11), float((a - e).abs().max())


def _policy(tmp_path, path, ref_path, *extra, temperature=1.0):
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={path}", f"model.ref_name_or_path={ref_path}",
                                 "task.max_new_tokens=10", f"task.temperature={temperature}", *extra])
    sampling, target = task_sampling(cfg.task)
    return build_policy(cfg.model, cfg.task.max_new_tokens, sampling=sampling, kl_target=target)


def _sharpen(policy, factor: float = 40.0) -> None:
    """Logits of tens of nats, so that Gemma 2's softcap at 30 bends them (a fresh init gives logits below 1)."""
    from klbench.models.head import output_head
    heads = {id(h): h for h in (output_head(policy.model), output_head(policy.ref))}  # LoRA: one head, shared
    with torch.no_grad():
        for head in heads.values():
            head.weight.mul_(factor)


def _scores_and_grads(policy, ro, logits: bool):
    batch = policy.score(ro, with_token_kl=True, logits=logits)
    loss = gradient_estimator("rb")(batch).mean() + 0.3 * gradient_estimator("loo")(batch).mean()
    params = policy.trainable()
    return batch, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("arch,temperature,lora", [("gpt2", 1.0, False), ("llama", 1.0, False),
                                                   ("qwen2", 0.7, False), ("gemma2", 1.0, False),
                                                   ("gemma2", 0.7, False), ("llama", 0.7, True)])
def test_the_hidden_state_path_gives_the_logits_path_values_and_gradients(tmp_path, tiny_arch, tiny_lm_dir,
                                                                          other_tiny_lm_dir, arch, temperature, lora):
    from tiny_lms import save_sharpened_variant
    if arch == "gpt2":  # the embedded-style GPT-2: tied input and output embeddings
        paths = (tiny_lm_dir, save_sharpened_variant(tiny_lm_dir, tmp_path / "ref", 32, 1, seed=3, sharpen=2.0))
    else:
        paths = tiny_arch(arch)
    extra = ["model.lora.r=4"] if lora else []
    torch.manual_seed(0)  # LoRA's initialisation draws from the global generator
    policy = _policy(tmp_path, *paths, *extra, temperature=temperature)
    assert policy.scoring_reason is None  # the hidden-state path serves this model
    _sharpen(policy, 40.0 if arch == "gemma2" else 10.0)
    with torch.no_grad():  # pi away from its start, so that every gradient is sizeable
        for p in policy.trainable():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2)
    fused32, g32 = _scores_and_grads(policy, ro, logits=False)
    # float64: the two paths agree to rounding, and float32's hidden-state path is held to them. transformers
    # 5.24's Gemma 2 gives non-finite hidden states in float64: it is compared in float32, to float32's rounding
    exact = arch != "gemma2"
    if exact:
        policy.double()
    fused, g_fused = _scores_and_grads(policy, ro, logits=False)
    plain, g_plain = _scores_and_grads(policy, ro, logits=True)
    assert fused.logits is None and plain.logits is not None
    m = ro.mask
    from klbench.models.policies import token_entropy
    # float32 logits of tens or hundreds of nats (sharpened) are themselves rounded by ~1e-7 of their size
    scale = float(plain.logits.abs().max())
    tol, tol32 = (1e-10, 1e-6 * scale) if exact else (1e-6 * scale, 1e-6 * scale)
    for name, a, b in (("logp", fused.logp, plain.logp), ("ref_logp", fused.ref_logp, plain.ref_logp),
                       ("kappa", fused.token_kl, plain.kappa), ("entropy", token_entropy(fused), token_entropy(plain))):
        assert torch.allclose(a[m], b[m], atol=tol), (name, float((a - b)[m].abs().max()))
    for a, b in ((fused32.logp, plain.logp), (fused32.token_kl, plain.kappa)):
        assert torch.allclose(a[m].to(b.dtype), b[m], rtol=1e-5, atol=tol32), float((a[m].to(b.dtype) - b[m]).abs().max())
    if arch == "gemma2":  # the softcap is live: some logit is past where tanh is the identity
        assert float(plain.logits.abs().max()) > 15
    norm = torch.sqrt(sum((g ** 2).sum() for g in g_plain))
    assert norm > 1e-3
    rtol = 1e-7 if exact else 1e-3  # float32's logits path is the less accurate of the two (docs/scale.md)
    for a, b, c in zip(g_fused, g_plain, g32):
        assert torch.allclose(a, b, rtol=rtol, atol=rtol * 1e-3 * float(norm)), float((a - b).abs().max())
        assert torch.allclose(c.to(b.dtype), b, rtol=1e-3, atol=1e-5 * float(norm)), float((c - b).abs().max())


def test_backward_keeps_no_vocabulary_sized_tensor(tmp_path, tiny_arch):
    policy = _policy(tmp_path, *tiny_arch("qwen2"))
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2)
    V, N = policy.model.config.vocab_size, int(ro.mask.sum())
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch = policy.score(ro, with_token_kl=True, logits=False)  # the hidden states, whatever the budget
        gradient_estimator("rb")(batch).mean().backward()
    assert max(saved) < N * V, (max(saved), N * V)  # the hidden states [B, T, H] are the largest
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the logits path keeps [N, V] (the check bites)
        saved.clear()
        policy.score(ro, with_token_kl=True, logits=True)
    assert max(saved) >= N * V


def test_a_head_it_cannot_read_keeps_the_logits_path_and_says_why(tmp_path, tiny_arch):
    path, ref = tiny_arch("llama")
    lora_head = _policy(tmp_path, path, path, "model.lora.r=4", "model.lora.target_modules=[q_proj,lm_head]")
    assert "not a plain nn.Linear" in lora_head.scoring_reason
    assert lora_head.scoring_line().startswith("scoring through the full [B, T, V] logits: the policy's LM head")
    # a Llama does not softcap: a config that says it does is caught by running the model, not believed
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    cfg.final_logit_softcapping = 30.0
    cfg.save_pretrained(tmp_path / "capped")
    import shutil
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src := __import__("pathlib").Path(path) / f).exists():
            shutil.copy(src, tmp_path / "capped" / f)
    capped = _policy(tmp_path, tmp_path / "capped", ref)
    assert "changes the head's output in a way klbench does not model" in capped.scoring_reason
    torch.manual_seed(0)
    ro = capped.rollout(PROMPTS, 2)
    assert capped.score(ro).logits is not None  # it scores, through its logits


def test_truncated_sampling_and_topk_estimators_keep_the_logits_path(tmp_path, tiny_arch):
    policy = _policy(tmp_path, *tiny_arch("llama"), "task.top_p=0.9")
    assert "is cut from the logits" in policy.scoring_reason
    plain = _policy(tmp_path, *tiny_arch("llama"))
    line = plain.scoring_line("estimator=topk_tail reads the whole next-token distribution")
    assert line == ("scoring through the full [B, T, V] logits: estimator=topk_tail reads the whole next-token "
                    "distribution")
    torch.manual_seed(0)
    assert plain.scoring(plain.rollout(PROMPTS, 2), None, True).from_hidden is False


@pytest.mark.parametrize("which", ["logp", "kappa", "entropy", "logp+entropy", "kappa+entropy"])
def test_each_gradient_alone_and_together(monkeypatch, which):
    """Backward builds its per-tile factor only from the gradients it is given: each alone and in pairs."""
    monkeypatch.setattr(hs, "tile_shape", lambda rows, vocab, device: (4, 9))
    g = torch.Generator().manual_seed(1)
    N, H, V = 11, 5, 30
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = (2 * torch.randn(V, H, generator=g, dtype=torch.float64)).requires_grad_()
    h_ref, y = torch.randn(N, H, generator=g, dtype=torch.float64), torch.randint(0, V, (N,), generator=g)
    head, ref = LMHead(w, None, 1.0, 4.0), LMHead(2 * torch.randn(V, H, generator=g, dtype=torch.float64), None, 1.0, 4.0)
    s, want = head_scores(h, head, y, h_ref, ref, with_token_kl=True), _unfused(h, head, y, h_ref, ref)
    pick = {"logp": (s.logp, want[0]), "kappa": (s.kappa, want[2]), "entropy": (s.entropy, want[3])}
    got = torch.autograd.grad(sum(pick[k][0].sum() for k in which.split("+")), (h, w), retain_graph=True)
    exp = torch.autograd.grad(sum(pick[k][1].sum() for k in which.split("+")), (h, w))
    for a, e in zip(got, exp):
        assert torch.allclose(a, e, atol=1e-11), float((a - e).abs().max())


def test_a_zero_upstream_gradient_gives_zeros_as_the_logits_path_does():
    """loo's advantages at pi = pi_ref with no reward are all 0: its gradient is zeros, not None, on both paths.
    AdamW skips a parameter whose grad is None (no weight decay, no step counted), so None would train the two
    paths differently; it also left loo's optimizer without state in the V = 151,936 peaks (docs/scale.md)."""
    g = torch.Generator().manual_seed(2)
    N, H, V = 7, 5, 30
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_()
    h_ref, y = torch.randn(N, H, generator=g), torch.randint(0, V, (N,), generator=g)
    head, ref = LMHead(w, b), LMHead(torch.randn(V, H, generator=g))
    for fused in (True, False):
        for x in (h, w, b):
            x.grad = None
        if fused:
            s = head_scores(h, head, y, h_ref, ref, with_token_kl=True)
            lp, kappa = s.logp, s.kappa
        else:
            lp, _, kappa, _ = _unfused(h, head, y, h_ref, ref)
        (0.0 * lp.sum() + 0.0 * kappa.sum()).backward()
        for x in (h, w, b):
            assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x)), fused
