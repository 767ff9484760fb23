"""Tiny GPT-2 variants for tests, built offline and saved with save_pretrained (imported by test modules; a
module of its own because `conftest` names several files here)."""
import torch


def save_sharpened_variant(tokenizer_dir, path, n_embd: int, n_layer: int, seed: int, sharpen: float) -> str:
    """Another GPT-2 on tokenizer_dir's tokenizer, saved next to a copy of it: same vocabulary, other weights.
    A fresh init is near uniform, so its output embeddings are scaled by `sharpen` to make the KL to the
    first model sizeable."""
    from transformers import AutoTokenizer

    from klbench.models.embedded.build import build_gpt2
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    model = build_gpt2(len(tok), n_embd=n_embd, n_layer=n_layer, n_head=2, n_positions=64, seed=seed,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
