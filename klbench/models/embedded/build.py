"""The embedded tokenizer and a fresh GPT-2.

    train_tokenizer(texts, vocab_size) -> PreTrainedTokenizerFast
    build_gpt2(vocab_size, n_embd, n_layer, n_head, n_positions, seed) -> GPT2LMHeadModel

Tokenizer conventions: "<|endoftext|>" (id 0) is both bos and eos, "<|pad|>"
(id 1) is a separate pad token, so masks built from `ids != pad` never hide a
real eos. The tokenizer prepends bos itself (a post-processor), exactly as in
pretraining, so `tok(prompts)` is already in-distribution. padding_side is
"left" for batched generation.
"""
from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"  # also bos: one document separator, as in GPT-2
PAD_TOKEN = "<|pad|>"


def train_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE on `texts`: any string encodes (no unknown token); bos prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 258:
        raise ValueError(f"train_tokenizer: vocab_size must be >= 258 (256 bytes + 2 special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    eos_id = tok.token_to_id(EOS_TOKEN)
    # every sequence starts with bos, in pretraining and at generation time alike
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS_TOKEN} $A", pair=f"{EOS_TOKEN} $A {EOS_TOKEN} $B",
                                                       special_tokens=[(EOS_TOKEN, eos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   padding_side="left")


def build_gpt2(vocab_size: int, n_embd: int, n_layer: int, n_head: int, n_positions: int, seed: int,
               bos_token_id: int = 0, eos_token_id: int = 0, pad_token_id: int = 1) -> GPT2LMHeadModel:
    """A freshly initialised GPT-2 with the embedded tokenizer's special ids (defaults match train_tokenizer)."""
    if n_embd % n_head:
        raise ValueError(f"build_gpt2: n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    config = GPT2Config(vocab_size=vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions,
                        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        # no dropout: a tiny model trained briefly does not overfit, and RL needs
                        # train-mode and eval-mode log-probs to be the same distribution
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)
