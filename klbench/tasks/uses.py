"""What a language-model run uses that no config value says, printed once at its start and logged as MLflow
params (used.*): klbench.tasks.train calls shown_uses after the policy is built."""
from __future__ import annotations

from omegaconf import DictConfig


def shown_uses(cfg: DictConfig, policy) -> dict[str, str]:
    """What a language-model run uses that no config value says, printed once at its start and returned as MLflow
    params (used.*; klbench.analysis.frontier.DERIVED says which config keys they follow): the ids that end a
    response, the chat template's file, LoRA's rank, modules and trainable parameters, and the generation_config
    options the rollouts do not apply. {} for the tabular model."""
    model, tok = getattr(policy, "model", None), getattr(policy, "tok", None)
    if model is None or tok is None:
        return {}
    from klbench.models.hf import unapplied_generation_options
    from klbench.models.lora import is_lora, lora_summary
    stops = ", ".join(f"{i} ({tok.convert_ids_to_tokens(i)})" for i in policy.eos_ids)
    uses = {"used.stop_ids": stops}
    lines = [f"a response ends at the token {stops}" if len(policy.eos_ids) == 1 else
             f"a response ends at any of the tokens {stops}"]
    if cfg.dataset.chat_template:
        from klbench.data.chat import template_source
        uses["used.chat_template"] = template_source(tok)
        lines.append(f"prompts rendered with the chat template {uses['used.chat_template']}")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    uses["used.trainable_params"] = str(trained)
    if is_lora(model):
        lora = lora_summary(model)
        uses.update({"used.lora_rank": str(lora["rank"]), "used.lora_modules": ",".join(lora["modules"])})
        chosen = "model.lora.target_modules" if cfg.model.lora.target_modules else "peft's default"
        lines.append(f"LoRA rank {lora['rank']} (alpha {lora['alpha']:g}) on {', '.join(lora['modules'])} ({chosen}): "
                     f"{trained:,} trainable parameters of {lora['total']:,} ({100 * trained / lora['total']:.2g}%)")
    else:
        lines.append(f"{trained:,} trainable parameters (the whole policy)")
    if unapplied := unapplied_generation_options(model):
        said = ", ".join(f"{k}={v}" for k, v in unapplied.items())
        uses["used.generation_config.unapplied"] = said
        where = cfg.model.name_or_path if cfg.model.kind == "hf" else "the model"
        lines.append(f"{where}'s generation_config sets {said}, which klbench does not apply: its rollouts sample "
                     "with temperature, top_k and top_p only, stop at the ids above, and run task.max_new_tokens")
    for line in lines:
        print(f"klbench: {line}")
    return uses
