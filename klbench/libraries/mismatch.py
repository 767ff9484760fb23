"""The libraries' rollout corrections on the mismatch axis (klbench.exact.mismatch, docs/mismatch.md).

Each setting is a library's own correction code with the two log-probs a vLLM pipeline has: the rollout engine's
(the sampler pi_s: KLBatch.old_logp) and the trainer's recomputation of the rollout policy (same weights as pi, the
trainer's arithmetic: logp.detach()). Its terms, audited separately:
  kl_loss    the KL term in the loss, advantages 0 (what the correction does, or not, to it)
  kl_reward  a k1 KL in the reward on the log-probs the library charges (the trainer's, or the sampler's where the
             library substitutes them), as a return-to-go advantage through the library's own corrected PG loss
  pg         the library's own corrected PG loss with advantage R(y) per sequence (no KL)
Every loss is formed per sequence; the libraries' batch normalisers are per-step constants (docs/libraries.md).
What is klbench's and not the library's: the reward-to-go advantage (no critic, no group baseline, no whitening).
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import LibraryMissing, line_of, package_file, require

ZERO = torch.zeros(())


@dataclass
class MismatchSetting:
    name: str
    library: str  # "trl 1.16.0"
    terms: dict[str, Callable] = field(default_factory=dict)  # kl_loss / kl_reward: f(batch); pg: f(batch, reward)
    source: str = ""  # file:line of the correction in the installed package
    note: str = ""


def _trainer_old(batch: KLBatch) -> torch.Tensor:
    """[B, T] the trainer's recomputation of the rollout policy's log-probs: pi's, detached; padding 0."""
    return torch.where(batch.mask, batch.logp.detach(), ZERO.to(batch.logp.dtype))


def _sampler(batch: KLBatch) -> torch.Tensor:
    """[B, T] the rollout engine's log-probs that travel with the samples (old_logp; pi's when none)."""
    s = batch.logp.detach() if batch.old_logp is None else batch.old_logp
    return torch.where(batch.mask, s, ZERO.to(s.dtype))


def kl_to_go(kl: torch.Tensor, batch: KLBatch) -> torch.Tensor:
    """[B, T] the return-to-go sum_{s>=t} kl_s of a token-level KL cost, detached: an advantage is its negative."""
    kl = torch.where(batch.mask, kl.to(batch.logp.dtype), ZERO.to(batch.logp.dtype)).detach()
    return kl.flip(-1).cumsum(-1).flip(-1)


# ---- TRL: GRPOTrainer's vLLM importance-sampling correction ----

def _trl_ratio_block(GRPOTrainer):
    """The installed `if self.use_vllm and self.vllm_importance_sampling_correction:` block of
    _generate_and_score_completions that computes vllm_importance_sampling_ratio, compiled alone from the file's
    own text (line numbers kept): it sits inside generation, which cannot run here."""
    import inspect
    path = inspect.getsourcefile(GRPOTrainer)
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_"
                "correction" and "vllm_importance_sampling_ratio = torch.exp" in ast.unparse(node)):
            return compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), node.lineno
    raise LibraryMissing("trl: the vLLM importance-sampling ratio block was not found in grpo_trainer.py")


TRL_MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_settings() -> list[MismatchSetting]:
    from klbench.libraries import trl as T
    version = require(T.DIST, T.SUPPORTED)
    from trl import GRPOConfig, GRPOTrainer
    code, line = _trl_ratio_block(GRPOTrainer)
    from klbench.libraries.base import _relative
    import inspect
    where = f"{_relative(inspect.getsourcefile(GRPOTrainer))}:{line}"
    applied = line_of(GRPOTrainer._compute_loss, 'per_token_loss * inputs["importance_sampling_ratio"]')
    out, trainers = [], []
    for mode in TRL_MODES:
        over = {"vllm_importance_sampling_correction": mode != "off"}
        if mode != "off":
            over["vllm_importance_sampling_mode"] = mode
        kl_tr = T._grpo_trainer(GRPOTrainer, GRPOConfig, {**over, "beta": 1.0}, None)
        pg_tr = T._grpo_trainer(GRPOTrainer, GRPOConfig, {**over, "beta": 0.0}, None)
        for t in (kl_tr, pg_tr):  # as GRPOTrainer.__init__ sets them from args; vLLM is the rollout engine
            t.use_vllm = True
            t.vllm_importance_sampling_mode = t.args.vllm_importance_sampling_mode
            t.vllm_importance_sampling_clip_max = t.args.vllm_importance_sampling_clip_max
            t.vllm_importance_sampling_clip_min = t.args.vllm_importance_sampling_clip_min
            trainers.append(t)

        def run(trainer, batch: KLBatch, adv: torch.Tensor) -> torch.Tensor:
            old, samp = _trainer_old(batch), _sampler(batch)
            ref = torch.where(batch.mask, batch.ref_logp, ZERO.to(batch.ref_logp.dtype))

            def extra(b):
                d = {"advantages": adv[b:b + 1], "ref_per_token_logps": ref[b:b + 1], "old_per_token_logps":
                     old[b:b + 1], "num_items_in_batch": torch.tensor(1.0, dtype=batch.logp.dtype)}
                if trainer.vllm_importance_sampling_correction:
                    ns = {"self": trainer, "torch": torch, "math": math, "tool_mask": None,
                          "completion_mask": batch.mask[b:b + 1].long(), "old_per_token_logps": old[b:b + 1],
                          "sampling_per_token_logps": samp[b:b + 1]}
                    exec(code, ns)
                    d["importance_sampling_ratio"] = ns["vllm_importance_sampling_ratio"]
                    d["sampling_per_token_logps"] = samp[b:b + 1]
                return d
            return T._per_row(trainer, batch, extra)

        a = pg_tr.args
        note = (f"vllm_importance_sampling_correction={a.vllm_importance_sampling_correction}" +
                (f", mode={a.vllm_importance_sampling_mode}, clip_max={a.vllm_importance_sampling_clip_max}, "
                 f"clip_min={a.vllm_importance_sampling_clip_min}" if mode != "off" else "") +
                f"; KL: beta=1, use_bias_correction_kl={a.use_bias_correction_kl}, loss_type={a.loss_type}")
        out.append(MismatchSetting(
            f"trl.grpo.vllm_is.{mode}", f"trl {version}",
            {"kl_loss": lambda batch, t=kl_tr: run(t, batch, torch.zeros(batch.logp.shape[0], dtype=batch.logp.dtype)),
             "pg": lambda batch, r, t=pg_tr: run(t, batch, r.to(batch.logp.dtype))},
            f"ratio {where}; applied {applied}" if mode != "off" else applied, note))
    acc = T._accelerator()  # made after every config, as trl.load does: TrainingArguments resets its state
    for t in trainers:
        t.accelerator = acc
    return out


# ---- verl: rollout correction (decoupled: three policies; bypass: the rollout's log-probs as old) ----

VERL_PRESETS = ("decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs",
                "bypass_ppo_clip", "bypass_pg_is", "bypass_pg_token_icepop")


def verl_settings() -> list[MismatchSetting]:
    from klbench.libraries import verl as V
    version = require(V.DIST, V.SUPPORTED)
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos, rollout_corr_helper as rch
    from verl.workers.utils.losses import ppo_loss

    from verl.workers.config import ActorConfig

    from omegaconf import OmegaConf
    from verl.workers.config.actor import PolicyLossConfig

    def config(rc, kl_loss: bool, proto=None):
        """The actor's config; in bypass mode after the library's own apply_bypass_mode has rewritten the driver's
        policy_loss DictConfig (loss_mode, rollout_correction) and old_log_probs, as ray_trainer does."""
        policy_loss = PolicyLossConfig()
        if proto is not None:
            driver = OmegaConf.create({"loss_mode": policy_loss.loss_mode})
            rch.apply_bypass_mode(proto, rc, driver)
            policy_loss = PolicyLossConfig(loss_mode=driver.loss_mode, rollout_correction=driver.rollout_correction)
        return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_kl_loss=kl_loss,
                           kl_loss_coef=1.0, kl_loss_type="low_var_kl+", policy_loss=policy_loss)

    def run(preset: str, batch: KLBatch, adv: torch.Tensor, kl_loss: bool) -> torch.Tensor:
        rc = getattr(RolloutCorrectionConfig, preset)()
        old, samp = _trainer_old(batch), _sampler(batch)
        ref = torch.where(batch.mask, batch.ref_logp, ZERO.to(batch.ref_logp.dtype))
        if rc.bypass_mode:  # the library's own setup: old_log_probs := rollout_log_probs, loss_mode bypass_mode
            proto = DataProto.from_dict(tensors={"rollout_log_probs": samp})
            cfg = config(rc, kl_loss, proto)
            old = proto.batch["old_log_probs"]
        out = []
        for b in range(batch.logp.shape[0]):
            model_output, data = V._row_data(batch, b, old, ref)
            if not rc.bypass_mode:
                weights, mask, _ = rch.compute_rollout_correction_and_rejection_mask(
                    old[b:b + 1], samp[b:b + 1], batch.mask[b:b + 1].long(), rollout_is=rc.rollout_is,
                    rollout_is_threshold=rc.rollout_is_threshold,
                    rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
                    rollout_rs_threshold=rc.rollout_rs_threshold)
                cfg = config(rc, kl_loss)
                if weights is not None:
                    data["rollout_is_weights"] = weights.batch["rollout_is_weights"].to(batch.logp.dtype)
                data["response_mask"] = mask.long()  # rejection: the trainer replaces the batch's response_mask
            data["advantages"] = adv[b:b + 1].to(batch.logp.dtype)
            out.append(ppo_loss(cfg, model_output, data)[0])
        return torch.stack(out)

    def reward_kl(preset: str, batch: KLBatch) -> torch.Tensor:
        bypass = getattr(RolloutCorrectionConfig, preset)().bypass_mode
        charged = _sampler(batch) if bypass else _trainer_old(batch)  # apply_kl_penalty reads old_log_probs
        kld = core_algos.kl_penalty(charged, batch.ref_logp, kl_penalty="kl")
        return run(preset, batch, -kl_to_go(kld, batch), False)

    zero_adv = lambda batch: torch.zeros_like(batch.logp.detach())  # noqa: E731
    where = V.source_of(rch.compute_rollout_correction_and_rejection_mask)
    out = []
    for preset in VERL_PRESETS:
        rc = getattr(RolloutCorrectionConfig, preset)()
        src = V.source_of(core_algos.compute_policy_loss_bypass_mode) if rc.bypass_mode else where
        note = (f"RolloutCorrectionConfig.{preset}(): rollout_is={rc.rollout_is}, threshold={rc.rollout_is_threshold}"
                f", rollout_rs={rc.rollout_rs}, rs_threshold={rc.rollout_rs_threshold}, bypass_mode={rc.bypass_mode}"
                f", loss_type={rc.loss_type}; KL loss low_var_kl+, KL reward k1 on "
                f"{'rollout_log_probs' if rc.bypass_mode else 'old_log_probs'}")
        out.append(MismatchSetting(
            f"verl.rollout_corr.{preset}", f"verl {version}",
            {"kl_loss": lambda batch, p=preset: run(p, batch, zero_adv(batch), True),
             "kl_reward": lambda batch, p=preset: reward_kl(p, batch),
             "pg": lambda batch, r, p=preset: run(p, batch, r.to(batch.logp.dtype)[:, None].expand_as(batch.logp),
                                                  False)},
            src, note))
    return out


# ---- OpenRLHF: PolicyLoss's train/rollout correction ----

OPENRLHF_MODES = {"off": ("off", "mask"), "token_mask": ("token", "mask"), "token_clip": ("token", "clip"),
                  "seq_mask": ("seq", "mask")}


def _openrlhf_loss_module():
    """openrlhf/models/loss.py loaded by path as a submodule of a stand-in package, its `.utils` the installed
    models/utils.py (loaded as the audit's OpenRLHF adapter loads it, deepspeed stubbed during the load)."""
    import importlib.util
    import sys
    import types
    from klbench.libraries.openrlhf import _load_utils
    pkg = "klbench_openrlhf_models"
    if pkg + ".loss" in sys.modules:
        return sys.modules[pkg + ".loss"]
    sys.modules.setdefault(pkg, types.ModuleType(pkg)).__path__ = []
    sys.modules[pkg + ".utils"] = _load_utils()
    spec = importlib.util.spec_from_file_location(pkg + ".loss", package_file("openrlhf", "models", "loss.py"))
    module = importlib.util.module_from_spec(spec)
    module.__package__ = pkg
    spec.loader.exec_module(module)
    sys.modules[pkg + ".loss"] = module
    return module


def openrlhf_settings() -> list[MismatchSetting]:
    from klbench.libraries import openrlhf as O
    version = require(O.DIST, O.SUPPORTED)
    loss_mod, utils = _openrlhf_loss_module(), O._load_utils()

    def run(pl, batch: KLBatch, adv: torch.Tensor) -> torch.Tensor:
        old, samp = _trainer_old(batch), _sampler(batch)
        out = []
        for b in range(batch.logp.shape[0]):
            m = batch.mask[b:b + 1]
            loss = pl(batch.masked_logp[b:b + 1], old[b:b + 1], adv[b:b + 1], action_mask=m,
                      rollout_log_probs=samp[b:b + 1], batch_num_tokens=1.0, global_batch_size=1.0)[0]
            out.append(loss)
        return torch.stack(out)

    def reward_kl(pl, batch: KLBatch) -> torch.Tensor:  # the experience maker's k1, on the actor's log-probs
        kl = utils.compute_approx_kl(_trainer_old(batch), batch.ref_logp, kl_estimator="k1")
        return run(pl, batch, -kl_to_go(kl, batch))

    src = V_src = O.source_of(loss_mod.PolicyLoss.forward)
    out = []
    for name, (level, mode) in OPENRLHF_MODES.items():
        pl = loss_mod.PolicyLoss(is_correction_level=level, is_correction_mode=mode)
        note = (f"PolicyLoss(is_correction_level={level}, is_correction_mode={mode}, gating=ratio, threshold="
                f"{tuple(pl.is_correction_threshold)}); KL reward k1 on the actor's log-probs")
        out.append(MismatchSetting(
            f"openrlhf.is_correction.{name}", f"openrlhf {version}",
            {"kl_reward": lambda batch, pl=pl: reward_kl(pl, batch),
             "pg": lambda batch, r, pl=pl: run(pl, batch, r.to(batch.logp.dtype)[:, None].expand_as(batch.logp))},
            V_src if name != "off" else src, note))
    return out


# ---- AReaL: the decoupled PPO objective (proximal = the trainer's recompute, behaviour = the engine's) ----

AREAL_MODES = {"off": None, "token_mask": {}, "token_clamp": {"action": "clamp"},
               "sequence_mask": {"level": "sequence"}}


def _areal_functions():
    """ppo_actor_loss_fn with apply_rejection_sampling and their helpers from the installed functional.py, and
    RejectionSamplingConfig from cli_args.py, compiled alone from the files' own text (both modules import AReaL's
    runtime at module level, which klbench does not install)."""
    import dataclasses
    import sys
    import types
    import typing
    module = types.ModuleType("klbench_areal_functional")  # dataclass() looks its module up in sys.modules
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update({"torch": torch, "dataclass": dataclasses.dataclass, "field": dataclasses.field, "Any": typing.Any})
    for rel, names in (("api/cli_args.py", {"RejectionSamplingConfig"}),
                       ("utils/functional/functional.py", {"RejectionSamplingResult", "_check_bounds",
                                                           "apply_rejection_sampling", "ppo_actor_loss_fn",
                                                           "_compute_sequence_level_ratio_and_advantages"})):
        path = package_file("areal", *rel.split("/"))
        tree = ast.parse(open(path).read(), path)
        nodes = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names]
        if {n.name for n in nodes} != names:
            raise LibraryMissing(f"areal: {sorted(names - {n.name for n in nodes})} not found in {rel}")
        exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), ns)
        ns.setdefault("_lines", {}).update({n.name: f"areal/{rel}:{n.lineno}" for n in nodes})
    return ns


def areal_settings() -> list[MismatchSetting]:
    from klbench.libraries import areal as A
    version = require(A.DIST, A.SUPPORTED)
    fn = _areal_functions()
    kl_line = _line("areal", "trainer/ppo/actor.py", "rewards = -self.kl_ctl * self.kl_estimator(old_logp")
    eng_line = _line("areal", "trainer/ppo/actor.py", 'old_logp = torch.roll(data["logprobs"]')

    def run(cfg, batch: KLBatch, adv: torch.Tensor) -> torch.Tensor:
        old, samp = _trainer_old(batch), _sampler(batch)
        out = []
        for b in range(batch.logp.shape[0]):
            m = batch.mask[b:b + 1]
            # decoupled: proximal = the trainer's recompute, old = the engine's; off: both the recompute
            behave = samp[b:b + 1] if cfg is not None else old[b:b + 1]
            loss, _ = fn["ppo_actor_loss_fn"](batch.masked_logp[b:b + 1], old[b:b + 1], behave, adv[b:b + 1], 0.2, m,
                                              rejection_sampling=cfg)
            out.append(loss * m.sum())  # its token mean times the count: the token sum (a per-step constant)
        return torch.stack(out)

    def reward_kl(cfg, batch: KLBatch) -> torch.Tensor:  # use_decoupled_loss: the engine's log-probs are charged
        charged = _sampler(batch) if cfg is not None else _trainer_old(batch)
        from klbench.libraries.areal import _load_class
        kl = _load_class()[0]("k1")(charged, batch.ref_logp)
        return run(cfg, batch, -kl_to_go(kl, batch))

    out = []
    for name, over in AREAL_MODES.items():
        cfg = None if over is None else fn["RejectionSamplingConfig"](**over)
        note = ("use_decoupled_loss=False, recompute_logprob=True (no correction)" if cfg is None else
                f"use_decoupled_loss=True, RejectionSamplingConfig(level={cfg.level}, action={cfg.action}, "
                f"metric={cfg.metric}, upper={cfg.upper}, lower={cfg.lower}); eps_clip 0.2") + \
            f"; KL reward k1 on old_logp ({kl_line}; decoupled: the engine's, {eng_line})"
        out.append(MismatchSetting(
            f"areal.decoupled.{name}", f"areal {version}",
            {"kl_reward": lambda batch, cfg=cfg: reward_kl(cfg, batch),
             "pg": lambda batch, r, cfg=cfg: run(cfg, batch, r.to(batch.logp.dtype)[:, None].expand_as(batch.logp))},
            fn["_lines"]["ppo_actor_loss_fn"], note))
    return out


def _line(dist: str, path: str, text: str) -> str:
    from klbench.libraries.base import line_in
    return line_in(dist, path, text)


LOADERS = {"trl": trl_settings, "verl": verl_settings, "openrlhf": openrlhf_settings, "areal": areal_settings}
# skyrl-train 0.3.1 has no rollout correction in its KL path; skyrl 0.4.0 (its successor) installs only with
# --ignore-requires-python and its package imports need its runtime: scripts/audit_versions.py audits its KL there
NOT_ON_AXIS = {"skyrl_train": "skyrl-train 0.3.1's KL loss carries no gradient at all (@torch.no_grad, "
                              "docs/libraries.md): zero on every mismatch; no rollout correction to audit",
               "tinker_cookbook": "the update runs on the remote tinker service: its correction cannot be called"}


def settings(names: list[str] | None = None) -> list[MismatchSetting | tuple[str, str]]:
    """Every library's mismatch settings; a library that does not load is (name, one-line reason)."""
    out = []
    for name in names or list(LOADERS):
        try:
            out.extend(LOADERS[name]())
        except LibraryMissing as e:
            out.append((name, str(e)))
    return out
