"""The scoring path by its cost (model.logits_budget, klbench.models.lm_policy.LMPolicy.logits_fit): the logits
path where a micro-batch's float32 [m, max_new_tokens, V] logits fit the budget, the hidden states above it; the
start-up line says which and why; both give the same scores and gradients; a budget that is no positive size, and a
teacher's own budget, are refused in one line naming the key. hardware=bf16 on a CPU without bfloat16 is refused
in one line naming hardware (klbench.config.device_checks)."""
from __future__ import annotations

import pytest
import torch

import klbench.config.device_checks as device_checks
from klbench.config.errors import ConfigError
from klbench.config.schema import validate
from klbench.estimators import gradient_estimator
from klbench.models.logits_budget import size_bytes, size_text
from klbench.models.policies import build_policy, task_sampling
from klbench.tasks.train import check_config
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["the film was", "a slow and", "i liked"]
NEW = 10


def _policy(tmp_path, tiny_arch, budget: str):
    path, ref = tiny_arch("qwen2")
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={path}", f"model.ref_name_or_path={ref}",
                                 f"task.max_new_tokens={NEW}", f"model.logits_budget={budget}"])
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


def test_a_teachers_own_budget_is_refused(tmp_path):
    validate(compose_cfg(tmp_path, ["experiment=distill", "model.logits_budget=1GiB"]))  # the student's: read
    with pytest.raises(ConfigError, match=r"^teacher.logits_budget=1GiB: the pair is scored on one path"):
        validate(compose_cfg(tmp_path, ["experiment=distill", "teacher.logits_budget=1GiB"]))


def test_the_budget_chooses_the_path_at_its_edge_and_the_line_says_why(tmp_path, tiny_arch):
    policy = _policy(tmp_path, tiny_arch, "1")
    V, rows = policy.vocab, 6  # 3 prompts x 2 samples, scored in one micro-batch
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


def _scores_and_grads(policy, ro):
    batch = policy.score(ro, with_token_kl=True)
    loss = gradient_estimator("rb")(batch).mean() + 0.3 * gradient_estimator("loo")(batch).mean()
    return batch, torch.autograd.grad(loss, policy.trainable())


def test_both_choices_of_the_budget_give_the_same_scores_and_gradients(tmp_path, tiny_arch):
    policy = _policy(tmp_path, tiny_arch, "1")
    with torch.no_grad():  # pi away from pi_ref's start: a sizeable KL and gradient
        for p in policy.trainable():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 2)
    hidden, g_hidden = _scores_and_grads(policy, ro)
    assert hidden.logits is None  # 1 byte: the hidden states
    policy.logits_budget = 2**30
    logits, g_logits = _scores_and_grads(policy, ro)
    assert logits.logits is not None  # 1 GiB: the logits path
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
