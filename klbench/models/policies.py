"""Policies the RL and distillation modules drive: rollout (sample) and score (build a KLBatch).

LMPolicy wraps any AutoModelForCausalLM pair (policy, frozen reference); TabularPolicy wraps the
enumerable tabular model so that the same Lightning module runs against exact ground truth.
A policy samples from pi_s (`sampling`: temperature, top-k, top-p; plain pi by default) and scores the KL
target it holds (`kl_target`, klbench/estimators/sampling.py): which KL the run regularises and measures.
The reward term always follows the sampler: its REINFORCE log-prob is log pi_s(y) (`sampler_logp`).

What is special about the tabular model lives here, behind the `Policy` interface: the tasks, the
probe and the sweeps ask a policy for its prompt and its ground truth, never for its type.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from klbench.models.embedded import ensure_embedded_lm, preset_spec
from klbench.estimators import KLBatch
from klbench.estimators.chunked import exact_token_entropy
from klbench.console import messages as console
from klbench.estimators.sampling import KL_TARGETS, Sampling, check_target, token_logprob
from klbench.config.errors import ConfigError
from klbench.exact.tabular import Frontier, TabularModel, TabularReward
from klbench.models.head import read_head
from klbench.models.scoring import ScoredBatch, Scoring, WholeBatch
from klbench.models.rollout import PLAIN, SAMPLERS, Sampler, stop_ids



@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, P + L] left-padded prompt then response (LM) or [B, T] (tabular)
    attention: torch.Tensor  # [B, P + L] 1 on real prompt tokens and real response tokens
    prompt_len: int  # P
    mask: torch.Tensor  # [B, L] bool, response tokens up to and including the first stop id
    group: torch.Tensor  # [B] prompt index: the n samples of one prompt share it
    texts: list[str]  # decoded responses
    prompts: list[str]
    seq_ids: torch.Tensor | None = None  # [B] tabular sequence ids
    sample_logp: torch.Tensor | None = None  # [B, L] the sampler's log pi_s of its tokens, where it keeps them

    def rows(self, i: int, j: int) -> "Rollout":
        """Sequences i..j-1: the same prompt length P (left padding kept), every per-sequence field sliced."""
        cut = {f.name: getattr(self, f.name)[i:j] for f in fields(self)
               if f.name != "prompt_len" and getattr(self, f.name) is not None}
        return replace(self, **cut)


def token_entropy(batch: KLBatch) -> torch.Tensor | None:
    """[B, T] exact per-position entropy of the batch's policy (0 off the mask), or None without its logits."""
    if isinstance(batch, ScoredBatch) and batch.entropy is not None:
        return batch.entropy
    if batch.logits is None:
        return None
    return exact_token_entropy(batch.logits, batch.mask, batch.chunk_rows)


def has_distributions(batch: KLBatch) -> bool:
    """Whether rb's exact per-position KL is available: the full logits, or their reduction (ScoredBatch)."""
    return batch.logits is not None or batch.token_kl is not None


def response_mask(resp: torch.Tensor, eos_ids) -> torch.Tensor:
    """[B, L] True up to and including the first stop id (any of `eos_ids`: an id or a list); after it, padding."""
    stops = torch.tensor(stop_ids(eos_ids), dtype=resp.dtype, device=resp.device)
    is_eos = torch.isin(resp, stops).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


class Policy(nn.Module):
    """pi, trained, and pi_ref, frozen. Subclasses implement rollout, score, trainable, device and reference;
    a policy whose truth is computable (the tabular model) also overrides the exact_* methods."""

    # a policy that ignores prompts names the one prompt its batches repeat (they only set the batch
    # shape); None: prompts come from the `dataset` group
    fixed_prompt: str | None = None
    # how rollouts sample (pi_s) and which KL score() builds its batch for (klbench/estimators/sampling.py)
    sampling: Sampling = PLAIN
    kl_target: str = "sampler"

    def rollout(self, prompts: list[str], n: int) -> Rollout:
        """n samples y ~ pi_s per prompt (ancestral; pi itself at plain sampling)."""
        raise NotImplementedError

    def score(self, ro: Rollout, micro_batch_size: int | None = None, kappa: bool = True,
              logits: bool = False) -> KLBatch:
        """The KL target's batch of a rollout's responses (klbench.estimators.sampling.target_batch): the log-probs
        and logits of the two distributions it compares; old_logp = log pi_s for kl_target=model.
        micro_batch_size (task.micro_batch_size; language models): a ScoredBatch built that many sequences at a
        time, whose gradient is the whole batch's (LMPolicy.score).
        kappa: the exact per-position KL is needed (rb's, for its gradient, its value or the logs): a language model
        scores it with the log-probs in one pass. logits: a language model's batch keeps the [B, T, V] logits
        (top-k estimators read them; klbench.models.scoring)."""
        raise NotImplementedError

    def scoring(self, ro: Rollout, micro_batch_size: int | None, kappa: bool):
        """A step's scoring of ro in parts (klbench.models.scoring): here the whole batch at once."""
        return WholeBatch(self.score(ro, micro_batch_size, kappa))

    def sampler_logp(self, ro: Rollout, batch: KLBatch) -> torch.Tensor:
        """[B, T] log pi_s(y), differentiable: the reward term's REINFORCE log-prob (the run maximises the reward
        of the policy as it samples, E_{y ~ pi_s}[r]), and the scorer's side of train/logp_gap. It is batch.logp
        itself wherever the target scores pi_s (sampler; tempered targets without truncation)."""
        if isinstance(batch, ScoredBatch) and batch.sampler_logp is not None:  # computed per micro-batch
            return batch.sampler_logp
        s, target = self.sampling, self.kl_target
        if s.is_plain or target == "sampler" or (target != "model" and not s.truncates):
            return batch.logp
        # batch.logits: the raw logits (model) or already divided by T (tempered targets): cut them as pi_s does
        warp = s if target == "model" else Sampling(top_k=s.top_k, top_p=s.top_p)
        return token_logprob(warp.process(batch.logits), ro.tokens[:, ro.prompt_len:])

    def on_target(self) -> "Policy":
        """A view of this policy (the same modules) whose rollouts are y ~ the target's own policy, where the run's
        are not: kl_target=model samples pi_s, and the value estimators need y ~ pi (validation measures the
        target's KL on these). The policy itself where its rollouts serve."""
        if self.kl_target != "model" or self.sampling.is_plain:
            return self
        view = copy.copy(self)  # shallow: shares the parameters; only the sampling attribute differs
        view.sampling = PLAIN
        return view

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
    """sampler: how rollouts are drawn (klbench.models.rollout); the KV-cache loop by default.
    sampling, kl_target: pi_s and the KL scored (klbench/estimators/sampling.py); eos_ids: the ids that end a
    response, every one of them (None: the tokenizer's eos_token_id)."""

    def __init__(self, model, ref_model, tokenizer, max_new_tokens: int, sampler: Sampler | str = "kv_cache",
                 sampling: Sampling = PLAIN, kl_target: str = "sampler", eos_ids=None):
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
        self.rows_forwarded = 0  # sequences the policy has scored (the benchmarks count forwards per step)

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

    @torch.no_grad()
    def rollout(self, prompts: list[str], n: int) -> Rollout:
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
        s = self.sampler(self.model, ids, attn, self.max_new_tokens, self.eos_ids, self.tok.pad_token_id,
                         sampling=self.sampling)
        resp = s.tokens  # [B*n, L]
        mask = response_mask(resp, self.eos_ids)
        texts = self.tok.batch_decode(torch.where(mask, resp, self.tok.pad_token_id), skip_special_tokens=True)
        group = torch.arange(len(prompts), device=ids.device).repeat_interleave(n)
        return Rollout(torch.cat([ids, resp], 1), torch.cat([attn, mask.long()], 1), ids.shape[1], mask, group, texts,
                       [p for p in prompts for _ in range(n)], sample_logp=s.logp)

    def _logits(self, model, ro: Rollout, pos: torch.Tensor, mask=None) -> torch.Tensor:
        """[B, L, V] next-token logits at the response positions (P - 1 ... P + L - 2): the logits path."""
        T, L = ro.tokens.shape[1], ro.mask.shape[1]
        # the LM head projects those L positions only: not the prompt's, and not the last one, whose logits no
        # response token reads (sliced off, they cost a [B, L + 1, V] gradient of the slice in backward). A model
        # that ignores logits_to_keep returns all positions: the L before the last are taken. No KV cache (as
        # klbench.models.scoring says)
        keep = torch.arange(T - L - 1, T - 1, device=ro.tokens.device)  # [L]
        logits = model(input_ids=ro.tokens, attention_mask=ro.attention, position_ids=pos, logits_to_keep=keep,
                       use_cache=False).logits
        return logits if logits.shape[1] == L else logits[:, -(L + 1):-1]

    def score(self, ro: Rollout, micro_batch_size: int | None = None, kappa: bool = True,
              logits: bool = False) -> KLBatch:
        # the parts' graphs are kept together: the caller backpropagates the whole batch (a step instead
        # backpropagates each part at once: klbench/tasks/step.py)
        scoring = Scoring(self, ro, micro_batch_size, kappa, logits)
        for _ in scoring.parts(keep_graph=True):
            pass
        return scoring.whole()

    def scoring(self, ro: Rollout, micro_batch_size: int | None, kappa: bool) -> Scoring:
        """A step's scoring of ro, a micro-batch at a time (klbench.models.scoring)."""
        return Scoring(self, ro, micro_batch_size, kappa)

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

    @property
    def heads(self):
        """(policy LMHead at the target's temperature, reference LMHead), read from the models now (they may have
        moved device or dtype since), or None on the logits path."""
        if self.scoring_reason is not None:
            return None
        s, t = self.sampling, self.kl_target
        pol, ref = read_head(self.model, check=False), read_head(self.ref, check=False)
        return pol.at(s.temperature if t != "model" else 1.0), ref.at(s.temperature if t in ("sampler", "tempered") else 1.0)

    def scoring_line(self, estimator_reason: str | None = None) -> str:
        """The start-up line that says how this run scores, and why where it keeps the logits."""
        self.logits_reason = estimator_reason
        why = self.scoring_reason or estimator_reason
        if why is None:
            return ("scoring from final hidden states: log-probs, the exact KL over the vocabulary and the entropy "
                    "a tile at a time, no [B, T, V] logits")
        return f"scoring through the full [B, T, V] logits: {why}"

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
                       self.eos_ids)
        ref.add_special_tokens = self.add_special_tokens  # the same prompts, tokenized alike
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


class TabularPolicy(Policy):
    """Logit table [P, K] in float64, starting at pi_ref (or `start`); prompts are ignored (one implicit prompt).

    Everything is enumerable here, so the exact_* methods give the truth that sampled estimates are judged by.
    sampling (temperature, top-k, top-p) and kl_target (klbench.estimators.sampling): rollouts draw from pi_s,
    score() builds the target's batch with target_batch, and the exact metrics and gradients are the target's.
    """

    fixed_prompt = "<tabular>"

    def __init__(self, model: TabularModel, start: torch.Tensor | None = None, sampling: Sampling | None = None,
                 kl_target: str = "sampler"):
        super().__init__()
        self.table = model
        self.theta = nn.Parameter((model.ref_logits if start is None else start).clone())  # [P, K]
        self.sampling = Sampling() if sampling is None else sampling
        check_target(self.sampling, kl_target)  # refuses what cannot be estimated; bias warnings are the run's
        self.kl_target = kl_target
        self._frontier = None  # ((reward table, sampling, target), Frontier): traced once, read at every validation

    @property
    def _sampled(self) -> Sampling | None:
        """The sampling the tabular model's methods take: None at plain sampling, where every target is the
        one pair (pi, pi_ref) and the plain path is kept bit for bit."""
        return None if self.sampling.is_plain else self.sampling

    @torch.no_grad()
    def rollout(self, prompts: list[str], n: int) -> Rollout:
        probs = self.table.sample_probs(self.theta, sampling=self._sampled)  # [N], under pi_s
        ids = torch.multinomial(probs, len(prompts) * n, replacement=True)  # [B*n]
        tokens = self.table.tokens[ids]
        mask = self.table.mask[ids]
        # lists first: iterating tensors element by element costs more than the whole training step
        texts = [" ".join(str(v) for v, m in zip(row, keep) if m) for row, keep in zip(tokens.tolist(), mask.tolist())]
        group = torch.arange(len(prompts)).repeat_interleave(n)
        return Rollout(tokens, mask.long(), 0, mask, group, texts, [p for p in prompts for _ in range(n)], ids)

    def score(self, ro: Rollout, micro_batch_size: int | None = None, kappa: bool = True,
              logits: bool = False) -> KLBatch:
        # micro_batch_size: the schema refuses it here (the table is the whole model: nothing to save); kappa
        # is computed on first use from the [B, T, K] table logits, which exist whole already
        batch = self.table.batch(self.theta, ro.seq_ids, group=ro.group, sampling=self._sampled,
                                 target=self.kl_target)
        # the exact per-position KL in one block: its [B, T, K] logits exist whole already, and the default
        # chunking (2^20 / K rows) would fall back to a Python loop over sequences past 2^18 rows at K = 4
        # (what that cost: docs/estimators.md, "Small vocabularies")
        batch.chunk_rows = max(1, batch.mask.numel())
        return batch

    def trainable(self) -> list[nn.Parameter]:
        return [self.theta]

    def reference(self) -> "TabularPolicy":
        """pi_ref sampled as the policy is sampled (the probe's kl_ref_pi reference draws from it)."""
        return TabularPolicy(self.table, self.table.ref_logits, self.sampling, self.kl_target)

    @property
    def device(self) -> torch.device:
        return self.theta.device

    @torch.no_grad()
    def exact_metrics(self, reward=None) -> dict[str, float]:
        """seq_kl: the exact KL of the run's target (KL(pi || pi_ref) at plain sampling); kl_ref_pi: the target
        pair's other direction; reward: E[r] under the sampler pi_s, which is what the run earns. Away from plain
        sampling also model_kl = KL(pi || pi_ref) of the untempered models (seq_kl itself at target=model)."""
        theta, s = self.theta.detach(), self._sampled
        if s is None:
            out = {"seq_kl": float(self.table.kl_pi_ref(theta)), "kl_ref_pi": float(self.table.kl_ref_pi(theta))}
        else:
            p, q = self.table.target_tables(theta, s, self.kl_target)
            out = {"seq_kl": float(self.table.pair_kl(p, q)), "kl_ref_pi": float(self.table.pair_kl(q, p))}
            if self.kl_target != "model":  # at target=model seq_kl is that KL already
                out["model_kl"] = float(self.table.kl_pi_ref(theta))
        frontier = self.exact_frontier(reward)
        if isinstance(reward, TabularReward):
            r = float((self.table.sample_probs(theta, sampling=s) * reward.table).sum())
            out["reward"] = r
            if frontier is not None:
                out["frontier_gap"] = frontier.reward_gap(r, out["seq_kl"])
        return out

    def exact_frontier(self, reward) -> Frontier | None:
        """The exact frontier of E_{pi_s}[r] against the target's KL, where it has a closed form: plain sampling;
        a temperature alone with target sampler or tempered (the frontier of the tempered reference pi_ref,T,
        since pi_T ranges over every table) or tempered_vs_raw (that of pi_ref itself). None for target=model at
        T != 1 (the reward is earned by pi_T, the KL paid by pi) and under truncation (pi_s ranges over tables
        with cut tokens, whose optimum has no closed form)."""
        if not isinstance(reward, TabularReward):  # no reward, or one that cannot be enumerated
            return None
        s, m = self.sampling, self.table
        if s.is_plain or self.kl_target == "tempered_vs_raw" and not s.truncates:
            model = m
        elif self.kl_target in ("sampler", "tempered") and not s.truncates:
            model = TabularModel(m.K, m.T, m.ref_logits / s.temperature, eos=m.eos)
        else:
            return None
        key = (reward.table, s, self.kl_target)  # a copy of this policy with another sampling must not reuse it
        if self._frontier is None or self._frontier[0][0] is not key[0] or self._frontier[0][1:] != key[1:]:
            self._frontier = (key, model.pareto_frontier(reward.table))
        return self._frontier[1]

    def exact_gradients(self) -> dict[str, torch.Tensor]:
        return self.table.exact_gradients(self.theta.detach(), sampling=self._sampled, target=self.kl_target)


def task_sampling(task) -> tuple[Sampling, str]:
    """(Sampling, kl_target) of a task config (task.temperature, top_k, top_p, kl_target; absent keys: plain)."""
    get = task.get
    return Sampling(float(get("temperature", 1.0)), int(get("top_k", 0)), float(get("top_p", 1.0))), \
        str(get("kl_target", "sampler"))


def sampling_text(policy) -> str:
    """The line that says how the policy samples and which KL the run targets (start and end of a run)."""
    return console.kl_target_line(policy.sampling.describe(), policy.kl_target, KL_TARGETS[policy.kl_target])


def sampling_params(policy) -> dict[str, str]:
    """MLflow params of the sampling a run used (task.* are params already; with model.generation_config=follow
    the folder's values replace them) and the KL it targets."""
    return {"sampling.used": policy.sampling.describe(), "sampling.kl_target": KL_TARGETS[policy.kl_target]}


def build_policy(cfg, max_new_tokens: int, cache_root: str | None = None, teacher=None, sampling: Sampling = PLAIN,
                 kl_target: str = "sampler") -> Policy:
    """The `model` group: tabular, the embedded GPT-2 (built once into the per-user cache), or any HF causal LM.

    cache_root: the embedded models' cache (paths.cache; None: klbench.models.embedded.cache_dir()).
    With `teacher` (a second `model` config, task=distill) the teacher is pi_ref; otherwise pi_ref is the
    policy's own starting point (model.ref_name_or_path for hf).
    sampling, kl_target: how the policy samples and which KL it scores (task_sampling(cfg.task)). A language
    model's generation_config adds its stop ids (every one ends a response) and, with
    model.generation_config=follow, its sampling options replace `sampling` (one line says which are used).
    """
    if teacher is not None and (cfg.kind == "tabular") != (teacher.kind == "tabular"):
        raise ValueError(f"teacher.kind={teacher.kind} and model.kind={cfg.kind}: student and teacher must both "
                         "be tabular or both be language models")
    if cfg.kind == "tabular":
        _warn_target(sampling, kl_target)
        return _tabular_policy(cfg, teacher, sampling, kl_target)
    from klbench.models import hf as models  # transformers: imported only for a language model
    path = _lm_path(cfg, cache_root)
    if teacher is not None:
        ref_path, names = _lm_path(teacher, cache_root), ("student (model)", "teacher")
    else:
        ref_path = cfg.ref_name_or_path if cfg.kind == "hf" else path
        names = ("policy (model)", "reference (model.ref_name_or_path)")
    model, tok = models.load_causal_lm(path, cfg.dtype, **_load_options(cfg, "model", "name_or_path"))
    if cfg.get("gradient_checkpointing"):
        models.enable_checkpointing(model, "model")
    ref = ref_tok = None
    if (cfg.get("lora") or {}).get("r"):
        from klbench.models.lora import WithoutAdapter, add_lora
        model = add_lora(model, **cfg.lora)
        if teacher is None and ref_path == path:  # pi_ref is the policy's own base, adapter off: one copy
            ref, ref_tok = WithoutAdapter(model), tok
    if ref is None:
        ref_key = ("model", "ref_name_or_path") if teacher is None else ("teacher", "name_or_path")
        ref, ref_tok = models.load_causal_lm(ref_path, (teacher or cfg).dtype,
                                             **_load_options(teacher or cfg, *ref_key))
    models.check_same_vocab(tok, ref_tok, *names)
    for name, where, m in ((names[0], path, model), (names[1], ref_path, ref)):
        context = models.context_length(m.config)
        if context and max_new_tokens >= context[1]:  # no room left for a prompt (embedded: klbench.config.schema)
            raise ConfigError(f"task.max_new_tokens={max_new_tokens} does not fit the context of the {name}: "
                             f"{where} has {context[0]}={context[1]} positions for the prompt and the response "
                             f"together, so task.max_new_tokens must be < {context[1]}")
    stops, options = models.generation_defaults(model)
    eos_ids = list(dict.fromkeys(i for i in (tok.eos_token_id, *stops) if i is not None))  # the tokenizer's first
    sampling = _generation_sampling(cfg, path, options, sampling)
    _warn_target(sampling, kl_target)
    return LMPolicy(model, ref, tok, max_new_tokens, sampling=sampling, kl_target=kl_target, eos_ids=eos_ids)


def _warn_target(sampling: Sampling, kl_target: str) -> None:
    warning = check_target(sampling, kl_target)  # refuses a target no estimator can serve, else may warn
    if warning:
        print(f"klbench: warning: {warning}")


def _generation_sampling(cfg, path: str, options: dict, sampling: Sampling) -> Sampling:
    """The sampling a language model runs with, given the temperature/top_k/top_p its generation_config sets
    (`options`): klbench's (`sampling`, from task.*), saying so where the folder sets others, or the folder's
    with model.generation_config=follow. Unset options are generate()'s plain values (1, 0, 1)."""
    follow = cfg.kind == "hf" and cfg.get("generation_config", "klbench") == "follow"
    if not options:
        if follow:
            print(f"klbench: model.generation_config=follow: {path}'s generation_config sets no temperature, top_k "
                  f"or top_p; sampling with task.*'s {sampling.describe()}")
        return sampling
    theirs = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items())
    if not follow:
        if any(getattr(sampling, k) != v for k, v in options.items()):
            print(f"klbench: {path}'s generation_config sets {theirs}; this run samples with klbench's "
                  f"task.* options ({sampling.describe()}): model.generation_config=follow uses the folder's")
        return sampling
    try:
        used = Sampling(float(options.get("temperature", 1.0)), int(options.get("top_k", 0)),
                        float(options.get("top_p", 1.0)))
    except ValueError as e:
        raise ConfigError(f"model.generation_config=follow: {path}'s generation_config sets {theirs}, which "
                          f"klbench cannot train with ({e}); use model.generation_config=klbench") from None
    print(f"klbench: model.generation_config=follow: sampling with {path}'s generation_config ({used.describe()}) "
          f"instead of task.*'s ({sampling.describe()})")
    return used


def _load_options(cfg, setting: str, key: str) -> dict:
    """load_causal_lm's options of a `model` config (model.trust_remote_code, model.attn_implementation; the
    embedded models have the second only), the group they are set in and the key of the path, for its messages
    (an embedded model's folder is klbench's cache: no setting names it)."""
    return {"trust_remote_code": bool(cfg.get("trust_remote_code", False)),
            "attn_implementation": cfg.get("attn_implementation"), "setting": setting,
            "path_setting": f"{setting}.{key}" if cfg.kind == "hf" else None}


def _lm_path(cfg, cache_root: str | None) -> str:
    if cfg.kind == "embedded":
        return ensure_embedded_lm(preset_spec(cfg.preset, cfg.spec), cache_root)
    if cfg.kind == "hf":
        return cfg.name_or_path
    raise ValueError(f"model.kind must be tabular, embedded or hf; got {cfg.kind!r}")


def _tabular_policy(cfg, teacher, sampling: Sampling | None = None, kl_target: str = "sampler") -> "TabularPolicy":
    """The tabular policy of model=tabular (a teacher's table as pi_ref for distillation), sampling pi_s and
    scoring the KL target (build_policy passes task_sampling(cfg.task))."""
    ref_cfg = cfg if teacher is None else teacher
    if (ref_cfg.K, ref_cfg.T, ref_cfg.eos) != (cfg.K, cfg.T, cfg.eos):
        raise ValueError(f"student and teacher vocabularies differ: model (K={cfg.K}, T={cfg.T}, eos={cfg.eos}) "
                         f"vs teacher (K={ref_cfg.K}, T={ref_cfg.T}, eos={ref_cfg.eos})")
    table = TabularModel(cfg.K, cfg.T, eos=cfg.eos, seed=ref_cfg.ref_seed, ref_scale=ref_cfg.ref_scale)
    start = None
    if teacher is not None:  # the student starts from its own table, the teacher's is pi_ref
        start = TabularModel(cfg.K, cfg.T, eos=cfg.eos, seed=cfg.ref_seed, ref_scale=cfg.ref_scale).ref_logits
    return TabularPolicy(table, start, sampling, kl_target)
