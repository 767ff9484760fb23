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


# ---- instruct-style models of the architectures users fine-tune (tests/test_architectures.py) ----

# a ChatML-like template: BOS first, as Llama's, Gemma's and Mistral's templates write it
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
# every config tiny: 2 layers (Gemma2 alternates sliding and full attention), 4 query heads over 2 KV heads, and
# a sliding window of 8 positions, shorter than a prompt plus its response, where the architecture has one
_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=False)
ARCHITECTURES = {
    "llama": ("LlamaConfig", dict(head_dim=8)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])),
    "mistral": ("MistralConfig", dict(head_dim=8, sliding_window=8)),
    "phi3": ("Phi3Config", dict()),
}


def save_chat_tokenizer(path):
    """Byte-level BPE on the embedded reviews with an instruct model's special tokens: BOS prepended on encode
    (as Llama's tokenizer does), a chat template that writes BOS too, and two ends of text (</s>, <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from klbench.models.embedded.corpus import generate_reviews
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generate_reviews(300, seed=0), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=CHAT_SPECIALS[3:], padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def save_tiny_arch(arch: str, path, seed: int = 0, sharpen: float = 40.0, tokenizer=None, width: int = 32) -> str:
    """A randomly initialised `arch` (a key of ARCHITECTURES) on the chat tokenizer, saved with save_pretrained
    beside it, with a generation_config listing both ends of text (an instruct model's stop-id list). sharpen
    scales the output embeddings (untied everywhere): a fresh init's near-uniform logits made peaked. width: the
    hidden size, the LM head's input."""
    import transformers

    tok = tokenizer or save_chat_tokenizer(path)
    if tokenizer is not None:
        tok.save_pretrained(path)
    name, extra = ARCHITECTURES[arch]
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = getattr(transformers, name)(vocab_size=len(tok), **{**_COMMON, "hidden_size": width}, **extra, **ids)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a fresh init is near uniform: sharper logits, some tokens (EOS among them) frequent
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")])
    model.save_pretrained(path)
    return str(path)
