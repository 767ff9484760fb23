"""task.micro_batch_size and model.gradient_checkpointing: the gradient of a step scored in micro-batches is the
full batch's, for every estimator (groups and batch-wide token counts included); a run trains the same; bad input
is one line naming the setting."""
from __future__ import annotations

import math

import pytest
import torch

from klbench.config.schema import ConfigError, validate
from klbench.models.policies import ScoredBatch, build_policy, task_sampling, token_entropy
from klbench.rewards.reward import build_reward
from klbench.tasks import build_task
from klbench.tasks.train import run_task
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")

# every estimator option but the two that read the full [B, T, V] logits (refused with micro-batches, below)
ESTIMATORS = ["naive_mc", "naive_cv", "token", "seq", "cumulative", "loo", "rb", "in_reward", "in_loss", "vopd",
              "k3_in_reward", "frpo", "kl_before", "trl_grpo", "verl_low_var_kl"]
PROMPTS = ["the film was", "a slow and", "i liked"]


@pytest.fixture(scope="module")
def llama_pair(tiny_arch):
    """(policy folder, another tiny Llama as pi_ref): pi != pi_ref, so every KL gradient is sizeable."""
    return tiny_arch("llama")


def _cfg(tmp_path, pair, *extra):
    return compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={pair[0]}", f"model.ref_name_or_path={pair[1]}",
                                  "task.prompts_per_step=3", "task.n_samples=4", "task.max_new_tokens=10",
                                  "task.val_prompts=3", *extra])


def _step_grads(task, seed: int) -> tuple[float, list[torch.Tensor]]:
    """One training step's loss and gradient of every trainable parameter (the same rollout for a given seed)."""
    torch.manual_seed(seed)
    loss = task.training_step(PROMPTS, 0)
    params = [p for p in task.policy.trainable()]
    return float(loss), list(torch.autograd.grad(loss, params, allow_unused=True))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_micro_batch_gradient_is_the_full_batch_gradient(tmp_path, llama_pair, estimator):
    # grpo's group statistics and token_mean's batch-wide token count both cross micro-batch boundaries: 12
    # sequences in micro-batches of 5 split every group of 4 but the last
    cfg = _cfg(tmp_path, llama_pair, f"estimator={estimator}", "estimator.beta=0.5", "task.advantage=grpo",
               "task.loss_agg=token_mean")
    validate(cfg)
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    task = build_task(cfg, policy, build_reward(cfg.reward, policy, cfg.dataset))
    task.metrics_read = False  # no trainer attached: nothing is logged
    loss, full = _step_grads(task, seed=3)
    task.cfg["micro_batch_size"] = 5
    loss_m, micro = _step_grads(task, seed=3)
    assert math.isclose(loss, loss_m, rel_tol=1e-5, abs_tol=1e-6)
    norm = torch.sqrt(sum((g ** 2).sum() for g in full if g is not None))
    assert norm > 1e-3  # a real gradient, not a vacuous comparison
    for g, gm in zip(full, micro):
        if g is None:
            assert gm is None
            continue
        assert torch.allclose(g, gm, rtol=1e-4, atol=1e-5 * float(norm)), float((g - gm).abs().max())


@pytest.mark.parametrize("top_p,target", [(0.9, "tempered"), (1.0, "model")])
def test_micro_batch_scores_the_same_batch_without_logits(tmp_path, llama_pair, top_p, target):
    # tempered under top-p and model at T = 0.7: the reward term's log pi_s is not the batch's logp, and at
    # target=model the batch carries old_logp = log pi_s; each is computed per micro-batch
    cfg = _cfg(tmp_path, llama_pair, "task.temperature=0.7", f"task.top_p={top_p}", f"task.kl_target={target}")
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, sampling=task_sampling(cfg.task)[0], kl_target=target)
    torch.manual_seed(0)
    ro = policy.rollout(PROMPTS, 4)
    full, micro = policy.score(ro), policy.score(ro, 5)
    assert isinstance(micro, ScoredBatch) and micro.logits is None  # no [B, T, V] kept
    m = full.mask
    names = ("logp", "ref_logp") + (("old_logp",) if target == "model" else ())
    for name in names:
        assert torch.allclose(getattr(full, name)[m], getattr(micro, name)[m], atol=1e-5), name
    assert torch.allclose(full.kappa[m], micro.kappa[m], atol=1e-5)
    assert torch.allclose(token_entropy(full)[m], token_entropy(micro)[m], atol=1e-5)
    s_full, s_micro = policy.scored_sampler_logp(ro, full), policy.scored_sampler_logp(ro, micro)
    assert not torch.allclose(s_full[m], full.logp[m])
    assert torch.allclose(s_full[m], s_micro[m], atol=1e-5)


def test_a_run_in_micro_batches_trains_as_the_full_batch(tmp_path, llama_pair):
    # the Lightning path end to end: training steps, logging (rb, entropy), validation, with checkpointing too
    common = ["estimator=rb", "estimator.beta=1.0", "task.max_steps=4", "task.val_every=4", "task.log_every=1",
              "logger=csv"]
    full = run_task(_cfg(tmp_path / "a", llama_pair, *common))
    micro = run_task(_cfg(tmp_path / "b", llama_pair, *common, "task.micro_batch_size=5",
                     "model.gradient_checkpointing=true"))
    for key in ("val/seq_kl", "val/reward"):
        assert math.isclose(full[key], micro[key], rel_tol=1e-4, abs_tol=1e-6), (key, full[key], micro[key])
    assert full["val/seq_kl"] > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradient_checkpointing_gives_the_same_gradient(tmp_path, tiny_arch, tiny_lm_dir, arch):
    path = tiny_arch("llama")[0] if arch == "llama" else tiny_lm_dir
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={path}", "estimator=rb", "estimator.beta=1.0",
                                 "task.max_new_tokens=10"])
    grads = []
    for on in (False, True):
        cfg.model.gradient_checkpointing = on
        policy = build_policy(cfg.model, cfg.task.max_new_tokens)
        assert policy.checkpointing == on
        with torch.no_grad():  # pi away from pi_ref, so that rb's gradient is not zero
            for p in policy.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        assert not any(m.training for m in policy.model.modules() if isinstance(m, torch.nn.Dropout))
        torch.manual_seed(1)
        ro = policy.rollout(PROMPTS, 2)
        batch = policy.score(ro)
        from klbench.estimators import gradient_estimator
        loss = gradient_estimator("rb")(batch).mean()
        grads.append(torch.autograd.grad(loss, policy.trainable()))
    for g, gc in zip(*grads):
        assert torch.allclose(g, gc, rtol=1e-5, atol=1e-7)


def test_checkpointing_frees_activations(tmp_path, tiny_arch):
    """With checkpointing, the scoring pass keeps fewer tensors for backward (counted by saved-tensor hooks)."""
    path = tiny_arch("llama")[0]
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={path}", "task.max_new_tokens=10"])
    kept = []
    for on in (False, True):
        cfg.model.gradient_checkpointing = on
        policy = build_policy(cfg.model, cfg.task.max_new_tokens)
        torch.manual_seed(1)
        ro = policy.rollout(PROMPTS, 2)
        n = [0]

        def pack(t):
            n[0] += t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            policy.score(ro)
        kept.append(n[0])
    assert kept[1] < kept[0], kept


@pytest.mark.parametrize("extra,starts", [
    (["task.micro_batch_size=13"], "task.micro_batch_size=13 is larger than a step's batch"),
    (["task.micro_batch_size=4", "estimator=topk_tail"], "estimator=topk_tail reads the full [B, T, V] logits"),
    (["task.micro_batch_size=0"], "task.micro_batch_size"),
])
def test_bad_micro_batch_is_one_line(tmp_path, llama_pair, extra, starts):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(tmp_path, llama_pair, *extra))
    assert str(e.value).startswith(starts) and "\n" not in str(e.value), str(e.value)


def test_micro_batch_and_checkpointing_refused_where_they_cannot_apply(tmp_path, tiny_lm_dir):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(tmp_path, ["experiment=tabular", "task.micro_batch_size=2"]))
    assert str(e.value).startswith("task.micro_batch_size=2: the tabular model")
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(tmp_path, ["task=distill", "reward=none", "estimator.beta=1.0", "model@teacher=hf",
                                        f"teacher.name_or_path={tiny_lm_dir}", "teacher.gradient_checkpointing=true"]))
    assert str(e.value).startswith("teacher.gradient_checkpointing=true")
