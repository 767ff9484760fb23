"""klbench's estimators inside TRL 1.16.0's and verl 0.9.1's trainers (klbench/integrations/, docs/integrations.md).

The exact tests compare each integration's KL gradient with the gradient of klbench's own surrogate on the same
batch computed the plain way (full logits, KLBatch(logits=..., ref_logits=...)), so the integrations inherit the
estimators' exact tests (tests/test_tabular.py).
"""
import contextlib

import pytest
import torch

from klbench.estimators import KLBatch, gradient_estimator

BETA, TEMP = 0.1, 0.7
PROMPTS = ["a good movie", "the plot", "I liked", "bad acting"]  # 2 prompts x num_generations 2 in a batch of 4


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(kind, arch_dirs, tmp_path, estimator, peft_config=None, **config):
    """A klbench TRL trainer on a tiny model whose reference is another model of the same vocabulary (at
    pi = pi_ref every KL gradient is zero); with peft_config, a LoRA policy whose reference is its base."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, RLOOConfig

    from klbench.integrations import trl as integration
    cls, Config = (integration.GRPOTrainer, GRPOConfig) if kind == "grpo" else (integration.RLOOTrainer, RLOOConfig)
    policy, teacher = arch_dirs
    args = Config(output_dir=str(tmp_path), beta=BETA, num_generations=2, per_device_train_batch_size=4,
                  max_completion_length=8, temperature=TEMP, report_to="none", use_cpu=True, use_vllm=False,
                  save_strategy="no", logging_steps=1, **config)
    trainer = cls(model=policy, reward_funcs=_reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                  kl_estimator=estimator, peft_config=peft_config)
    if peft_config is None:
        trainer.ref_model.load_state_dict(AutoModelForCausalLM.from_pretrained(teacher).state_dict())
    return trainer


def _inputs(trainer, K=5):
    """A batch as TRL's _generate_and_score_completions leaves it: left-padded prompts, right-padded completions
    with an EOS-inclusive mask, zero advantages (so TRL's policy term has zero gradient), the prompt ids."""
    tok = trainer.processing_class
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    B = len(PROMPTS)
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([K, 3, 1, 4])
    mask = torch.arange(K)[None] < lengths[:, None]  # [B, K]
    ids = torch.randint(10, len(tok), (B, K), generator=g)
    ids[torch.arange(B), lengths - 1] = tok.eos_token_id  # each completion ends with EOS, inside the mask
    ids = torch.where(mask, ids, tok.pad_token_id)
    return dict(prompt_ids=enc.input_ids, prompt_mask=enc.attention_mask, completion_ids=ids,
                completion_mask=mask.long(), advantages=torch.zeros(B), num_items_in_batch=mask.sum().float(),
                old_logps=torch.zeros(B), klbench_group=torch.arange(B) // 2)


def _plain_batch(trainer, inputs, old_shift=None):
    """klbench's KLBatch of the same completions from the models' full logits (transformers' own forward, its
    softcapping included), divided by TRL's temperature."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    K = inputs["completion_ids"].shape[1]
    tokens = inputs["completion_ids"].unsqueeze(-1)
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1] / TEMP  # [B, K, V]
    with torch.no_grad():  # the reference model, or a peft policy's base with the adapter off
        ref, off = (trainer.ref_model, contextlib.nullcontext()) if trainer.ref_model is not None else \
            (trainer.model, trainer.model.disable_adapter())
        with off:
            ref_logits = ref(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1] / TEMP
    logp = logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)
    old = None if old_shift is None else (logp + old_shift).detach()
    return KLBatch(logp, ref_logits.log_softmax(-1).gather(-1, tokens).squeeze(-1),
                   inputs["completion_mask"].bool(), logits=logits, ref_logits=ref_logits,
                   group=inputs["klbench_group"], old_logp=old)


CASES = [  # trainer, architecture, estimator, TRL options
    ("grpo", "llama", "rb", {}),
    ("grpo", "gemma2", "rb", {}),  # Gemma's final-logit softcapping
    ("grpo", "llama", "loo", {}),
    ("grpo", "llama", "vopd", {}),
    ("grpo", "llama", "rb", {"num_iterations": 2}),  # off-policy: TRL's old_per_token_logps as KLBatch.old_logp
    ("rloo", "llama", "rb", {}),
    ("rloo", "llama", "cumulative", {}),
]


@pytest.mark.parametrize("kind,arch,estimator,config", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{len(c[3])}" for c in CASES])
def test_trl_kl_gradient_is_klbench_surrogate_gradient(tiny_arch, tmp_path, single_thread, kind, arch, estimator,
                                                       config):
    from klbench.integrations.trl import lm_head
    trainer = _trainer(kind, tiny_arch(arch), tmp_path, estimator, bf16=False, **config)  # float32 on both sides
    assert trainer.beta == 0 and trainer.kl_beta == BETA  # TRL's own KL term is off
    if arch == "gemma2":
        assert lm_head(trainer.model, 1.0).softcap  # the case exercises the softcap
    inputs = _inputs(trainer)
    shift = None
    if config.get("num_iterations", 1) > 1:  # a batch from an older policy: log pi_old = log pi - 0.3
        shift = -0.3
        inputs["old_per_token_logps"] = (_plain_batch(trainer, inputs).logp - 0.3).detach()
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' training loop
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    loss = trainer._compute_loss(trainer.model, inputs)
    got = torch.autograd.grad(loss, params, allow_unused=True)

    batch = _plain_batch(trainer, inputs, shift)
    surrogate = gradient_estimator(estimator)(batch)
    # GRPO's default loss_type dapo divides by the batch's completion tokens; RLOO's loss is a mean over sequences
    expected = BETA * (surrogate.sum() / batch.mask.sum() if kind == "grpo" else surrogate.mean())
    want = torch.autograd.grad(expected, params, allow_unused=True)

    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    scale = max(w.abs().max().item() for w in want if w is not None)
    assert scale > 1.0  # a KL gradient that is there: pi and pi_ref differ
    for p, g, w in zip(params, got, want):
        g = torch.zeros_like(p) if g is None else g
        w = torch.zeros_like(p) if w is None else w
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)


def test_trl_kl_gradient_with_a_peft_policy(tiny_arch, tmp_path, single_thread):
    """A LoRA policy: TRL loads no reference model, the reference is the base with the adapter off. The
    adapter's gradient is the plain surrogate's."""
    peft = pytest.importorskip("peft")
    trainer = _trainer("grpo", tiny_arch("llama"), tmp_path, "rb", bf16=False,
                       peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert trainer.ref_model is None
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a fresh adapter is the identity (lora_B = 0): move pi away from its base
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    inputs = _inputs(trainer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    got = torch.autograd.grad(trainer._compute_loss(trainer.model, inputs), params)
    batch = _plain_batch(trainer, inputs)
    want = torch.autograd.grad(BETA * gradient_estimator("rb")(batch).sum() / batch.mask.sum(), params)
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0.1
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=1e-4, atol=1e-5 * scale)


def test_grpo_trains_end_to_end_with_rb(tiny_arch, tmp_path, single_thread):
    """TRL's own training loop (generation, rewards, advantages, the optimiser) with rb as the KL term, TRL's
    default bf16 autocast on CPU."""
    trainer = _trainer("grpo", tiny_arch("llama"), tmp_path, "rb", max_steps=3, learning_rate=1e-3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "klbench/seq_kl" in h]
    assert len(logs) == 3
    assert all(torch.isfinite(torch.tensor([h["loss"], h["klbench/seq_kl"]])).all() for h in logs)
    assert all(h["klbench/seq_kl"] > 0 for h in logs)  # pi != pi_ref: the exact KL is positive
    assert "kl" not in logs[0]  # TRL's own KL metric (and term) is off
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "lm_head.weight" in moved and len(moved) > 5


def test_rloo_trains_end_to_end_with_cumulative(tiny_arch, tmp_path, single_thread):
    trainer = _trainer("rloo", tiny_arch("llama"), tmp_path, "cumulative", max_steps=2, learning_rate=1e-3)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "klbench/seq_kl" in h]
    assert len(logs) == 2 and all(h["klbench/seq_kl"] > 0 for h in logs)


REFUSED = [  # trainer, estimator, TRL options, words the one line must hold
    ("grpo", "topk_tail", {}, ["'topk_tail'", "logits"]),
    ("grpo", "topk_trunc", {}, ["'topk_trunc'", "logits"]),
    ("grpo", "seq", {"num_iterations": 2}, ["'seq'", "num_iterations=2", "older policy"]),
    ("rloo", "rb", {"num_iterations": 2}, ["'rb'", "old_logps", "per-token"]),
    ("grpo", "loo", {"gradient_accumulation_steps": 2}, ["'loo'", "steps_per_generation=2", "KLBatch.group"]),
    ("grpo", "rb", {"beta": 0.0}, ["args.beta is 0", "reference"]),
]


@pytest.mark.parametrize("kind,estimator,config,words", REFUSED, ids=[f"{r[0]}-{r[1]}" for r in REFUSED])
def test_trl_refuses_an_estimator_its_batch_cannot_feed(tmp_path, kind, estimator, config, words):
    """One line naming the estimator and what TRL's batch lacks, before any model is loaded (the model path
    does not exist)."""
    pytest.importorskip("trl")
    from trl import GRPOConfig, RLOOConfig

    from klbench.integrations import trl as integration
    cls, Config = (integration.GRPOTrainer, GRPOConfig) if kind == "grpo" else (integration.RLOOTrainer, RLOOConfig)
    config = {"beta": BETA, **config}
    args = Config(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=4, report_to="none",
                  use_cpu=True, **config)
    with pytest.raises(ValueError) as err:
        cls(model=str(tmp_path / "never-loaded"), reward_funcs=_reward, args=args, kl_estimator=estimator)
    line = str(err.value)
    assert "\n" not in line and all(w in line for w in words), line


def test_nothing_in_klbench_imports_the_integrations():
    from test_imports import import_graph
    users = [m for m, targets in import_graph(include_functions=True).items()
             if not m.startswith("klbench.integrations") and any(t.startswith("klbench.integrations") for t in targets)]
    assert not users


# ---- verl ----

def _verl_call(B=4, T=6, agg="token-mean", kl_coef=0.5, seed=0):
    """verl's actor loss input for B sequences of 1 prompt token and up to T response tokens: the flat model
    output [sum (1 + L_i)] as no_padding_2_padding reads it (position p holds log pi of token p + 1), the padded
    TensorDict, an ActorConfig with use_kl_loss=True."""
    pytest.importorskip("verl")
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 3, 1, 5][:B])
    mask = torch.arange(T)[None] < lengths[:, None]  # [B, T]
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()  # [B, T] leaf
    ref = torch.where(mask, -torch.rand(B, T, generator=g, dtype=torch.float64) * 3, 0)
    flat = torch.cat([torch.cat([logp[b, :lengths[b]], logp.new_zeros(1)]) for b in range(B)])  # [sum(1 + L)]
    data = TensorDict({"prompts": torch.zeros(B, 1, dtype=torch.long), "responses": torch.zeros(B, T, dtype=torch.long),
                       "attention_mask": torch.cat([torch.ones(B, 1, dtype=torch.long), mask.long()], 1),
                       "response_mask": mask.long(), "old_log_probs": logp.detach().clone(),
                       "advantages": torch.randn(B, T, generator=g, dtype=torch.float64), "ref_log_prob": ref},
                      batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_kl_loss=True,
                         kl_loss_coef=kl_coef, loss_agg_mode=agg)
    return config, {"log_probs": flat}, data, KLBatch(logp, ref, mask)


@pytest.mark.parametrize("estimator", ["cumulative", "seq", "token", "naive_cv"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_verl_loss_is_verl_policy_loss_plus_klbench_surrogate(estimator, agg):
    import dataclasses

    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    from klbench.integrations.verl import ppo_loss
    config, output, data, batch = _verl_call(agg=agg)
    loss, metrics = ppo_loss(estimator)(config, output, data)
    policy, _ = verl_ppo_loss(dataclasses.replace(config, use_kl_loss=False), output, data)
    got = torch.autograd.grad(loss - policy, batch.logp)[0]  # the KL term's gradient
    # token-mean divides by the mini-batch's tokens, seq-mean-token-sum by its sequences
    denominator = batch.mask.sum() if agg == "token-mean" else batch.mask.shape[0]
    want = torch.autograd.grad(config.kl_loss_coef * gradient_estimator(estimator)(batch).sum() / denominator,
                               batch.logp)[0]
    assert want.abs().max() > 0.01
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert metrics["kl_coef"] == config.kl_loss_coef


@pytest.mark.parametrize("estimator,words", [("rb", ["'rb'", "token_kl", "losses.py:59"]),
                                             ("topk_tail", ["'topk_tail'", "logits"]),
                                             ("loo", ["'loo'", "KLBatch.group"])])
def test_verl_refuses_what_its_actor_loss_lacks(estimator, words):
    pytest.importorskip("verl")
    from klbench.integrations.verl import ppo_loss
    with pytest.raises(ValueError) as err:
        ppo_loss(estimator)
    line = str(err.value)
    assert "\n" not in line and all(w in line for w in words), line


def test_verl_refuses_reuse_for_an_on_policy_estimator():
    import dataclasses

    from klbench.integrations.verl import ppo_loss
    config, output, data, _ = _verl_call()
    with pytest.raises(ValueError, match="'seq'.*ppo_epochs=2"):
        ppo_loss("seq")(dataclasses.replace(config, ppo_epochs=2), output, data)
