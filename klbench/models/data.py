"""Prompt datasets (config group `dataset`): embedded review openings, a jsonl file, or an HF dataset."""
from __future__ import annotations

import os
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from klbench.models.prompts_jsonl import read_prompts, read_rows


def load_prompts(cfg) -> tuple[list[str], list[str]]:
    """(train, val) prompt lists for a `dataset` config."""
    if cfg.source == "embedded":
        from klbench.models.embedded.corpus import embedded_prompts
        return embedded_prompts("train"), embedded_prompts("val")
    if cfg.source == "jsonl":
        return _read_jsonl(cfg.train_path, cfg.field), _read_jsonl(cfg.val_path, cfg.field)
    if cfg.source == "arith":  # as many fresh problems as asked for; validation from the held-out tenth
        from klbench.models.embedded.arith import arith_prompts
        return arith_prompts("train", cfg.max_train, cfg.digits, cfg.seed), arith_prompts("val", 1024, cfg.digits, 0)
    if cfg.source == "hf":
        return (_read_hf(cfg.name, cfg.train_split, cfg.field, cfg.prompt_words, cfg.max_train),
                _read_hf(cfg.name, cfg.val_split, cfg.field, cfg.prompt_words, cfg.max_val))
    raise ValueError(f"dataset.source must be embedded, jsonl, hf or arith; got {cfg.source!r}")


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


def load_answers(cfg) -> Mapping[str, str]:
    """prompt -> reference answer (klbench.models.answer.reference_answer) of both splits of a `dataset` config
    with dataset.answer_field (reward=answer). A row without the field names the file or split, the row and the
    field; one prompt with two different answers is refused."""
    from klbench.models.answer import reference_answer
    field = cfg.get("answer_field")
    if cfg.source == "arith":
        from klbench.models.embedded.arith import ArithAnswers
        return ArithAnswers()
    if cfg.source == "embedded":
        raise ValueError("reward=answer needs prompts with reference answers: dataset=embedded (review openings) "
                         "has none; use dataset=jsonl or dataset=hf with dataset.answer_field, or experiment=arith")
    if field is None:
        raise ValueError(f"reward=answer needs dataset.answer_field, the field of each row holding the reference "
                         f"answer (dataset={cfg.source})")
    elif cfg.source == "jsonl":
        pairs = [pa for key in ("train_path", "val_path") for pa in read_rows(cfg[key], cfg.field, field)]
    elif cfg.source == "hf":
        pairs = [pa for split in (cfg.train_split, cfg.val_split)
                 for pa in _hf_pairs(cfg.name, split, cfg.field, cfg.prompt_words, cfg.max_val if split ==
                                     cfg.val_split else cfg.max_train, field)]
    else:
        raise ValueError(f"dataset.source must be embedded, jsonl or hf; got {cfg.source!r}")
    out: dict[str, str] = {}
    for prompt, answer in pairs:
        ref = reference_answer(answer)
        if out.setdefault(prompt, ref) != ref:
            raise ValueError(f"the prompt {prompt[:80]!r} appears with two reference answers ({out[prompt]!r}, "
                             f"{ref!r}): reward=answer could not tell which to score against")
    return out


def _read_hf(name: str, split: str, field: str, words: int, limit: int) -> list[str]:
    return [p for p, _ in _hf_pairs(name, split, field, words, limit)]


def _hf_pairs(name: str, split: str, field: str, words: int, limit: int,
              answer_field: str | None = None) -> list[tuple[str, object]]:
    """(prompt, answer) of the split's first `limit` rows after a seeded shuffle; prompts cut to `words` words."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError("dataset=hf needs the `datasets` package: pip install 'klbench[hf]'") from e
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
    if answer_field is not None:
        if answer_field not in ds.column_names:
            raise ValueError(f"HF dataset {name!r} (split {split!r}) has no column {answer_field!r} "
                             f"(dataset.answer_field); columns: {ds.column_names}")
        for i, a in enumerate(ds[answer_field]):
            if a is None or (isinstance(a, str) and not a.strip()):
                raise ValueError(f"HF dataset {name!r} (split {split!r}) row {i} has no value in field "
                                 f"{answer_field!r} (dataset.answer_field): {a!r}")
    ds = ds.shuffle(seed=0).select(range(min(limit, len(ds))))
    prompts = [" ".join(str(t).split()[:words]) for t in ds[field]]
    if answer_field is None:
        return [(p, None) for p in prompts]
    return list(zip(prompts, ds[answer_field]))


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
