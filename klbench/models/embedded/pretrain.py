"""Causal-LM pretraining of an embedded GPT-2 on the generated review corpus.

    pretrain(spec, out_dir, progress=True, tokenizer=None) -> metrics dict

One review per row: bos + review + eos, truncated to spec["max_len"], padded on
the right per batch (training needs no left padding: nothing is generated).
Saves model and tokenizer to out_dir with save_pretrained, so the result loads
through klbench.models.hf.load_causal_lm like any hub model. klbench.models.embedded.cache
calls this once per spec and machine; `klbench task=pretrain` is the runner.
"""
from __future__ import annotations

import math
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from klbench.models.embedded.build import build_gpt2, train_tokenizer
from klbench.models.embedded.corpus import generate_reviews
from klbench.models.embedded.spec import complete_spec, tokenizer_spec

HELDOUT_REVIEWS = 512  # a fresh corpus sample for the held-out loss in the metrics


def encode_reviews(texts: list[str], tokenizer, max_len: int) -> list[torch.Tensor]:
    """One LongTensor per review: bos + tokens + eos (the tokenizer adds bos), at most max_len ids."""
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    return [torch.tensor((row + [eos])[:max_len], dtype=torch.long) for row in ids]


def collate(rows: list[torch.Tensor], pad_id: int) -> dict:
    """Right-pad to the longest row of the batch; pad positions are masked out of attention and loss."""
    T = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # [B, T]
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)  # [B, T]; the model shifts labels itself
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


class CausalLMPretrain(L.LightningModule):
    """Next-token cross-entropy with AdamW, linear warmup and cosine decay to lr/10."""

    def __init__(self, model, lr: float, steps: int, warmup: int):
        super().__init__()
        self.model, self.lr, self.steps, self.warmup = model, lr, steps, warmup
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.model.parameters() if p.dim() >= 2]  # no weight decay on biases and LayerNorms
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95))

        def schedule(step):
            if step < self.warmup:
                return (step + 1) / self.warmup
            frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@torch.no_grad()
def heldout_loss(model, rows: list[torch.Tensor], pad_id: int, batch_size: int = 64) -> float:
    """Mean per-token cross-entropy (nats) on rows the model never saw."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i:i + batch_size], pad_id)
        n = int((batch["labels"][:, 1:] != -100).sum())  # predicted tokens in this batch
        total += model(**batch).loss.item() * n
        count += n
    return total / count


def corpus_texts(spec: dict, n: int, seed: int) -> list[str]:
    """n pretraining texts of the spec's corpus: reviews, or arithmetic problems with worked answers."""
    if spec.get("corpus", "reviews") == "arith":
        from klbench.models.embedded.arith import generate_arith
        return generate_arith(n, seed, spec["noise_fraction"], spec["digits"])
    return generate_reviews(n, seed=seed, positive_fraction=spec["positive_fraction"])


def pretrain(spec, out_dir: str, progress: bool = True, tokenizer=None, num_threads: int | None = 1,
             model=None) -> dict:
    """Pretrain an embedded GPT-2 described by `spec` (see klbench.models.embedded.spec) and save it to out_dir.

    tokenizer: the shared embedded tokenizer; when None one is trained from
    tokenizer_spec(spec), identical to the one ensure_embedded_lm caches.
    model: a freshly initialised causal LM to pretrain instead of the spec's GPT-2 (scripts/bench_trl_peer.py's
    Llama); the spec still gives the data, the schedule and vocab_size.
    num_threads: torch intra-op threads while training (restored afterwards).
    The matrices here are tiny, so 1 thread loses little on an idle machine and
    is much faster than 2 on a busy one (docs/embedded.md); results
    agree to float rounding. None: leave as is.
    Returns {"train_loss", "heldout_loss", "time_s", "fit_time_s", "tokens", "tokens_per_s", "n_params", "steps"}.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _pretrain(complete_spec(spec), out_dir, progress, tokenizer, model)
    finally:
        torch.set_num_threads(previous)


def _pretrain(spec: dict, out_dir: str, progress: bool, tokenizer, model=None) -> dict:
    t0 = time.time()
    if tokenizer is None:
        ts = tokenizer_spec(spec)
        tokenizer = train_tokenizer(generate_reviews(ts["corpus_size"], ts["corpus_seed"], ts["positive_fraction"]),
                                    ts["vocab_size"])
    if len(tokenizer) != spec["vocab_size"]:
        raise ValueError(f"pretrain: tokenizer has {len(tokenizer)} tokens but spec vocab_size is {spec['vocab_size']}")
    if spec["max_len"] > spec["n_positions"]:
        raise ValueError(f"pretrain: max_len ({spec['max_len']}) exceeds n_positions ({spec['n_positions']})")

    texts = corpus_texts(spec, spec["corpus_size"], spec["corpus_seed"])
    rows = encode_reviews(texts, tokenizer, spec["max_len"])
    # held-out texts from a seed no training corpus of this spec uses
    held = encode_reviews(corpus_texts(spec, HELDOUT_REVIEWS, 10_000_019 + spec["corpus_seed"]), tokenizer,
                          spec["max_len"])
    pad_id = tokenizer.pad_token_id
    loader = DataLoader(rows, batch_size=spec["batch_size"], shuffle=True, drop_last=True,
                        collate_fn=lambda b: collate(b, pad_id),
                        generator=torch.Generator().manual_seed(spec["seed"]))

    if model is None:
        model = build_gpt2(spec["vocab_size"], spec["n_embd"], spec["n_layer"], spec["n_head"], spec["n_positions"],
                           spec["seed"], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=pad_id)
    module = CausalLMPretrain(model, lr=spec["lr"], steps=spec["steps"], warmup=max(1, spec["steps"] // 20))
    from klbench.console import messages as console
    from klbench.console.progress import StepLines, StepProgressBar, wanted
    console.quiet_transformers()  # its "Writing model shards" bar, at default verbosity
    # the step out of spec["steps"] and the loss: a bar on a terminal, else a line every tenth of the steps
    bar = [StepProgressBar()] if progress and wanted() else []
    lines = [StepLines(f"pretraining the embedded {spec['name']} LM")] if progress and not bar else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=spec["steps"], max_epochs=-1, logger=False,
                        enable_checkpointing=False, callbacks=bar + lines, enable_progress_bar=bool(bar),
                        enable_model_summary=False, gradient_clip_val=1.0, num_sanity_val_steps=0)
    t_fit = time.time()
    trainer.fit(module, loader)
    fit_s = time.time() - t_fit

    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tail = module.losses[-50:]
    tokens = sum(len(r) for r in rows) * (spec["steps"] * spec["batch_size"] / len(rows))  # expected tokens seen
    return {"train_loss": sum(tail) / len(tail), "heldout_loss": heldout_loss(model, held, pad_id),
            "time_s": time.time() - t0, "fit_time_s": fit_s, "tokens": int(tokens), "tokens_per_s": tokens / fit_s,
            "n_params": sum(p.numel() for p in model.parameters()), "steps": spec["steps"],
            "num_threads": torch.get_num_threads()}

