"""One LM-head product for TRL's loss and klbench's KL term (klbench.integrations.trl, issue 51's speed item).

TRL 1.16.0's GRPO and RLOO losses score the policy through a fused LM head (trl/trainer/utils.py,
add_fused_lm_head: `model(..., labels=..., fused_lm_head=True)` returns per-token log-probs and the entropy). The KL
term then needs log pi, log pi_ref and the exact per-position KL kappa, which klbench.estimators.head_scores gives
from the final hidden states. Run side by side, the policy's [N, H] x [H, V] head product runs twice, forward and
backward. `OneHead` replaces the policy's fused forward for the duration of TRL's loss: it runs the backbone, then
head_scores once over TRL's labelled positions, and hands TRL the log-probs and entropy it asked for; the same call
gives klbench log pi_ref and kappa. TRL's loss and the KL term then backpropagate through one head product.

Where TRL's head would round otherwise than head_scores (a bf16 or autocast product; head_scores multiplies in
float32 so that a small kappa survives), TRL's log-probs would change: `refusal` says why, and the integration
keeps TRL's head and a second product beside it (klbench.integrations.trl, the two-head path).
"""
from __future__ import annotations

import contextlib

import torch

from klbench.estimators.head_scores import LMHead, head_scores


def refusal(bare, args) -> str | None:
    """Why TRL's own head must run for `bare` (the transformers model under the wrappers) under TRL config `args`, or
    None where OneHead can stand in for it with TRL's log-probs unchanged."""
    if "forward" not in vars(bare):
        return "the policy's forward is not TRL's fused one (add_fused_lm_head sets it on the instance)"
    if bare.config.get_text_config() is not bare.config:
        return "a vision-language model: TRL's fused forward runs its own backbone attribute"
    if getattr(bare.config, "output_router_logits", False):
        return "a mixture-of-experts model: TRL's fused forward adds the router's load-balancing loss"
    fp32 = getattr(args, "cast_lm_head_to_fp32", False)
    if not fp32 and (bare.get_output_embeddings().weight.dtype != torch.float32 or args.bf16 or args.fp16):
        return ("TRL's head multiplies in bf16/fp16 here and head_scores in float32 (a small kappa needs it): one "
                "product cannot give both; cast_lm_head_to_fp32=True makes TRL's head float32 too")
    return None


class OneHead:
    """`with OneHead(bare, head, h_ref, ref_head, fp32):` TRL's calls of bare's fused forward score through
    head_scores; afterwards `scores` holds (label mask [B, L-1] bool, log pi, log pi_ref, kappa [B, L-1] each, 0 off
    the mask), position t scoring token t + 1 as TRL's log-probs do.

    head, ref_head: the policy's and the reference's LMHead at TRL's temperature (klbench.integrations.trl.lm_head);
    h_ref [B, L, H]: the reference's final hidden states on the same ids, without gradient; fp32: TRL's
    cast_lm_head_to_fp32 (its head then runs in float32 outside autocast, and so does this one)."""

    def __init__(self, bare, head: LMHead, h_ref: torch.Tensor, ref_head: LMHead, fp32: bool = False):
        self.bare, self.head, self.h_ref, self.ref_head, self.fp32 = bare, head, h_ref, ref_head, fp32
        self.scores: tuple[torch.Tensor, ...] | None = None

    def __enter__(self) -> "OneHead":
        self.saved = vars(self.bare)["forward"]  # TRL's fused forward (refusal checked that it is there)
        self.bare.forward = self.forward  # nn.Module.__call__ reads the instance's attribute
        return self

    def __exit__(self, *exc) -> None:
        self.bare.forward = self.saved

    def forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        from trl.trainer.utils import FusedCausalLMOutput
        if not fused_lm_head or labels is None or shift_labels is not None or self.scores is not None:
            # TRL 1.16.0's losses make one labelled call over the whole micro-batch (no context parallelism): any
            # other call would need rows of h_ref this object does not hold
            raise RuntimeError("klbench.integrations.trl: TRL's loss called the policy otherwise than once with "
                               "labels=... and fused_lm_head=True; the one-head path cannot serve that call")
        kwargs["use_cache"] = False  # as TRL's fused forward
        hidden = self.bare.base_model(*args, **kwargs).last_hidden_state[:, :-1]  # [B, L-1, H]
        labels = labels[:, 1:]
        mask = labels != -100  # [B, L-1]: the completion's tokens (TRL masks the prompt and the padding)
        h, h_ref = hidden[mask], self.h_ref[:, :-1][mask]  # [N, H] each
        ctx = torch.autocast(h.device.type, enabled=False) if self.fp32 else contextlib.nullcontext()
        with ctx:
            if self.fp32:
                h, h_ref = h.float(), h_ref.float()
            s = head_scores(h, self.head, labels[mask], h_ref, self.ref_head, with_token_kl=True, with_entropy=True)

        def spread(x: torch.Tensor) -> torch.Tensor:  # [N] -> [B, L-1], 0 off the mask, differentiable in x
            return x.new_zeros(mask.shape).masked_scatter(mask, x)

        logp, entropy = spread(s.logp), spread(s.entropy)
        self.scores = (mask, logp, spread(s.ref_logp), spread(s.kappa))
        loss = -logp.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, log_probs=logp, entropy=entropy, label_mask=mask)
