"""Policies the RL and distillation modules drive: rollout (sample) and score (build a KLBatch).

LMPolicy wraps any AutoModelForCausalLM pair (policy, frozen reference); TabularPolicy wraps the
enumerable tabular model so that the same Lightning module runs against exact ground truth.
Sampling is always plain ancestral sampling at temperature 1 (no top-k/top-p): every estimator
assumes y ~ pi exactly, and a truncated sampler would bias all of them.

What is special about the tabular model lives here, behind the `Policy` interface: the tasks, the
probe and the sweeps ask a policy for its prompt and its ground truth, never for its type.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from klbench.models.embedded import ensure_embedded_lm, preset_spec
from klbench.estimators import KLBatch
from klbench.config.errors import ConfigError
from klbench.exact.tabular import Frontier, TabularModel, TabularReward
from klbench.models import gpt2_decode
from klbench.models.gpt2_score import gpt2_logits, sdpa_mask
from klbench.models.rollout import SAMPLERS, Sampler, attention_backends, position_ids_from_mask



@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, P + L] left-padded prompt then response (LM) or [B, T] (tabular)
    attention: torch.Tensor  # [B, P + L] 1 on real prompt tokens and real response tokens
    prompt_len: int  # P
    mask: torch.Tensor  # [B, L] bool, response tokens up to and including the first EOS
    group: torch.Tensor  # [B] prompt index: the n samples of one prompt share it
    texts: list[str]  # decoded responses
    prompts: list[str]
    seq_ids: torch.Tensor | None = None  # [B] tabular sequence ids
    sample_logp: torch.Tensor | None = None  # [B, L] log-probs of the sampling logits, where the sampler keeps them


def response_mask(resp: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, L] True up to and including the first EOS; everything after it is padding."""
    is_eos = (resp == eos_id).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


class Policy(nn.Module):
    """pi, trained, and pi_ref, frozen. Subclasses implement rollout, score, trainable, device and reference;
    a policy whose truth is computable (the tabular model) also overrides the exact_* methods."""

    # a policy that ignores prompts names the one prompt its batches repeat (they only set the batch
    # shape); None: prompts come from the `dataset` group
    fixed_prompt: str | None = None

    def rollout(self, prompts: list[str], n: int) -> Rollout:
        """n samples y ~ pi per prompt, ancestral at temperature 1."""
        raise NotImplementedError

    def score(self, ro: Rollout) -> KLBatch:
        """log pi and log pi_ref (and their logits where the model gives them) of a rollout's responses."""
        raise NotImplementedError

    def trainable(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def check_prompts(self, prompts: list[str], source: str) -> None:
        """ValueError, naming `source` (the dataset field or file), for prompts this policy cannot complete;
        a policy that ignores prompts accepts all."""

    def reference(self) -> "Policy":
        """A policy of the same kind whose rollouts sample from pi_ref (the probe's baseline)."""
        raise NotImplementedError

    def exact_metrics(self, reward=None) -> dict[str, float]:
        """The ground truth at the current parameters, where it is computable: seq_kl (kl_pi_ref), kl_ref_pi,
        and with a reward the policy can enumerate, reward and frontier_gap. {} where it is not."""
        return {}

    def exact_frontier(self, reward):
        """The exact optimal reward-vs-kl_pi_ref frontier (a klbench.exact.tabular.Frontier), or None."""
        return None

    def exact_gradients(self) -> dict[str, torch.Tensor] | None:
        """Exact gradients of kl_pi_ref, kl_ref_pi and the partial gradients (klbench.exact.tabular), or None."""
        return None


class LMPolicy(Policy):
    """sampler: how rollouts are drawn (klbench.models.rollout); the KV-cache loop by default."""

    def __init__(self, model, ref_model, tokenizer, max_new_tokens: int, sampler: Sampler | str = "kv_cache"):
        super().__init__()
        self.model, self.ref, self.tok = model, ref_model, tokenizer
        self.ref.requires_grad_(False)
        self.max_new_tokens = max_new_tokens
        if isinstance(sampler, str) and sampler not in SAMPLERS:
            raise ValueError(f"LMPolicy: sampler must be one of {sorted(SAMPLERS)} or a Sampler, got {sampler!r}")
        self.sampler = SAMPLERS[sampler] if isinstance(sampler, str) else sampler
        from klbench.models.hf import context_length  # the models are loaded: transformers is imported already
        # (attribute, positions) of the shorter context of the two: both read prompt + response
        contexts = [c for c in (context_length(model.config), context_length(ref_model.config)) if c]
        self.context = min(contexts, key=lambda c: c[1]) if contexts else None
        self.train()

    def train(self, mode: bool = True) -> "LMPolicy":
        # dropout stays off in training too: the log-probs we differentiate must be those of the very
        # distribution the samples came from, or every estimator is biased (TRL and verl do the same)
        super().train(mode)
        self.model.eval()
        self.ref.eval()
        return self

    @torch.no_grad()
    def rollout(self, prompts: list[str], n: int) -> Rollout:
        enc = self.tok(prompts, return_tensors="pt", padding=True).to(self.device)
        if self.context and enc.input_ids.shape[1] + self.max_new_tokens > self.context[1]:
            # past the context GPT-2's position embedding fails with a bare IndexError; prompts from the
            # `dataset` group were checked when loaded (check_prompts), this catches the others (task=probe)
            longest = int(enc.attention_mask.sum(1).argmax())
            raise ConfigError(_too_long(f"prompt {_preview(prompts[longest])}", enc.input_ids.shape[1],
                                       self.max_new_tokens, self.context))
        ids = enc.input_ids.repeat_interleave(n, 0)  # [B*n, P]
        attn = enc.attention_mask.repeat_interleave(n, 0)  # [B*n, P]
        s = self.sampler(self.model, ids, attn, self.max_new_tokens, self.tok.eos_token_id, self.tok.pad_token_id)
        resp = s.tokens  # [B*n, L]
        mask = response_mask(resp, self.tok.eos_token_id)
        texts = self.tok.batch_decode(torch.where(mask, resp, self.tok.pad_token_id), skip_special_tokens=True)
        group = torch.arange(len(prompts), device=ids.device).repeat_interleave(n)
        return Rollout(torch.cat([ids, resp], 1), torch.cat([attn, mask.long()], 1), ids.shape[1], mask, group, texts,
                       [p for p in prompts for _ in range(n)], sample_logp=s.logp)

    @staticmethod
    def _logits(model, ro: Rollout, pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[B, L, V] next-token logits at the response positions (P - 1 ... P + L - 2)."""
        L = ro.mask.shape[1]
        # the LM head projects the last L + 1 positions only, not the prompt's (the same bits where it runs);
        # a model that ignores logits_to_keep returns all positions, and the slice from the end still holds
        if gpt2_decode.unsupported(model) is None:  # a plain GPT-2: the same bits without transformers' layers
            logits = gpt2_logits(model, ro.tokens, pos, L + 1, mask)
        else:
            logits = model(input_ids=ro.tokens, attention_mask=ro.attention, position_ids=pos,
                           logits_to_keep=L + 1).logits
        return logits[:, -(L + 1): -1]

    def score(self, ro: Rollout) -> KLBatch:
        # left padding: positions count real tokens only, as the sampler did; once for both models
        pos = position_ids_from_mask(ro.attention)  # [B, P + L]
        mask = sdpa_mask(ro.attention)  # [B, 1, P + L, P + L] or None: for a plain GPT-2 (gpt2_score.py)
        with attention_backends(pos.device):  # a new [B, P + L] every step: no cuDNN planning on CUDA
            logits = self._logits(self.model, ro, pos, mask)  # [B, L, V], differentiable
            with torch.no_grad():
                ref_logits = self._logits(self.ref, ro, pos, mask)  # [B, L, V]
        resp = ro.tokens[:, ro.prompt_len:].unsqueeze(-1)  # [B, L, 1]
        logp = _token_logprob(logits, resp)
        ref_logp = _token_logprob(ref_logits, resp)
        return KLBatch(logp, ref_logp, ro.mask, logits, ref_logits, group=ro.group)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def check_prompts(self, prompts: list[str], source: str) -> None:
        """The longest prompt, tokenized as rollout() does, plus max_new_tokens fits the models' context."""
        if self.context is None or not prompts:
            return
        lengths = [len(ids) for ids in self.tok(prompts).input_ids]
        i = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[i] + self.max_new_tokens > self.context[1]:
            raise ConfigError(f"{source}: " + _too_long(f"its longest prompt (#{i + 1}: {_preview(prompts[i])})",
                                                       lengths[i], self.max_new_tokens, self.context))

    def reference(self) -> "LMPolicy":
        return LMPolicy(self.ref, self.ref, self.tok, self.max_new_tokens, self.sampler)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _preview(text: str, chars: int = 60) -> str:
    return repr(text[:chars]) + ("..." if len(text) > chars else "")


def _too_long(what: str, prompt_tokens: int, max_new_tokens: int, context: tuple[str, int]) -> str:
    key, n = context
    return (f"{what} has {prompt_tokens} tokens; with task.max_new_tokens={max_new_tokens} a sequence needs "
            f"{prompt_tokens + max_new_tokens} positions, more than the model's context ({key}={n}): keep prompts "
            f"to at most {n - max_new_tokens} tokens or lower task.max_new_tokens")


def _token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, L] log softmax(logits)[token] in float32 without keeping a [B, L, V] log_softmax for backward."""
    logits = logits.float()
    return logits.gather(-1, tokens).squeeze(-1) - torch.logsumexp(logits, -1)


class TabularPolicy(Policy):
    """Logit table [P, K] in float64, starting at pi_ref (or `start`); prompts are ignored (one implicit prompt).

    Everything is enumerable here, so the exact_* methods give the truth that sampled estimates are judged by.
    """

    fixed_prompt = "<tabular>"

    def __init__(self, model: TabularModel, start: torch.Tensor | None = None):
        super().__init__()
        self.table = model
        self.theta = nn.Parameter((model.ref_logits if start is None else start).clone())  # [P, K]
        self._frontier = None  # (reward table, its Frontier): traced once, read at every validation

    @torch.no_grad()
    def rollout(self, prompts: list[str], n: int) -> Rollout:
        probs = self.table.seq_logprob(self.theta).exp()  # [N]
        ids = torch.multinomial(probs, len(prompts) * n, replacement=True)  # [B*n]
        tokens = self.table.tokens[ids]
        mask = self.table.mask[ids]
        # lists first: iterating tensors element by element costs more than the whole training step
        texts = [" ".join(str(v) for v, m in zip(row, keep) if m) for row, keep in zip(tokens.tolist(), mask.tolist())]
        group = torch.arange(len(prompts)).repeat_interleave(n)
        return Rollout(tokens, mask.long(), 0, mask, group, texts, [p for p in prompts for _ in range(n)], ids)

    def score(self, ro: Rollout) -> KLBatch:
        batch = self.table.batch(self.theta, ro.seq_ids, group=ro.group)
        # the exact per-position KL in one block: its [B, T, K] logits exist whole already, and the default
        # chunking (2^20 / K rows) would fall back to a Python loop over sequences past 2^18 rows at K = 4
        # (what that cost: docs/estimators.md, "Small vocabularies")
        batch.chunk_rows = max(1, batch.mask.numel())
        return batch

    def trainable(self) -> list[nn.Parameter]:
        return [self.theta]

    def reference(self) -> "TabularPolicy":
        return TabularPolicy(self.table, self.table.ref_logits)

    @property
    def device(self) -> torch.device:
        return self.theta.device

    @torch.no_grad()
    def exact_metrics(self, reward=None) -> dict[str, float]:
        theta = self.theta.detach()
        kl = float(self.table.kl_pi_ref(theta))
        out = {"seq_kl": kl, "kl_ref_pi": float(self.table.kl_ref_pi(theta))}
        frontier = self.exact_frontier(reward)
        if frontier is not None:
            r = float(self.table.expected_reward(theta, reward.table))
            out.update({"reward": r, "frontier_gap": frontier.reward_gap(r, kl)})
        return out

    def exact_frontier(self, reward) -> Frontier | None:
        if not isinstance(reward, TabularReward):  # no reward, or one that cannot be enumerated
            return None
        if self._frontier is None or self._frontier[0] is not reward.table:
            self._frontier = (reward.table, self.table.pareto_frontier(reward.table))
        return self._frontier[1]

    def exact_gradients(self) -> dict[str, torch.Tensor]:
        return self.table.exact_gradients(self.theta.detach())


def build_policy(cfg, max_new_tokens: int, cache_root: str | None = None, teacher=None) -> Policy:
    """The `model` group: tabular, the embedded GPT-2 (built once into the per-user cache), or any HF causal LM.

    cache_root: the embedded models' cache (paths.cache; None: klbench.models.embedded.cache_dir()).
    With `teacher` (a second `model` config, task=distill) the teacher is pi_ref; otherwise pi_ref is the
    policy's own starting point (model.ref_name_or_path for hf).
    """
    if teacher is not None and (cfg.kind == "tabular") != (teacher.kind == "tabular"):
        raise ValueError(f"teacher.kind={teacher.kind} and model.kind={cfg.kind}: student and teacher must both "
                         "be tabular or both be language models")
    if cfg.kind == "tabular":
        return _tabular_policy(cfg, teacher)
    from klbench.models import hf as models  # transformers: imported only for a language model
    path = _lm_path(cfg, cache_root)
    # the values a loading error names: what the user typed for an hf model, the option for an embedded one
    settings = (("model.name_or_path", "model.ref_name_or_path") if cfg.kind == "hf"
                else (f"model={cfg.kind}", f"model={cfg.kind}"))
    if teacher is not None:
        ref_path, names = _lm_path(teacher, cache_root), ("student (model)", "teacher")
        settings = (settings[0], "teacher.name_or_path" if teacher.kind == "hf" else f"teacher={teacher.kind}")
    else:
        ref_path = cfg.ref_name_or_path if cfg.kind == "hf" else path
        names = ("policy (model)", "reference (model.ref_name_or_path)")
    model, tok = models.load_causal_lm(path, cfg.dtype, settings[0])
    ref, ref_tok = models.load_causal_lm(ref_path, (teacher or cfg).dtype, settings[1])
    models.check_same_vocab(tok, ref_tok, *names)
    for name, where, m in ((names[0], path, model), (names[1], ref_path, ref)):
        context = models.context_length(m.config)
        if context and max_new_tokens >= context[1]:  # no room left for a prompt (embedded: klbench.config.schema)
            raise ConfigError(f"task.max_new_tokens={max_new_tokens} does not fit the context of the {name}: "
                             f"{where} has {context[0]}={context[1]} positions for the prompt and the response "
                             f"together, so task.max_new_tokens must be < {context[1]}")
    return LMPolicy(model, ref, tok, max_new_tokens)


def _lm_path(cfg, cache_root: str | None) -> str:
    if cfg.kind == "embedded":
        return ensure_embedded_lm(preset_spec(cfg.preset, cfg.spec), cache_root)
    if cfg.kind == "hf":
        return cfg.name_or_path
    raise ValueError(f"model.kind must be tabular, embedded or hf; got {cfg.kind!r}")


def _tabular_policy(cfg, teacher) -> "TabularPolicy":
    ref_cfg = cfg if teacher is None else teacher
    if (ref_cfg.K, ref_cfg.T, ref_cfg.eos) != (cfg.K, cfg.T, cfg.eos):
        raise ValueError(f"student and teacher vocabularies differ: model (K={cfg.K}, T={cfg.T}, eos={cfg.eos}) "
                         f"vs teacher (K={ref_cfg.K}, T={ref_cfg.T}, eos={ref_cfg.eos})")
    table = TabularModel(cfg.K, cfg.T, eos=cfg.eos, seed=ref_cfg.ref_seed, ref_scale=ref_cfg.ref_scale)
    start = None
    if teacher is not None:  # the student starts from its own table, the teacher's is pi_ref
        start = TabularModel(cfg.K, cfg.T, eos=cfg.eos, seed=cfg.ref_seed, ref_scale=cfg.ref_scale).ref_logits
    return TabularPolicy(table, start)

