"""Issue 53 item 4 and issue 51 items 2, 4: the TRL integration reads the engine's log-probs, refuses a negative beta,
and its reuse advice works when followed literally (klbench/integrations/trl.py, docs/integrations.md).

vLLM is not installable here: the engine's log-probs are injected into the batch as TRL 1.16's GRPOTrainer leaves
them with vLLM (`sampling_per_token_logps`, trl/trainer/grpo_trainer.py:2911), at a known perturbation of the
trainer's own."""
from __future__ import annotations

import re

import pytest
import torch

from klbench.estimators import gradient_estimator
from test_integrations import BETA, PROMPTS, _inputs, _plain_batch, _reward, _trainer


def _perturbation(inputs) -> torch.Tensor:
    """[B, K] a known, token-dependent shift of log pi: the engine's log-probs are log pi + this (exp of it is the
    engine's over-weighting of each sampled token)."""
    ids = inputs["completion_ids"].double()
    return (0.4 * torch.sin(ids) - 0.1).float() * inputs["completion_mask"]


def _kl_grad(trainer, inputs, params):
    return torch.autograd.grad(trainer._compute_loss(trainer.model, inputs), params, allow_unused=True)


def _close(got, want, params, rtol=1e-4):
    scale = max(w.abs().max().item() for w in want if w is not None)
    worst = 0.0
    for p, g, w in zip(params, got, want):
        g = torch.zeros_like(p) if g is None else g
        w = torch.zeros_like(p) if w is None else w
        worst = max(worst, float((g - w).abs().max()) / scale)
    return worst


@pytest.mark.parametrize("behaviour", ["sampler", "scorer"])
def test_rb_takes_the_engines_logprobs_as_its_behaviour_policy(tiny_arch, tmp_path, single_thread, behaviour):
    """The KL gradient equals rb's on the plain batch whose old_logp is the engine's log-probs (kl_behaviour='sampler':
    the batch rb is exact on, docs/mismatch.md), and is far from it when the engine's log-probs are ignored."""
    trainer = _trainer("grpo", tiny_arch("llama"), tmp_path, "rb", bf16=False)
    trainer.kl_behaviour = behaviour  # as GRPOTrainer(kl_behaviour=...) sets it
    inputs = _inputs(trainer)
    plain = _plain_batch(trainer, inputs)
    shift = _perturbation(inputs)
    inputs["sampling_per_token_logps"] = torch.where(plain.mask, plain.logp.detach() + shift, 0.0)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    got = _kl_grad(trainer, inputs, params)

    def want(old_shift):
        b = _plain_batch(trainer, inputs, old_shift)
        return torch.autograd.grad(BETA * gradient_estimator("rb")(b).sum() / b.mask.sum(), params, allow_unused=True)

    engine, scorer = want(shift), want(None)
    assert _close(engine, scorer, params) > 1e-2  # the perturbation moves rb's gradient: the test can tell them apart
    if behaviour == "sampler":
        assert _close(got, engine, params) < 1e-5
    else:  # the engine's log-probs ignored: the on-policy batch, as TRL's own KL term treats it
        assert _close(got, scorer, params) < 1e-5


def test_a_token_vllm_sent_no_logprob_for_gets_the_trainers_recomputation(tiny_arch, tmp_path, single_thread):
    trainer = _trainer("grpo", tiny_arch("llama"), tmp_path, "rb", bf16=False)
    inputs = _inputs(trainer)
    plain = _plain_batch(trainer, inputs)
    engine = torch.where(plain.mask, plain.logp.detach() + _perturbation(inputs), 0.0)
    engine[0, 1] = float("nan")  # vLLM's None, as TRL maps it
    inputs["sampling_per_token_logps"] = engine
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    with pytest.raises(ValueError, match="no log-prob for 1 sampled token"):
        trainer._compute_loss(trainer.model, inputs)
    inputs["old_per_token_logps"] = plain.logp.detach() - 0.05  # TRL's recomputation (with vLLM's ratio on)
    trainer._compute_loss(trainer.model, inputs)
    assert trainer._metrics["train"]["klbench/engine_logp_missing"][-1] == 1.0


def _config(kind, tmp_path, **over):
    pytest.importorskip("trl")
    from trl import GRPOConfig, RLOOConfig
    Config = GRPOConfig if kind == "grpo" else RLOOConfig
    return Config(**{"output_dir": str(tmp_path), "beta": BETA, "num_generations": 2, "per_device_train_batch_size": 4,
                     "report_to": "none", "use_cpu": True, **over})


REFUSED = [  # trainer, estimator, options, kl_behaviour, words the one line must hold
    ("grpo", "rb", {"beta": -0.05}, "sampler", ["args.beta=-0.05", "negative", "'rb'"]),
    ("rloo", "rb", {"beta": -0.05}, "sampler", ["args.beta=-0.05", "negative"]),
    ("grpo", "rb", {"use_vllm": True, "top_p": 0.9}, "sampler", ["top_p=0.9", "kl_behaviour='scorer'"]),
    ("grpo", "rb", {"use_vllm": True, "generation_kwargs": {"top_k": 20}}, "sampler", ["top_k=20"]),
    ("grpo", "seq", {"use_vllm": True}, "sampler", ["'seq'", "sampling_per_token_logps", "kl_behaviour='scorer'"]),
    ("grpo", "rb", {}, "engine", ["kl_behaviour='engine'", "sampler, scorer"]),
]


@pytest.mark.parametrize("kind,estimator,over,behaviour,words", REFUSED,
                         ids=[f"{r[0]}-{r[1]}-{'-'.join(r[2])}-{r[3]}" for r in REFUSED])
def test_refused_in_one_line_before_any_model_loads(tmp_path, kind, estimator, over, behaviour, words):
    from klbench.integrations import trl as integration
    cls = integration.GRPOTrainer if kind == "grpo" else integration.RLOOTrainer
    with pytest.raises(ValueError) as err:
        cls(model=str(tmp_path / "never-loaded"), reward_funcs=_reward, args=_config(kind, tmp_path, **over),
            kl_estimator=estimator, kl_behaviour=behaviour)
    line = str(err.value)
    assert "\n" not in line and all(w in line for w in words), line


def test_scorer_behaviour_lets_a_vllm_run_with_top_p_through(tmp_path):
    from klbench.integrations.trl import refusal
    args = _config("grpo", tmp_path, use_vllm=True, top_p=0.9)
    assert refusal("GRPOTrainer", args, gradient_estimator("rb"), "scorer") is None


@pytest.mark.parametrize("kind,estimator", [("rloo", "rb"), ("grpo", "seq")])
def test_the_reuse_advice_runs_when_followed_literally(tiny_arch, tmp_path, single_thread, kind, estimator):
    """Issue 51 item 4: num_iterations=2 is refused with advice; setting exactly what it names builds the trainer
    and trains a step (TRL ties steps_per_generation to gradient_accumulation_steps, so GA alone never sufficed)."""
    from klbench.integrations import trl as integration
    cls = integration.GRPOTrainer if kind == "grpo" else integration.RLOOTrainer
    with pytest.raises(ValueError) as err:
        cls(model=str(tmp_path / "never-loaded"), reward_funcs=_reward,
            args=_config(kind, tmp_path, num_iterations=2), kl_estimator=estimator)
    advice = re.search(r"set steps_per_generation=(\d+) and gradient_accumulation_steps=(\d+)", str(err.value))
    assert advice, str(err.value)
    spg, ga = map(int, advice.groups())
    trainer = _trainer(kind, tiny_arch("llama"), tmp_path, estimator, num_iterations=2, steps_per_generation=spg,
                       gradient_accumulation_steps=ga, max_steps=1, learning_rate=1e-3)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "klbench/seq_kl" in h]
    assert logs and all(h["klbench/seq_kl"] > 0 for h in logs)


# ---- verl's ppo_loss with the rollout's log-probs ----

def _verl_with_engine(shift: float = 0.3):
    from test_integrations import _verl_call
    config, output, data, batch = _verl_call()
    engine = torch.where(batch.mask, batch.logp.detach() + shift * torch.sin(torch.arange(6.0)).double(), 0.0)
    data["rollout_log_probs"] = engine
    return config, output, data, batch, engine


@pytest.mark.parametrize("behaviour", ["sampler", "scorer"])
def test_verl_takes_the_rollouts_logprobs_as_the_behaviour_policy(behaviour):
    """in_loss (k1 x the per-token ratio) in verl's actor loss: its KL gradient is the plain surrogate's on the batch
    whose old_logp is the rollout's log-probs ('sampler'), or verl's old_log_probs ('scorer')."""
    import dataclasses

    from klbench.estimators import KLBatch
    from klbench.integrations.verl import ppo_loss
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss
    config, output, data, batch, engine = _verl_with_engine()
    loss, _ = ppo_loss("in_loss", kl_behaviour=behaviour)(config, output, data)
    policy, _ = verl_ppo_loss(dataclasses.replace(config, use_kl_loss=False), output, data)
    got = torch.autograd.grad(loss - policy, batch.logp)[0]

    def want(old):
        b = KLBatch(batch.logp, batch.ref_logp, batch.mask, old_logp=torch.where(batch.mask, old, 0.0))
        return torch.autograd.grad(config.kl_loss_coef * gradient_estimator("in_loss")(b).sum() / batch.mask.sum(),
                                   batch.logp)[0]

    on_engine, on_scorer = want(engine), want(data["old_log_probs"])
    assert (on_engine - on_scorer).abs().max() > 1e-2  # the rollout's log-probs move the gradient
    torch.testing.assert_close(got, on_engine if behaviour == "sampler" else on_scorer, rtol=1e-12, atol=1e-12)


def test_verl_refuses_an_on_policy_estimator_on_the_rollouts_logprobs():
    from klbench.integrations.verl import ppo_loss
    config, output, data, _, _ = _verl_with_engine()
    with pytest.raises(ValueError) as err:
        ppo_loss("cumulative")(config, output, data)
    assert "\n" not in str(err.value) and "'cumulative'" in str(err.value) and "kl_behaviour='scorer'" in str(err.value)
    ppo_loss("cumulative", kl_behaviour="scorer")(config, output, data)  # the mismatch invisible: runs
    with pytest.raises(ValueError, match="kl_behaviour='engine' is unknown"):
        ppo_loss("cumulative", kl_behaviour="engine")
