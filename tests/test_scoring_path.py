"""The scoring path (model.scoring_path, model.logits_budget; klbench.models.lm_policy.LMPolicy.takes_logits). auto,
by cost: the logits path where a micro-batch's float32 [m, max_new_tokens, V] logits fit the budget and the LM head
is at least 192 wide, the hidden states otherwise; logits and hidden: the path asked for, hidden refused where it
cannot serve. The start-up line says which and why; both give the same scores and gradients; a budget that is no
positive size, an unknown path, and a teacher's own budget or path, are refused in one line naming the key.
hardware=bf16 on a CPU without bfloat16 runs emulated, said in one line, and is refused in one line naming hardware
where a bf16 product does not run (klbench.config.device_checks)."""
from __future__ import annotations

import pytest
import torch

import klbench.config.device_checks as device_checks
from klbench.config.errors import ConfigError
from klbench.config.schema import validate
from klbench.estimators import gradient_estimator
from klbench.models.logits_budget import NARROW_HEAD, size_bytes, size_text
from klbench.models.policies import build_policy, task_sampling
from klbench.tasks.train import check_config
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["the film was", "a slow and", "i liked"]
NEW = 10


@pytest.fixture(scope="module")
def wide_qwen(tmp_path_factory):
    """(policy, reference) folders of a tiny Qwen2 whose LM head is NARROW_HEAD (192) wide: auto weighs its budget."""
    from tiny_lms import save_chat_tokenizer, save_tiny_arch
    root = tmp_path_factory.mktemp("wide_qwen")
    tok = save_chat_tokenizer(root / "tokenizer")
    return tuple(save_tiny_arch("qwen2", root / f"m{seed}", seed=seed, tokenizer=tok, width=NARROW_HEAD)
                 for seed in (0, 1))


def _policy(tmp_path, folders, budget: str, *more: str):
    path, ref = folders
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={path}", f"model.ref_name_or_path={ref}",
                                 f"task.max_new_tokens={NEW}", f"model.logits_budget={budget}", *more])
    validate(cfg)
    sampling, target = task_sampling(cfg.task)
    return build_policy(cfg.model, cfg.task.max_new_tokens, sampling=sampling, kl_target=target)


@pytest.mark.parametrize("text,n", [("256MiB", 256 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
                                    ("12 kib", 12 * 1024), (7, 7)])
def test_sizes_read_as_bytes(text, n):
    assert size_bytes(text) == n


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1.5XB", "0.1B", "true", "null", "1e9"])
def test_a_budget_that_is_no_positive_size_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(tmp_path, [f"model.logits_budget={value}"]))
    msg = str(e.value)
    assert msg.startswith("model.logits_budget must be a positive size in bytes") and "\n" not in msg, msg


@pytest.mark.parametrize("key,value", [("logits_budget", "1GiB"), ("scoring_path", "logits")])
def test_a_teachers_own_budget_or_path_is_refused(tmp_path, key, value):
    validate(compose_cfg(tmp_path, ["experiment=distill", f"model.{key}={value}"]))  # the student's: read
    with pytest.raises(ConfigError, match=rf"^teacher.{key}={value}: the pair is scored on one path"):
        validate(compose_cfg(tmp_path, ["experiment=distill", f"teacher.{key}={value}"]))


def test_an_unknown_scoring_path_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(tmp_path, ["model.scoring_path=fast"]))
    assert str(e.value).startswith("model.scoring_path") and "\n" not in str(e.value), str(e.value)


def test_the_budget_chooses_the_path_at_its_edge_and_the_line_says_why(tmp_path, wide_qwen):
    policy = _policy(tmp_path, wide_qwen, "1")
    V, rows = policy.vocab, 6  # 3 prompts x 2 samples, scored in one micro-batch
    assert policy.width == NARROW_HEAD  # the narrowest head whose budget auto weighs
    need = rows * NEW * V * 4  # bytes of the micro-batch's float32 [6, 10, V] logits
    assert policy.logits_bytes(rows) == need
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2)
    for budget, hidden in ((need, False), (need - 1, True)):
        policy.logits_budget = budget
        assert policy.scoring(ro, None, True).from_hidden is hidden
        line = policy.scoring_line(None, rows)
        shape = f"a micro-batch's float32 [{rows}, {NEW}, {V}] logits ({size_text(need)})"
        if hidden:
            assert line.startswith("scoring from final hidden states") and line.endswith(
                f"{shape} exceed model.logits_budget={size_text(need - 1)}"), line
        else:
            assert line == (f"scoring through the [m, L, V] logits: {shape} fit model.logits_budget={size_text(need)} "
                            "(both paths are exact, docs/scale.md)")
    # micro-batches of 2 rows: a third of the logits, which fit where the whole batch's did not
    assert policy.scoring(ro, 2, True).from_hidden is False
    # a reason the hidden states cannot serve outranks any budget; an explicit path outranks the budget
    assert policy.scoring_line("estimator=topk_tail reads the whole next-token distribution", rows).startswith(
        "scoring through the full [B, T, V] logits: estimator=topk_tail")
    assert policy.scoring(ro, None, True).from_hidden is False
    policy.logits_reason = None
    policy.logits_budget = 2**40
    assert policy.score(ro, logits=False).logits is None  # hidden states asked for: no logits kept


def test_a_narrow_head_scores_from_hidden_states_whatever_the_budget(tmp_path, tiny_arch):
    policy = _policy(tmp_path, tiny_arch("qwen2"), "1GiB")  # its logits fit the budget many times over
    assert policy.width == 32 and policy.logits_bytes(6) < 2**30
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2)
    assert policy.scoring(ro, None, True).from_hidden is True
    assert policy.scoring_line(None, 6) == (
        "scoring from final hidden states: log-probs, the exact KL over the vocabulary and the entropy a tile at a "
        "time, no [B, T, V] logits: the LM head is 32 wide, under 192, where they are the faster path or within a few "
        "percent of it (model.scoring_path=logits asks for those; docs/scale.md)")


@pytest.mark.parametrize("path,hidden", [("logits", False), ("hidden", True)])
def test_the_path_asked_for_outranks_the_cost_and_the_line_says_so(tmp_path, tiny_arch, wide_qwen, path, hidden):
    # logits on a narrow head (auto: hidden), hidden on a wide head whose logits fit (auto: logits)
    policy = _policy(tmp_path, tiny_arch("qwen2") if path == "logits" else wide_qwen, "1GiB",
                     f"model.scoring_path={path}")
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2)
    assert policy.scoring(ro, None, True).from_hidden is hidden
    line = policy.scoring_line(None, 6)
    assert line.startswith("scoring from final hidden states" if hidden else "scoring through the [m, L, V] logits")
    assert line.endswith(f": model.scoring_path={path} (both paths are exact, docs/scale.md)"), line


def test_hidden_asked_for_where_it_cannot_serve_is_refused_in_one_line(tmp_path, tiny_arch):
    policy = _policy(tmp_path, tiny_arch("qwen2"), "1GiB", "model.scoring_path=hidden")
    with pytest.raises(ConfigError) as e:
        policy.scoring_line("estimator=topk_tail reads the whole next-token distribution", 6)
    assert str(e.value) == ("model.scoring_path=hidden: estimator=topk_tail reads the whole next-token distribution, "
                            "which needs the logits; use auto or logits")


def _scores_and_grads(policy, ro):
    batch = policy.score(ro, with_token_kl=True)
    loss = gradient_estimator("rb")(batch).mean() + 0.3 * gradient_estimator("loo")(batch).mean()
    return batch, torch.autograd.grad(loss, policy.trainable())


def test_both_paths_give_the_same_scores_and_gradients(tmp_path, tiny_arch):
    policy = _policy(tmp_path, tiny_arch("qwen2"), "1GiB")
    with torch.no_grad():  # pi away from pi_ref's start: a sizeable KL and gradient
        for p in policy.trainable():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2)
    hidden, g_hidden = _scores_and_grads(policy, ro)
    assert hidden.logits is None  # auto at a 32-wide head: the hidden states
    policy.scoring_path = "logits"
    logits, g_logits = _scores_and_grads(policy, ro)
    assert logits.logits is not None
    for name in ("logp", "ref_logp", "token_kl"):
        a, b = getattr(hidden, name), getattr(logits, name)
        assert b.abs().max() > 1e-3 and torch.allclose(a, b, atol=2e-5), (name, float((a - b).abs().max()))
    for a, b in zip(g_hidden, g_logits):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5 * float(b.abs().max())), float((a - b).abs().max())


@pytest.mark.parametrize("option,precision", [("bf16", "bf16-mixed"), ("bf16_true", "bf16-true")])
def test_bf16_on_a_cpu_without_bfloat16_is_refused_naming_hardware(tmp_path, monkeypatch, capsys, option, precision):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose_cfg(tmp_path, [f"hardware={option}"])
    monkeypatch.setattr(device_checks, "cpu_bf16_supported", lambda: True)
    check_config(cfg)  # a CPU with bfloat16: runs, nothing said
    assert "emulated" not in capsys.readouterr().out
    monkeypatch.setattr(device_checks, "cpu_bf16_supported", lambda: False)
    check_config(cfg)  # without native bfloat16 (an AVX2 CPU): runs emulated, said in one line
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"hardware.precision={precision} on a CPU without native bfloat16" in out, out
    monkeypatch.setattr(device_checks, "cpu_bf16_runs", lambda: False)
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    msg = str(e.value)
    assert msg.startswith(f"hardware.precision={precision} (hardware=bf16 or bf16_true) but bfloat16 products do not "
                          "run on this CPU") and msg.endswith("use hardware=cpu") and "\n" not in msg, msg
    check_config(compose_cfg(tmp_path, ["hardware=cpu"]))  # float32 is never refused for it


def test_a_bf16_product_runs_on_this_cpu():
    assert device_checks.cpu_bf16_runs()


def test_the_cpu_probe_answers_from_torch():
    assert device_checks.cpu_bf16_supported() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
