"""Prompt datasets (config group `dataset`): embedded review openings, a jsonl file, or an HF dataset."""
from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from klbench.models.prompts_jsonl import read_prompts


def load_prompts(cfg) -> tuple[list[str], list[str]]:
    """(train, val) prompt lists for a `dataset` config."""
    if cfg.source == "embedded":
        from klbench.models.embedded.corpus import embedded_prompts
        return embedded_prompts("train"), embedded_prompts("val")
    if cfg.source == "jsonl":
        return _read_jsonl(cfg.train_path, cfg.field), _read_jsonl(cfg.val_path, cfg.field)
    if cfg.source == "hf":
        return (_read_hf(cfg.name, cfg.train_split, cfg.field, cfg.prompt_words, cfg.max_train),
                _read_hf(cfg.name, cfg.val_split, cfg.field, cfg.prompt_words, cfg.max_val))
    raise ValueError(f"dataset.source must be embedded, jsonl or hf; got {cfg.source!r}")


def check_prompt_lengths(cfg, policy, train: list[str], val: list[str]) -> None:
    """Every prompt the run will use, plus task.max_new_tokens, fits the policy's context (Policy.check_prompts):
    a ValueError naming the dataset's file or split and field, and its longest prompt."""
    for split, prompts in (("train", train), ("val", val)):
        policy.check_prompts(prompts, prompt_source(cfg, split))


def prompt_source(cfg, split: str) -> str:
    """Where a `dataset` config's prompts of one split come from, as a message names it."""
    if cfg.source == "jsonl":
        return f"dataset.{split}_path={cfg[split + '_path']} (field {cfg.field!r})"
    if cfg.source == "hf":
        return (f"dataset.name={cfg.name} (split {cfg[split + '_split']!r}, field {cfg.field!r}, the first "
                f"dataset.prompt_words={cfg.prompt_words} words)")
    return f"dataset={cfg.source} ({split} prompts)"


def _read_jsonl(path: str, field: str) -> list[str]:
    return read_prompts(path, field)  # the reader klbench.config.schema checks the files with


def _read_hf(name: str, split: str, field: str, words: int, limit: int) -> list[str]:
    try:
        import datasets
    except ImportError as e:
        from klbench.config.errors import ConfigError  # one line at the CLI, with the command that fixes it
        raise ConfigError(f"dataset=hf needs the `datasets` package, which cannot be imported ({e}): "
                          "pip install 'klbench[hf]'") from e
    if os.path.isdir(name):  # a dataset saved with save_to_disk: the offline path
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"HF dataset {name!r} has no split {split!r}; splits: {list(ds)}")
            ds = ds[split]
    else:
        ds = datasets.load_dataset(name, split=split)
    if field not in ds.column_names:
        raise ValueError(f"HF dataset {name!r} has no column {field!r} (dataset.field); columns: {ds.column_names}")
    ds = ds.shuffle(seed=0).select(range(min(limit, len(ds))))
    return [" ".join(str(t).split()[:words]) for t in ds[field]]


class PromptData(pl.LightningDataModule):
    """Shuffled train prompts (one batch = prompts of one step) and fixed held-out val prompts."""

    def __init__(self, train: list[str], val: list[str], batch_size: int, val_prompts: int, seed: int = 0):
        super().__init__()
        self.seed = seed
        if len(train) < batch_size:
            raise ValueError(f"{len(train)} train prompts < task.prompts_per_step={batch_size}")
        self.train, self.val = train, val[:val_prompts]
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        # its own generator: shuffling must not draw from the global RNG that sampling uses
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=list,
                          generator=gen)

    def val_dataloader(self) -> DataLoader:
        # its own generator too: every DataLoader iterator draws a base seed, from the global RNG unless
        # given one, and validation must not shift the training samples (runs with other val_every
        # would train differently)
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.val, batch_size=max(1, min(len(self.val), 16)), collate_fn=list, generator=gen)
