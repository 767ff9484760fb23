"""Sequence-level rewards: a rollout in, one float per sampled response out.

    reward(rollout) -> [B]                  what the RL task calls (klbench.models.interface.Rollout)
    VaderReward().score_texts(texts) -> [B] VADER compound score in [-1, 1] (offline, the embedded default)
    HFClassifierReward(name_or_path, label).score_texts(texts) -> [B] raw logit (or probability) of `label`
    klbench.exact.tabular.TabularReward           a reward table over the tabular model's sequences (rollout.seq_ids)
    klbench.rewards.answer.AnswerReward            1 for a correct final answer (reward=answer, verifiable)

The paper's RLHF reward is the raw logit of the POSITIVE class of
lvwerra/distilbert-imdb; HFClassifierReward(..., score="logit") is exactly that.
"""
from __future__ import annotations

import inspect

import torch


class TextReward:
    """A reward of the decoded responses: `reward(ro)` scores `ro.texts` with `score_texts`."""

    def __call__(self, ro) -> torch.Tensor:
        return self.score_texts(ro.texts)

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        raise NotImplementedError


class VaderReward(TextReward):
    """VADER compound sentiment: a lexicon and rules, no model download, cheap per text (docs/embedded.md)."""

    def __init__(self):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        if isinstance(texts, str):
            raise TypeError("VaderReward expects a list of texts, got a single str")
        scores = [self.analyzer.polarity_scores(t)["compound"] for t in texts]
        return torch.tensor(scores, dtype=torch.float32)  # [B]


class HFClassifierReward(TextReward):
    """A Hugging Face sequence classifier as reward.

    label: a name from model.config.id2label (e.g. "POSITIVE") or a class index.
    score: "logit" (default; the raw logit of `label`, as in the paper) or "prob"
    (softmax probability of `label`, bounded in [0, 1]).
    Loading follows klbench.models.hf.load_causal_lm: a missing local path or, under
    HF_HUB_OFFLINE=1, an uncached hub id raises FileNotFoundError at once.
    """

    def __init__(self, name_or_path: str, label: str | int, batch_size: int = 32, device: str = "cpu",
                 score: str = "logit", max_length: int = 512):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from klbench.models.hf import _from_pretrained, resolve_pretrained

        if score not in ("logit", "prob"):
            raise ValueError(f"HFClassifierReward: score must be 'logit' or 'prob', got {score!r}")
        resolve_pretrained(name_or_path, "reward.name_or_path")  # a missing or empty folder, before any loading
        self.tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path,
                                          "reward.name_or_path (tokenizer)")
        self.model = _from_pretrained(AutoModelForSequenceClassification.from_pretrained, name_or_path,
                                      "reward.name_or_path (classifier)").to(device).eval()
        self.forward_args = set(inspect.signature(self.model.forward).parameters)
        self.label_id = self._label_id(label, self.model.config.id2label, name_or_path)
        self.batch_size, self.device, self.score, self.max_length = batch_size, device, score, max_length

    @staticmethod
    def _label_id(label, id2label: dict, name: str) -> int:
        id2label = {int(k): v for k, v in id2label.items()}
        if isinstance(label, bool):
            raise ValueError(f"HFClassifierReward: label must be a name or an index, got {label!r}")
        if isinstance(label, int):
            if label in id2label:
                return label
        else:
            matches = [i for i, name_i in id2label.items() if name_i == label]
            if matches:
                return matches[0]
        raise ValueError(f"HFClassifierReward: label {label!r} is not a class of {name!r}; "
                         f"model.config.id2label = {id2label}")

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> torch.Tensor:
        if isinstance(texts, str):
            raise TypeError("HFClassifierReward expects a list of texts, got a single str")
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            # a tokenizer may emit inputs this architecture has no use for (DistilBERT: token_type_ids)
            enc = {k: v for k, v in enc.items() if k in self.forward_args}
            logits = self.model(**enc).logits.float()  # [b, C]
            if self.score == "logit":
                out.append(logits[:, self.label_id])
            else:
                out.append(torch.softmax(logits, -1)[:, self.label_id])
        if not out:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat(out).cpu()  # [B]


def build_reward(cfg, policy, dataset=None):
    """The `reward` group: vader, hf_classifier, tabular (needs the tabular policy's model), answer (needs the
    `dataset` config whose rows hold the reference answers: klbench.rewards.answer) or none."""
    if cfg.kind == "none":
        return None
    if cfg.kind == "answer":
        from klbench.rewards.answer import AnswerReward
        from klbench.data.prompts import load_answers
        if dataset is None:
            raise ValueError("reward=answer needs the dataset config, whose answer field holds the references")
        return AnswerReward(load_answers(dataset, policy), cfg.extract, cfg.pattern, cfg.format_reward)
    if cfg.kind == "tabular":
        from klbench.exact.tabular import TabularReward
        return TabularReward(policy.table, seed=cfg.seed, scale=cfg.scale)
    if cfg.kind == "vader":
        return VaderReward()
    if cfg.kind == "hf_classifier":
        return HFClassifierReward(cfg.name_or_path, cfg.label, batch_size=cfg.batch_size, score=cfg.score)
    raise ValueError(f"reward.kind must be vader, hf_classifier, tabular, answer or none; got {cfg.kind!r}")
