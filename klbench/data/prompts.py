"""Prompt datasets (config group `dataset`): embedded review openings, a jsonl file, or an HF dataset."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from klbench.config.errors import ConfigError
from klbench.data.jsonl import check_prompt, read_prompts, read_rows


def load_prompts(cfg, policy=None) -> tuple[list[str], list[str]]:
    """(train, val) prompt lists for a `dataset` config. With dataset.chat_template=true each prompt is rendered
    with the tokenizer of `policy` (an LMPolicy), which from then on tokenizes prompts without adding special
    tokens: the template wrote them (klbench.data.chat)."""
    chat = bool(cfg.chat_template)
    if cfg.source == "embedded":
        from klbench.models.embedded.corpus import embedded_prompts
        train, val = embedded_prompts("train"), embedded_prompts("val")
    elif cfg.source == "jsonl":
        train, val = read_prompts(cfg.train_path, cfg.field, chat), read_prompts(cfg.val_path, cfg.field, chat)
    elif cfg.source == "arith":  # as many fresh problems as asked for; validation from the held-out tenth
        from klbench.models.embedded.arith import arith_prompts
        train, val = arith_prompts("train", cfg.max_train, cfg.digits, cfg.seed), arith_prompts("val", 1024, cfg.digits, 0)
    elif cfg.source == "hf":
        train, val = (_read_hf(cfg.name, cfg.train_split, cfg.field, cfg.prompt_words, cfg.max_train, chat),
                      _read_hf(cfg.name, cfg.val_split, cfg.field, cfg.prompt_words, cfg.max_val, chat))
    else:
        raise ValueError(f"dataset.source must be embedded, jsonl, hf or arith; got {cfg.source!r}")
    if not chat:
        return train, val
    rendered = (_render(cfg, policy, train, "train"), _render(cfg, policy, val, "val"))
    policy.add_special_tokens = False  # the template wrote BOS (where the model has one): never a second
    return rendered


def _render(cfg, policy, prompts: list, split: str) -> list[str]:
    """Prompts (texts or messages) rendered with the chat template of `policy`'s tokenizer (klbench.data.chat)."""
    if getattr(policy, "tok", None) is None:
        raise ConfigError("dataset.chat_template=true needs a language model's tokenizer (model=hf or embedded)")
    from klbench.data.chat import render_prompts
    return render_prompts(policy.tok, prompts, cfg.system_prompt, prompt_source(cfg, split))


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
        words = ("whole texts" if cfg.prompt_words is None
                 else f"the first dataset.prompt_words={cfg.prompt_words} words")
        return f"dataset.name={cfg.name} (split {cfg[split + '_split']!r}, field {cfg.field!r}, {words})"
    return f"dataset={cfg.source} ({split} prompts)"


def load_answers(cfg, policy=None) -> Mapping[str, str]:
    """prompt -> reference answer (reference_answer) of both splits of a `dataset` config
    with dataset.answer_field (reward=answer), keyed by the prompt as the rollout shows it (rendered with
    `policy`'s chat template under dataset.chat_template=true). A row without the field names the file or split,
    the row and the field; one prompt with two different answers is refused."""
    chat = bool(cfg.chat_template)
    if cfg.source == "arith":
        from klbench.models.embedded.arith import ArithAnswers
        return ArithAnswers()
    if cfg.source == "embedded":
        raise ValueError("reward=answer needs prompts with reference answers: dataset=embedded (review openings) "
                         "has none; use dataset=jsonl or dataset=hf with dataset.answer_field, or experiment=arith")
    field = cfg.answer_field  # jsonl and hf only
    if field is None:
        raise ValueError(f"reward=answer needs dataset.answer_field, the field of each row holding the reference "
                         f"answer (dataset={cfg.source})")
    elif cfg.source == "jsonl":
        sources = [(cfg[key], read_rows(cfg[key], cfg.field, field, chat)) for key in ("train_path", "val_path")]
    elif cfg.source == "hf":
        sources = [(f"dataset.name={cfg.name} (split {split!r})",
                    _hf_pairs(cfg.name, split, cfg.field, cfg.prompt_words,
                              cfg.max_val if split == cfg.val_split else cfg.max_train, chat, field))
                   for split in (cfg.train_split, cfg.val_split)]
    else:
        raise ValueError(f"dataset.source must be embedded, jsonl or hf; got {cfg.source!r}")
    for source, rows in sources:
        check_references(rows, source, field)
    pairs = [pa for _, rows in sources for pa in rows]
    if chat:  # the rollout's prompts are the rendered ones
        keys = _render(cfg, policy, [q for q, _ in pairs], "train and val")
        pairs = [(k, a) for k, (_, a) in zip(keys, pairs)]
    out: dict[str, str] = {}
    for prompt, answer in pairs:
        ref = reference_answer(answer)
        if out.setdefault(prompt, ref) != ref:
            raise ValueError(f"the prompt {prompt[:80]!r} appears with two reference answers ({out[prompt]!r}, "
                             f"{ref!r}): reward=answer could not tell which to score against")
    return out


def reference_answer(value) -> str:
    """A dataset's answer field as a reference: the text after GSM8K's last `####` where there is one, else the
    whole value (a number in a jsonl file is read as its text)."""
    s = str(value)
    return s.rsplit("####", 1)[1].strip() if "####" in s else s.strip()


def check_references(pairs: list[tuple[object, object]], source: str, field: str) -> None:
    """A prompt whose reference answer is empty, blank or NaN (JSON's NaN, a missing value in a table turned into
    a dataset) can never score under reward=answer: refused in one line, with how many and the first."""
    empty = [i for i, (_, a) in enumerate(pairs)
             if a is None or (isinstance(a, float) and math.isnan(a)) or not reference_answer(a)]
    if empty:
        first = pairs[empty[0]][0]
        raise ConfigError(f"{source}: {len(empty)} of {len(pairs)} rows have an empty, blank or NaN reference answer "
                          f"in dataset.answer_field={field!r} (the first: row {empty[0] + 1} of the non-blank rows, "
                          f"prompt {str(first)[:60]!r}); reward=answer can never score those prompts: fill in "
                          "their answers or remove the rows")


def _read_hf(name: str, split: str, field: str, words: int | None, limit: int, chat: bool) -> list:
    return [p for p, _ in _hf_pairs(name, split, field, words, limit, chat)]


def _hf_pairs(name: str, split: str, field: str, words: int | None, limit: int, chat: bool,
              answer_field: str | None = None) -> list[tuple[object, object]]:
    """(prompt, answer) of the split's first `limit` rows after a seeded shuffle; text prompts cut to `words`
    words (None: whole), messages (with chat) as they are."""
    try:
        import datasets
    except ImportError as e:
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
    if answer_field is not None:
        if answer_field not in ds.column_names:
            raise ValueError(f"HF dataset {name!r} (split {split!r}) has no column {answer_field!r} "
                             f"(dataset.answer_field); columns: {ds.column_names}")
        for i, a in enumerate(ds[answer_field]):
            if a is None or (isinstance(a, str) and not a.strip()):
                raise ValueError(f"HF dataset {name!r} (split {split!r}) row {i} has no value in field "
                                 f"{answer_field!r} (dataset.answer_field): {a!r}")
    ds = ds.shuffle(seed=0).select(range(min(limit, len(ds))))
    out = []
    for i, value in enumerate(ds[field]):
        if (why := check_prompt(value, chat)) is not None:
            raise ValueError(f"HF dataset {name!r} split {split!r} row {i} (after shuffling): field {field!r} {why}")
        if isinstance(value, list):  # messages
            if words is not None:
                raise ConfigError(f"dataset.prompt_words={words} cuts text prompts, but dataset.field={field} holds "
                                  "messages: set dataset.prompt_words=null")
            out.append(value)
        else:
            out.append(value if words is None else " ".join(value.split()[:words]))
    if answer_field is None:
        return [(p, None) for p in out]
    return list(zip(out, ds[answer_field]))


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
        # a resumed run starts where the checkpoint's step left its epoch (trainer.global_step is restored
        # before the dataloaders are built), so that it draws the prompts the uninterrupted run drew
        step = self.trainer.global_step if self.trainer is not None else 0
        sampler = EpochShuffle(len(self.train), self.batch_size, self.seed, step, *_rank_and_world(self.trainer))
        # a generator of its own for the iterator's base seed too, which would otherwise come from the global RNG
        # that sampling uses (and a resumed run creates its iterator at another point of that stream)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler, drop_last=True, collate_fn=list,
                          generator=torch.Generator().manual_seed(self.seed))

    def val_dataloader(self) -> DataLoader:
        # its own generator too: every DataLoader iterator draws a base seed, from the global RNG unless
        # given one, and validation must not shift the training samples (runs with other val_every
        # would train differently)
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.val, batch_size=max(1, min(len(self.val), 16)), collate_fn=list, generator=gen)


def _rank_and_world(trainer) -> tuple[int, int]:
    """This process's share of each epoch: (rank, ranks) of the data-parallel ranks the sampler splits the prompts
    over (ddp), or (0, 1) in one process and under hardware=fsdp, whose ranks load every batch whole (klbench.tasks.
    sharding.FSDP2Strategy.whole_batches)."""
    if trainer is None or getattr(trainer.strategy, "whole_batches", False):
        return 0, 1
    kwargs = trainer.distributed_sampler_kwargs or {}
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))


class EpochShuffle(torch.utils.data.DistributedSampler):
    """The order DataLoader(shuffle=True, generator=manual_seed(seed)) gives (the same prompts in the same steps as
    before this sampler existed), but computed from (seed, epoch) alone (its own generator: shuffling never draws from the
    global RNG that sampling uses). From `start_step` on: the first epoch it serves skips the batches that
    step had already taken, so a resume mid-epoch continues the uninterrupted run's prompts exactly.
    Lightning calls set_epoch with the (restored) epoch before each pass.

    With `world` ranks (ddp) it serves rank `rank`'s share of each epoch, the one Lightning's DistributedSamplerWrapper
    gave it (every world-th prompt from the rank's own, the order padded from its start to a multiple of world), and
    its skip counts that share's batches. A DistributedSampler only so that Lightning does not wrap it again."""

    def __init__(self, n: int, batch_size: int, seed: int, start_step: int = 0, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.num_replicas = world  # DistributedSampler's name for it, should Lightning read it
        self.share = -(-n // world)  # ceil: the wrapper padded the order to world x share
        per_epoch = self.share // batch_size  # drop_last: full batches only
        self.epoch, self.skip_epoch, self.skip = 0, start_step // per_epoch, (start_step % per_epoch) * batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.share

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch + 1):
            # what one epoch of DataLoader(shuffle=True, generator=gen) drew under Lightning: the iterator's base
            # seed, then the RandomSampler's permutation (Lightning stops at len(), before its empty tail draw)
            torch.empty((), dtype=torch.int64).random_(generator=gen)
            order = torch.randperm(self.n, generator=gen).tolist()
        order = (order + order[:self.share * self.world - self.n])[self.rank::self.world]
        if self.epoch == self.skip_epoch and self.skip:
            order, self.skip = order[self.skip:], 0  # once: the resumed epoch's batches already taken
        return iter(order)
