"""klbench's KL term inside TRL runs the policy's LM head once (issue 51, speed): TRL's fused head is replaced, for
the loss, by one head_scores call that hands TRL its log-probs and entropy and klbench log pi_ref and kappa
(klbench/integrations/trl_head.py). The loss and every gradient are those of the two-product path (TRL's head, then
head_scores beside it), with TRL's policy term live (non-zero advantages)."""
import pytest
import torch
from test_integrations import BETA, _inputs, _trainer


def _loss_and_grads(trainer, inputs, one_head: bool, monkeypatch):
    import trl.trainer.utils as trl_utils

    from klbench.integrations import trl_head
    calls = []  # TRL's own head product: one per forward through its fused head
    real = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", lambda *a: calls.append(1) or real(*a))
    if not one_head:  # the two-product path, as before (and as under bf16)
        monkeypatch.setattr(trl_head, "refusal", lambda bare, args: "off for the comparison")
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    monkeypatch.undo()
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)], len(calls), metrics


@pytest.mark.parametrize("kind,arch,lora", [("grpo", "llama", False), ("grpo", "gemma2", False),
                                           ("rloo", "llama", False), ("grpo", "llama", True)])
def test_one_head_product_gives_the_two_product_loss_and_gradient(tiny_arch, tmp_path, single_thread, monkeypatch,
                                                                  kind, arch, lora):
    # lora: a peft policy whose reference is its base with the adapter off (TRL's fused forward sits under peft's)
    peft_config = None
    if lora:
        peft = pytest.importorskip("peft")
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = _trainer(kind, tiny_arch(arch), tmp_path, "rb", peft_config, bf16=False)  # float32: both heads agree
    if lora:
        with torch.no_grad():  # LoRA's B starts at zero: move it, so that pi and its base differ
            for n, p in trainer.model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.3 * torch.randn_like(p))
    inputs = _inputs(trainer)
    inputs["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])  # TRL's policy term has a gradient too
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    loss1, g1, calls1, m1 = _loss_and_grads(trainer, inputs, True, monkeypatch)
    loss2, g2, calls2, m2 = _loss_and_grads(trainer, inputs, False, monkeypatch)
    assert (calls1, calls2) == (0, 1)  # TRL's head product does not run in the one-head path
    assert loss1.item() == pytest.approx(loss2.item(), rel=1e-5, abs=1e-7)
    scale = max(g.abs().max().item() for g in g2)
    assert scale > 0.1
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)
    for key in ("klbench/seq_kl", "entropy"):  # TRL's entropy comes from head_scores' in the one-head path
        if key in m2:
            assert m1[key] == pytest.approx(m2[key], rel=1e-4), key


def test_bf16_keeps_trl_s_head(tiny_arch, tmp_path):
    """TRL's head multiplies in bf16 under bf16=True and head_scores in float32: one product cannot give both, so the
    integration keeps TRL's head (TRL's log-probs unchanged) and says why."""
    from klbench.integrations import trl_head
    trainer = _trainer("grpo", tiny_arch("llama"), tmp_path, "rb", bf16=True)
    bare = trainer._bare(trainer.model)
    assert "bf16" in trl_head.refusal(bare, trainer.args)
    trainer.args.bf16 = False
    assert trl_head.refusal(bare, trainer.args) is None
