"""The rules across config groups, each group alone already valid (klbench.config.groups): what validate checks
after the groups (klbench.config.schema), and check_followed_sampling, the sampling rules again for a model folder's
own sampling options."""
from __future__ import annotations

from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel

from klbench.config.errors import ConfigError
from klbench.estimators.options import GROUP_ADVANTAGES, corrects_off_policy, setting_task
from klbench.estimators.targets import is_plain, truncated_model_target, truncates
from klbench.models.pair_rules import check_tabular_pair, context_refusal
from klbench.data.jsonl import read_rows
from klbench.probe.config import ProbeOptions
from klbench.config.groups import _check_group, _validated
from klbench.config.resources import Hardware, _LanguageModel, _is_int
from klbench.config.training import BETA_MAX, SamplingFields, TaskRL

# ---- rules across groups: each group alone is already valid ----

def _check_fsdp(cfg: DictConfig, hw: Hardware, task, model: str) -> None:
    """hardware=fsdp (klbench/tasks/sharding.py): what it cannot shard or split, in one line. The devices against
    the machine's are checked with torch (klbench.tasks.sharding.check_devices)."""
    if hw.strategy != "fsdp2":
        return
    if model == "tabular":
        raise ConfigError("hardware=fsdp shards a language model's decoder layers, and model=tabular is a table of "
                          "logits: use hardware=cpu or hardware=ddp")
    if task.name not in ("rl", "distill"):
        raise ConfigError(f"hardware=fsdp shards a training run (task=rl or task=distill), got task={task.name}")
    if task.probe_every:  # the probe runs on rank 0 alone, and a sharded forward needs every rank
        raise ConfigError(f"task.probe_every={task.probe_every} probes on one rank, and hardware=fsdp's models need "
                          "every rank for a forward: drop it (task.probe_every=null) or probe a checkpoint with task=probe")
    if not (_is_int(hw.devices) and hw.devices >= 1 or isinstance(hw.devices, list)):
        raise ConfigError(f"hardware=fsdp needs hardware.devices as a number of ranks, got {hw.devices}")
    world = (len(hw.devices) if isinstance(hw.devices, list) else hw.devices) * hw.num_nodes
    n = task.prompts_per_step
    if n % world:
        raise ConfigError(f"hardware=fsdp splits task.prompts_per_step={n} (the global batch) over hardware.devices x "
                          f"hardware.num_nodes = {world} ranks, which does not divide it: choose a multiple of {world}")


def _check_combination(cfg: DictConfig, t: TaskRL, e: BaseModel, model: str, teacher: str | None,
                       reward: str) -> None:
    """t, e: the validated task and estimator (their defaults filled in)."""
    task, beta = t.name, e.beta
    if task == "distill":
        if teacher is None:
            raise ConfigError("task=distill needs a teacher: add model@teacher=<option> (or use experiment=distill)")
        if beta != 1:
            raise ConfigError(f"task=distill minimises KL(student || teacher) itself: estimator.beta must be 1, "
                              f"got {beta} (weight an extra reward with task.reward_coef instead)")
        if t.reward_coef != 0 and reward == "none":
            raise ConfigError(f"task.reward_coef={t.reward_coef} needs a reward, but reward=none")
    elif teacher is not None:
        raise ConfigError(f"a teacher (model@teacher) only applies to task=distill (and task=probe), not task={task}")
    if teacher is not None and OmegaConf.select(cfg, "teacher.lora.r") is not None:
        raise ConfigError(f"teacher.lora.r={cfg.teacher.lora.r}: the teacher is the frozen pi_ref and does not "
                          "train; LoRA is the student's option (model.lora.r)")
    if e.name == "library" and setting_task(e.setting) != task:
        kind = "an on-policy distillation loss" if setting_task(e.setting) == "distill" else "an RL KL penalty"
        raise ConfigError(f"estimator.setting={e.setting} is {kind}: it belongs to task={setting_task(e.setting)}, "
                          f"not task={task} (`klbench-audit --all` lists each task's settings)")
    _check_tabular_pair(cfg, teacher)
    from klbench.config.sampler_rules import check_sampler
    check_sampler(cfg, t, e, model)  # task.sampler, task.behaviour
    n = t.n_samples
    _check_micro_batch(cfg, t, e, model)
    _check_placement(t, e, OmegaConf.select(cfg, "kl_ctl.name"))
    if e.name == "loo" and n < 2:
        raise ConfigError(f"estimator loo needs task.n_samples >= 2 (samples per prompt), got {n}")
    _check_reward_term(t, e, reward)
    if model == "tabular" and reward not in ("tabular", "none"):
        raise ConfigError(f"model=tabular needs reward=tabular or reward=none (got reward.kind={reward})")
    if reward == "tabular" and model != "tabular":
        raise ConfigError(f"reward=tabular needs model=tabular (got model.kind={model})")
    if reward == "answer":
        _check_answer(cfg)
    elif cfg.dataset.get("answer_field") is not None:
        raise ConfigError(f"dataset.answer_field={cfg.dataset.answer_field} is read by reward=answer only, got "
                          f"reward={reward}: drop it (dataset.answer_field=null) or use reward=answer")


def _check_micro_batch(cfg: DictConfig, t: TaskRL, e: BaseModel, model: str) -> None:
    """task.micro_batch_size scores a language model's batch in parts (LMPolicy.score); model.gradient_checkpointing
    recomputes the policy's layers. Neither has anything to do elsewhere, and neither is ignored silently."""
    if OmegaConf.select(cfg, "teacher.gradient_checkpointing"):
        raise ConfigError("teacher.gradient_checkpointing=true: the teacher is the frozen pi_ref and computes no "
                          "gradient; checkpointing is the student's option (model.gradient_checkpointing)")
    for key in ("logits_budget", "scoring_path"):  # the student's scoring path is the pair's
        value, declared = OmegaConf.select(cfg, f"teacher.{key}"), _LanguageModel.model_fields[key]
        if value is not None and value != declared.default:
            raise ConfigError(f"teacher.{key}={value}: the pair is scored on one path, which the student's "
                              f"model.{key} chooses; leave the teacher's out")
    m = t.micro_batch_size
    if m is None:
        return
    if model == "tabular":
        raise ConfigError(f"task.micro_batch_size={m}: the tabular model scores a batch by table lookup, with no "
                          "activations to save; it applies to language models (model=embedded or model=hf)")
    n = t.prompts_per_step * t.n_samples
    if m > n:
        raise ConfigError(f"task.micro_batch_size={m} is larger than a step's batch of task.prompts_per_step x "
                          f"task.n_samples = {n} sequences: choose at most {n}, or null to score the batch at once")
    if e.name in ("topk_tail", "topk_trunc"):
        raise ConfigError(f"estimator={e.name} reads the full [B, T, V] logits, which task.micro_batch_size={m} "
                          "never holds for the whole batch: drop task.micro_batch_size (null) or use rb, vopd, seq, "
                          "loo, ...")


def _check_answer(cfg: DictConfig) -> None:
    """reward=answer: reference answers from the dataset, and a pattern exactly where extract=regex reads one."""
    r, ds = cfg.reward, cfg.dataset
    if (r.extract == "regex") != (r.get("pattern") is not None):
        raise ConfigError(f"reward.pattern is read by reward.extract=regex only, and regex needs one: got "
                          f"reward.extract={r.extract}, reward.pattern={r.get('pattern')!r}")
    if ds.source == "embedded":
        raise ConfigError("reward=answer needs prompts with reference answers: dataset=embedded (review openings) has "
                          "none; use dataset=jsonl or dataset=hf with dataset.answer_field=<field>, or experiment=arith")
    if ds.source in ("jsonl", "hf") and ds.get("answer_field") is None:
        raise ConfigError(f"reward=answer needs dataset.answer_field: the {'field' if ds.source == 'jsonl' else 'column'}"
                          f" of dataset={ds.source} holding each prompt's reference answer")


def _check_objectives(cfg: DictConfig, reward: str) -> None:
    """optimized_metrics: what a training run returns to the sweeper and the frontier's axes (reward, KL)."""
    om = cfg.get("optimized_metrics")
    om = list(om) if om is not None else ["val/reward", "val/seq_kl"]
    rewards = ("val/reward", "val/accuracy") if reward == "answer" else ("val/reward",)
    if len(om) != 2 or om[0] not in rewards or om[1] != "val/seq_kl":
        raise ConfigError(f"optimized_metrics must be [<reward metric>, val/seq_kl] with the reward metric one of "
                          f"{', '.join(rewards)} (val/accuracy needs reward=answer); got {om}")


def _check_reward_term(t: TaskRL, e: BaseModel, reward: str) -> None:
    """task.advantage and task.loss_agg shape the reward term (klbench/estimators/advantages.py): a group needs
    n >= 2 samples per prompt, and without a reward term (and no KL put into it) they would be ignored."""
    n, adv = t.n_samples, t.advantage
    before = e.name == "in_reward" and e.kl_norm == "before"
    has_term = before or (reward != "none" and t.reward_coef != 0)
    if adv == "rloo" and has_term and n < 2:
        raise ConfigError(f"the RLOO reward baseline needs task.n_samples >= 2, got {n}")
    if adv in GROUP_ADVANTAGES and adv != "rloo" and n < 2:
        raise ConfigError(f"task.advantage={adv} normalises over the samples of a prompt, but task.n_samples={n} "
                          "gives no group: set task.n_samples >= 2 (or task.advantage=reinforce)")
    if adv == "reinforce" and has_term and n * t.prompts_per_step < 2:
        raise ConfigError("task.advantage=reinforce subtracts the batch mean, which needs at least 2 sequences per "
                          f"step, got task.prompts_per_step x task.n_samples = {t.prompts_per_step * n}")
    if not has_term and (adv != "rloo" or t.loss_agg != "seq_sum"):
        why = "reward=none" if reward == "none" else "task.reward_coef=0"
        raise ConfigError(f"task.advantage={adv} and task.loss_agg={t.loss_agg} shape the reward term, but {why} "
                          "leaves none (and no KL enters it): leave them at rloo and seq_sum")
    if before and (e.form, e.baseline, e.max_weight) != ("sequence", "none", None):
        raise ConfigError("estimator.kl_norm=before puts the sequence KL into the sequence reward, whose advantage is "
                          "its baseline: it needs estimator.form=sequence, estimator.baseline=none and "
                          f"estimator.max_weight=null; got {e.form}, {e.baseline}, {e.max_weight}")


def _check_chat(ds: SimpleNamespace, model: str) -> None:
    """A system prompt is a chat turn; the tabular model has no prompts to render."""
    if ds.system_prompt is not None and not ds.chat_template:
        raise ConfigError("dataset.system_prompt is set, but dataset.chat_template=false: a system prompt is a turn "
                          "of the chat template; set dataset.chat_template=true")
    if ds.chat_template and model == "tabular":
        raise ConfigError("dataset.chat_template=true does nothing with model=tabular, which ignores prompts: set "
                          "dataset.chat_template=false")


def _check_sampling(t: SamplingFields, e: BaseModel | None, ctl: str | None) -> None:
    """The KL target against the sampling (klbench.estimators.sampling.check_target says the same with torch) and,
    for training, against the estimator: kl_target=model samples from a behaviour policy pi_s."""
    if t.kl_target != "model" or is_plain(t.temperature, t.top_k, t.top_p):
        return
    if truncates(t.top_k, t.top_p):
        cut = ", ".join([f"task.top_k={t.top_k}"] * (t.top_k > 0) + [f"task.top_p={t.top_p}"] * (t.top_p < 1))
        raise ConfigError(truncated_model_target(cut))
    if e is None:  # task=probe: its value estimators need y ~ pi, and its rollouts would be pi_s's
        raise ConfigError(f"task=probe with task.kl_target=model and task.temperature={t.temperature}: the probe "
                          "measures the estimators on its own rollouts, which would come from the tempered sampler "
                          "pi_s, not pi; probe task.kl_target=sampler, or the model's KL at task.temperature=1")
    if not corrects_off_policy(e.name, getattr(e, "ratio", None)):
        raise ConfigError(f"task.kl_target=model with task.temperature={t.temperature} takes samples from the "
                          f"tempered sampler pi_s, a behaviour policy, but estimator {e.name}"
                          + (" with ratio=none" if e.name == "in_loss" else "") + " assumes y ~ pi: use an "
                          "off-policy estimator (estimator=rb, in_reward, or in_loss with estimator.ratio=token|"
                          "sequence), or task.kl_target=sampler")
    if t.probe_every is not None:
        raise ConfigError(f"task.probe_every={t.probe_every} with task.kl_target=model and task.temperature="
                          f"{t.temperature}: the probe measures the estimators on y ~ pi, and this run's rollouts "
                          "come from the tempered sampler pi_s; set task.probe_every=null or task.kl_target=sampler")
    if ctl not in (None, "fixed"):
        raise ConfigError(f"kl_ctl={ctl} with task.kl_target=model and task.temperature={t.temperature} is not "
                          "supported: the controller's KL signal is a value estimate, which needs y ~ pi; use "
                          "kl_ctl=fixed or task.kl_target=sampler")


def check_followed_sampling(cfg: DictConfig, temperature: float, top_k: int, top_p: float) -> None:
    """The task's sampling rules again for the sampling a model's generation_config chose instead of task.*'s
    (model.generation_config=follow: known once the model is loaded)."""
    task = cfg.task
    t = SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, kl_target=task.kl_target,
                        probe_every=task.get("probe_every"))
    training = task.name != "probe"
    try:
        _check_sampling(t, _check_group(cfg, "estimator") if training else None,
                        OmegaConf.select(cfg, "kl_ctl.name") if training else None)
    except ConfigError as e:
        raise ConfigError(f"model.generation_config=follow samples with the folder's temperature={temperature:g}, "
                          f"top_k={top_k}, top_p={top_p:g}: {e}") from None


def _check_tabular_pair(cfg: DictConfig, teacher: str | None) -> None:
    """A tabular model's EOS is one of its tokens, and a tabular teacher shares the student's vocabulary."""
    for who in ("model", "teacher"):
        m = cfg.get(who)
        if m is not None and m.kind == "tabular" and m.eos is not None and m.eos >= m.K:
            raise ConfigError(f"{who}.eos must be a token id in [0, {who}.K={m.K}), got {m.eos}")
    if teacher == "tabular":
        _as_config_error(check_tabular_pair, cfg.model, cfg.teacher)


def _as_config_error(check, *args) -> None:
    """A rule the builders check too (klbench.models.pair_rules), its ValueError told as a bad config."""
    try:
        check(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_kl_ctl(t: TaskRL, c: BaseModel) -> None:
    if c.name != "adaptive":
        return
    if t.name == "distill":
        raise ConfigError("task=distill minimises KL(student || teacher) itself: beta stays fixed at 1, so "
                          "kl_ctl must be fixed, got kl_ctl=adaptive")
    if c.init_beta > BETA_MAX:  # KLCtlAdaptive checks > 0; the bound is estimator.beta's (BETA_MAX)
        raise ConfigError(f"kl_ctl.init_beta must be <= {BETA_MAX:g}, like estimator.beta, got {c.init_beta!r}")
    n = t.prompts_per_step * t.n_samples  # sequences per step (per process)
    if c.horizon_unit == "steps" and c.clip >= c.horizon:
        raise ConfigError(f"kl_ctl.horizon={c.horizon} (steps) must exceed kl_ctl.clip={c.clip}: a step could "
                          "otherwise drive beta to 0")
    if c.horizon_unit == "sequences" and c.clip * n >= c.horizon:
        raise ConfigError(f"kl_ctl.horizon={c.horizon} must exceed kl_ctl.clip x sequences per step = "
                          f"{c.clip} x {n}: a step could otherwise drive beta to 0")
    if c.signal == "cv_opt" and n < 2:
        raise ConfigError("kl_ctl.signal=cv_opt fits its multiplier on the step's samples and needs at least "
                          f"2 sequences per step, got task.prompts_per_step x task.n_samples = {n}")


def _check_context(cfg: DictConfig) -> None:
    """An embedded LM's context holds the prompt and the response: task.max_new_tokens must leave room for a
    prompt. (An hf model's context is known once its config is loaded: klbench.models.policies.build_policy; the
    prompts' lengths once they are tokenized: klbench.data.prompts.check_prompt_lengths.)"""
    from klbench.models.embedded.spec import preset_spec  # plain Python, like this module
    m = cfg.task.max_new_tokens
    for who in ("model", "teacher"):
        spec = cfg.get(who)
        if spec is None or spec.kind != "embedded":
            continue
        n = preset_spec(spec.preset, spec.spec)["n_positions"]
        if m >= n:
            raise ConfigError(context_refusal(m, f"embedded {who} (preset {spec.preset})",
                                              f"its {who}.spec.n_positions", n))


def _check_probe_every(t: TaskRL) -> None:
    every = t.probe_every
    if every is None:
        return
    if every % t.val_every != 0:
        raise ConfigError(f"task.probe_every={every} must be a multiple of task.val_every={t.val_every}: the probe "
                          "runs at validations")
    if t.probe is None:
        raise ConfigError("task.probe_every is set but task.probe (the probe's options) is missing")
    _validated(ProbeOptions, t.probe, "task.probe", "task.probe")


def _check_placement(t: TaskRL, e: BaseModel, ctl: str | None) -> None:
    """in_reward / in_loss option combinations (klbench.estimators.placement checks the same with torch), and
    what task.inner_steps > 1 needs: an estimator that corrects for pi_old, rollout-aligned checkpoints."""
    est = e.name
    if est in ("in_reward", "in_loss"):
        if e.value != "cv" and (e.lam != 1.0 or e.level != "token"):
            raise ConfigError(f"estimator.lam and estimator.level apply to estimator.value=cv only, got "
                              f"value={e.value} with lam={e.lam}, level={e.level}")
        per_token = not (e.value == "cv" and e.level == "sequence")
        if est == "in_reward" and e.form == "reward_to_go" and not per_token:
            raise ConfigError("estimator.form=reward_to_go needs a per-token value; value=cv level=sequence has none")
        if est == "in_loss" and e.ratio == "token" and not per_token:
            raise ConfigError("estimator.ratio=token needs a per-token value; value=cv level=sequence has none")
        if est == "in_loss" and e.ratio == "none" and (e.ratio_grad != "detached" or e.max_weight is not None):
            raise ConfigError("estimator.ratio=none has no ratio: ratio_grad must be detached and max_weight null")
        if est == "in_reward" and e.baseline == "loo" and t.n_samples < 2:
            raise ConfigError(f"estimator.baseline=loo needs task.n_samples >= 2, got {t.n_samples}")
    k = t.inner_steps
    if k > 1:
        if not corrects_off_policy(est, getattr(e, "ratio", None)):
            raise ConfigError(f"task.inner_steps={k} trains on samples from the rollout's policy pi_old, but estimator "
                              f"{est}" + (" with ratio=none" if est == "in_loss" else "") + " assumes y ~ pi: use "
                              "estimator=rb, in_reward, or in_loss with estimator.ratio=token|sequence")
        for key in ("val_every", "max_steps"):  # checkpoints (made at validations and the end) start a rollout
            if getattr(t, key) % k:
                raise ConfigError(f"task.{key}={getattr(t, key)} must be a multiple of task.inner_steps={k}, so that "
                                  "every checkpoint falls on a rollout boundary and a resume repeats the run exactly")
        if ctl not in (None, "fixed"):  # its signal is a value estimate, which needs on-policy samples
            raise ConfigError(f"kl_ctl={ctl} with task.inner_steps={k} is not supported: the controller's KL signal "
                              "assumes y ~ pi; use kl_ctl=fixed")


def _check_jsonl(ds: DictConfig, min_train: int) -> None:
    for key in ("train_path", "val_path"):
        try:
            prompts = [p for p, _ in read_rows(ds[key], ds.field, ds.get("answer_field"),
                                               ds.chat_template)]
        except (OSError, ValueError) as e:
            raise ConfigError(f"dataset.{key}: {e}") from None
        if key == "train_path" and len(prompts) < min_train:
            raise ConfigError(f"dataset.train_path: {ds[key]} holds {len(prompts)} prompts, fewer than one step's "
                              f"task.prompts_per_step={min_train}")
