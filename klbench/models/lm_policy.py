"""LMPolicy: a language model pair, the policy pi (trained) and the reference pi_ref (frozen), behind the Policy
interface (klbench.models.interface): rollouts by the KV-cache loop (klbench.models.rollout), scoring a micro-batch
at a time (klbench.models.scoring)."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from klbench.config.errors import ConfigError
from klbench.estimators import KLBatch
from klbench.estimators.sampling import Sampling, check_target
from klbench.models.head import head_precision, read_head
from klbench.models.interface import Policy, Rollout, response_mask
from klbench.models.logits_budget import NARROW_HEAD, logits_by_cost, size_text
from klbench.models.rollout import PLAIN, SAMPLERS, Sampler, stop_ids
from klbench.models.scoring import Scoring

SCORING_PATHS = ("auto", "logits", "hidden")  # model.scoring_path


class LMPolicy(Policy):
    """sampler: how rollouts are drawn (klbench.models.rollout); the KV-cache loop by default.
    sampling, kl_target: pi_s and the KL scored (klbench/estimators/sampling.py); eos_ids: the ids that end a
    response, every one of them (None: the tokenizer's eos_token_id). logits_budget: bytes (model.logits_budget) that
    a micro-batch's float32 [m, max_new_tokens, V] logits may take for the logits path to score it (by its cost: it
    is the faster path where the logits are small and the head is wide, docs/scale.md); None: the hidden-state path
    wherever it serves. scoring_path: model.scoring_path, "auto" (by cost) or the path a run asks for."""

    def __init__(self, model, ref_model, tokenizer, max_new_tokens: int, sampler: Sampler | str = "kv_cache",
                 sampling: Sampling = PLAIN, kl_target: str = "sampler", eos_ids=None, logits_budget: int | None = None,
                 scoring_path: str = "auto"):
        super().__init__()
        self.model, self.ref, self.tok = model, ref_model, tokenizer
        self.ref.requires_grad_(False)
        self.max_new_tokens = max_new_tokens
        # False for prompts a chat template rendered (klbench.data.chat): they hold their BOS already
        self.add_special_tokens = True
        if isinstance(sampler, str) and sampler not in SAMPLERS:
            raise ValueError(f"LMPolicy: sampler must be one of {sorted(SAMPLERS)} or a Sampler, got {sampler!r}")
        self.sampler = SAMPLERS[sampler] if isinstance(sampler, str) else sampler
        check_target(sampling, kl_target)  # a target no estimator can serve under this sampling: refused here
        self.sampling, self.kl_target = sampling, kl_target
        self.eos_ids = stop_ids(tokenizer.eos_token_id if eos_ids is None else eos_ids)
        from klbench.models.hf import context_length  # the models are loaded: transformers is imported already
        # (attribute, positions) of the shorter context of the two: both read prompt + response
        contexts = [c for c in (context_length(model.config), context_length(ref_model.config)) if c]
        self.context = min(contexts, key=lambda c: c[1]) if contexts else None
        self.train()
        # why scoring keeps the logits (None: from hidden states), for the policy and the sampling; an estimator that
        # reads the whole distribution sets logits_reason (scoring_line)
        self.scoring_reason, self.logits_reason = self._read_heads(), None
        if logits_budget is not None and (isinstance(logits_budget, bool) or int(logits_budget) != logits_budget
                                          or logits_budget <= 0):
            raise ValueError(f"LMPolicy: logits_budget must be a positive number of bytes or None, got {logits_budget!r}")
        self.logits_budget = logits_budget
        if scoring_path not in SCORING_PATHS:
            raise ValueError(f"LMPolicy: scoring_path must be one of {SCORING_PATHS}, got {scoring_path!r}")
        self.scoring_path = scoring_path
        self.rows_forwarded = 0  # sequences the policy has scored (the benchmarks count forwards per step)
        # model.head_dtype: what the LM head's product runs in, on every path (head_scores' LMHead.dtype, the logits
        # path and the rollouts through head_precision); None: autocast's, as the model's own head runs
        self.head_dtype: torch.dtype | None = torch.float32

    def train(self, mode: bool = True) -> "LMPolicy":
        # dropout stays off in training too: the log-probs we differentiate must be those of the very
        # distribution the samples came from, or every estimator is biased (TRL and verl do the same)
        super().train(mode)
        self.model.eval()
        self.ref.eval()
        from klbench.models.hf import checkpointing_layers_on
        # model.gradient_checkpointing: its layers alone back in training mode (klbench.models.hf.enable_checkpointing)
        self.checkpointing = checkpointing_layers_on(self.model) > 0
        return self

    def _engine(self, spec):
        from klbench.models.sampler_engine import Engine
        return Engine(spec, {n: p for n, p in self.model.named_parameters() if p.requires_grad}, self.model)

    @torch.no_grad()
    def rollout(self, prompts: list[str], n: int, engine: bool = False) -> Rollout:
        enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=self.add_special_tokens)
        enc = enc.to(self.device)
        if self.context and enc.input_ids.shape[1] + self.max_new_tokens > self.context[1]:
            # past the context GPT-2's position embedding fails with a bare IndexError; prompts from the
            # `dataset` group were checked when loaded (check_prompts), this catches the others (task=probe)
            longest = int(enc.attention_mask.sum(1).argmax())
            raise ConfigError(_too_long(f"prompt {_preview(prompts[longest])}", enc.input_ids.shape[1],
                                       self.max_new_tokens, self.context))
        ids = enc.input_ids.repeat_interleave(n, 0)  # [B*n, P]
        attn = enc.attention_mask.repeat_interleave(n, 0)  # [B*n, P]
        by_engine = engine and self.engine is not None  # task.sampler: an engine that is not the trainer draws
        model = self.engine.to(self.device).model if by_engine else self.model
        # the trainer's own model samples with the head's precision it is scored in (one pi); an engine with its own
        with head_precision(model, None if by_engine else self.head_dtype):
            s = self.sampler(model, ids, attn, self.max_new_tokens, self.eos_ids, self.tok.pad_token_id,
                             sampling=self.sampling)
        resp = s.tokens  # [B*n, L]
        mask = response_mask(resp, self.eos_ids)
        texts = self.tok.batch_decode(torch.where(mask, resp, self.tok.pad_token_id), skip_special_tokens=True)
        group = torch.arange(len(prompts), device=ids.device).repeat_interleave(n)
        return Rollout(torch.cat([ids, resp], 1), torch.cat([attn, mask.long()], 1), ids.shape[1], mask, group, texts,
                       [p for p in prompts for _ in range(n)], sampled_logp=s.logp, by_engine=by_engine)

    def _logits(self, model, ro: Rollout, pos: torch.Tensor, mask=None) -> torch.Tensor:
        """[B, L, V] next-token logits at the response positions (P - 1 ... P + L - 2): the logits path."""
        T, L = ro.tokens.shape[1], ro.mask.shape[1]
        # the LM head projects those L positions only: not the prompt's, and not the last one, whose logits no
        # response token reads (sliced off, they cost a [B, L + 1, V] gradient of the slice in backward). A model
        # that ignores logits_to_keep returns all positions: the L before the last are taken. No KV cache (as
        # klbench.models.scoring says)
        keep = torch.arange(T - L - 1, T - 1, device=ro.tokens.device)  # [L]
        with head_precision(model, self.head_dtype):
            logits = model(input_ids=ro.tokens, attention_mask=ro.attention, position_ids=pos, logits_to_keep=keep,
                           use_cache=False).logits
        return logits if logits.shape[1] == L else logits[:, -(L + 1):-1]

    def score(self, ro: Rollout, micro_batch_size: int | None = None, with_token_kl: bool = True,
              logits: bool | None = None) -> KLBatch:
        # logits: True the logits path, False the hidden states where they serve, None model.scoring_path's (takes_logits)
        # the parts' graphs are kept together: the caller backpropagates the whole batch (a step instead
        # backpropagates each part at once: klbench/tasks/step.py)
        scoring = Scoring(self, ro, micro_batch_size, with_token_kl, logits)
        for _ in scoring.parts(keep_graph=True):
            pass
        return scoring.whole()

    def scoring(self, ro: Rollout, micro_batch_size: int | None, with_token_kl: bool) -> Scoring:
        """A step's scoring of ro, a micro-batch at a time (klbench.models.scoring)."""
        return Scoring(self, ro, micro_batch_size, with_token_kl)

    def _read_heads(self) -> str | None:
        """How this policy's scores are computed: from hidden states (None) or, with the reason, from the logits."""
        s, t = self.sampling, self.kl_target
        if s.truncates:
            return f"the sampler ({s.describe()}) is cut from the logits"
        if t == "model" and not s.is_plain:
            return f"task.kl_target=model at {s.describe()} scores the policy at two temperatures"
        for name, model in (("policy's", self.model), ("reference's", self.ref)):
            head = read_head(model)
            if isinstance(head, str):
                return f"the {name} LM head cannot be read: {head}"
        return None

    def _head_shape(self) -> tuple[int, int]:
        """(V, H) of the policy's LM head: its output embedding's rows and columns (the config's where it has none)."""
        from klbench.models.head import output_head
        weight = getattr(output_head(self.model), "weight", None)
        if weight is not None:
            return int(weight.shape[0]), int(weight.shape[1])
        text = self.model.config.get_text_config()
        return int(text.vocab_size), int(text.hidden_size)

    @property
    def vocab(self) -> int:
        """V: the size of the policy's next-token distribution."""
        return self._head_shape()[0]

    @property
    def width(self) -> int:
        """H: the width of the LM head's input, the final hidden state."""
        return self._head_shape()[1]

    def logits_bytes(self, rows: int) -> int:
        """Bytes of a micro-batch's float32 [rows, max_new_tokens, V] logits: what the logits path holds per tensor."""
        return rows * self.max_new_tokens * self.vocab * 4

    def takes_logits(self, rows: int) -> bool:
        """Whether a micro-batch of `rows` sequences is scored through its logits, where both paths serve: the path
        model.scoring_path asks for, or by cost (auto): the logits where the head is at least NARROW_HEAD wide and
        the float32 logits fit logits_budget (the longest response counts, so a run keeps one path)."""
        if self.scoring_path != "auto":
            return self.scoring_path == "logits"
        return logits_by_cost(self.width, self.logits_bytes(rows), self.logits_budget)

    @property
    def heads(self):
        """(policy LMHead at the target's temperature, reference LMHead), read from the models now (they may have
        moved device or dtype since), or None on the logits path."""
        if self.scoring_reason is not None:
            return None
        s, t = self.sampling, self.kl_target
        pol, ref = (replace(read_head(m, check=False), dtype=self.head_dtype) for m in (self.model, self.ref))
        return pol.at(s.temperature if t != "model" else 1.0), ref.at(s.temperature if t in ("sampler", "tempered") else 1.0)

    def scoring_line(self, estimator_reason: str | None = None, rows: int | None = None) -> str:
        """The start-up line that says how this run scores, and why. rows: the sequences of a micro-batch (the
        budget's [m, L, V]; None: not known, the budget not weighed)."""
        self.logits_reason = estimator_reason
        why = self.scoring_reason or estimator_reason
        hidden = ("scoring from final hidden states: log-probs, the exact KL over the vocabulary and the entropy "
                  "a tile at a time, no [B, T, V] logits")
        if why is not None:
            if self.scoring_path == "hidden":
                raise ConfigError(f"model.scoring_path=hidden: {why}, which needs the logits; use auto or logits")
            return f"scoring through the full [B, T, V] logits: {why}"
        if self.scoring_path != "auto":
            asked = f"model.scoring_path={self.scoring_path} (both paths are exact, docs/scale.md)"
            return f"scoring through the [m, L, V] logits: {asked}" if self.scoring_path == "logits" else f"{hidden}: {asked}"
        if self.logits_budget is None or rows is None:
            return hidden
        if self.width < NARROW_HEAD:
            return (f"{hidden}: the LM head is {self.width} wide, under {NARROW_HEAD}, where they are the faster path or "
                    "within a few percent of it (model.scoring_path=logits asks for those; docs/scale.md)")
        shape = f"a micro-batch's float32 [{rows}, {self.max_new_tokens}, {self.vocab}] logits ({size_text(self.logits_bytes(rows))})"
        budget = f"model.logits_budget={size_text(self.logits_budget)}"
        if self.takes_logits(rows):
            return f"scoring through the [m, L, V] logits: {shape} fit {budget} (both paths are exact, docs/scale.md)"
        return f"{hidden}: {shape} exceed {budget}"

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def check_prompts(self, prompts: list[str], source: str) -> None:
        """The longest prompt, tokenized as rollout() does, plus max_new_tokens fits the models' context."""
        if self.context is None or not prompts:
            return
        lengths = [len(ids) for ids in self.tok(prompts, add_special_tokens=self.add_special_tokens).input_ids]
        i = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[i] + self.max_new_tokens > self.context[1]:
            raise ConfigError(f"{source}: " + _too_long(f"its longest prompt (#{i + 1}: {_preview(prompts[i])})",
                                                       lengths[i], self.max_new_tokens, self.context))

    def reference(self) -> "LMPolicy":
        ref = LMPolicy(self.ref, self.ref, self.tok, self.max_new_tokens, self.sampler, self.sampling, self.kl_target,
                       self.eos_ids, self.logits_budget, self.scoring_path)
        ref.add_special_tokens = self.add_special_tokens  # the same prompts, tokenized alike
        ref.head_dtype = self.head_dtype
        return ref

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
