"""Every option of every config group composes, and the run pieces it selects build."""
from __future__ import annotations

from pathlib import Path

import pytest

from klbench.config.compose import compose

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {g: sorted(p.stem for p in (ROOT / "conf" / g).glob("*.yaml"))
          for g in ("task", "estimator", "kl_ctl", "model", "dataset", "reward", "hardware", "logger", "store",
                    "experiment")}


def compose_cfg(tmp_path, overrides=()):
    """The tests' shorthand: `klbench <overrides>` with its outputs and run folders in tmp_path (never the repo's)."""
    return compose(overrides, outputs=tmp_path / "outputs", run_dir=tmp_path / "run")


def test_every_group_has_options():
    for group, options in GROUPS.items():
        assert options, f"conf/{group} is empty"
    assert set(GROUPS["estimator"]) == {"naive_mc", "naive_cv", "token", "seq", "cumulative", "loo", "rb",
                                        "in_reward", "in_loss", "library", "trl_grpo", "verl_low_var_kl", "vopd",
                                        "topk_tail", "topk_trunc", "k3_in_reward", "frpo", "kl_before", "kl_fused"}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_option_composes(tmp_path, group, option):
    cfg = compose_cfg(tmp_path, [f"{group}={option}"])
    assert cfg.task.name and cfg.estimator.name and cfg.model.kind and cfg.reward.kind


@pytest.mark.parametrize("name", GROUPS["estimator"])
def test_estimator_option_builds(tmp_path, name):
    from klbench.estimators import GRADIENT_ESTIMATORS, gradient_estimator
    from klbench.tasks.train import check_config
    cfg = compose_cfg(tmp_path, [f"estimator={name}"])
    check_config(cfg)
    est = cfg.estimator.name  # `name`, or for a named library setting (trl_grpo) "library"
    if est == "library":
        from klbench.libraries import LibraryMissing, load
        try:
            load(cfg.estimator.setting.split(".")[0])
        except LibraryMissing as e:
            pytest.skip(f"estimator={name}: {e}")
        import klbench.libraries.estimator  # noqa: F401  registers "library", as the RL task does
    opts = {k: v for k, v in cfg.estimator.items() if k not in ("name", "beta")}
    assert gradient_estimator(est, **opts).name == est
    if name in ("trl_grpo", "verl_low_var_kl"):  # the named library options run the setting their name says
        assert cfg.estimator.setting == {"trl_grpo": "trl.grpo", "verl_low_var_kl": "verl.kl_penalty.low_var_kl"}[name]
    assert set(opts) <= set(GRADIENT_ESTIMATORS[est].defaults)


# ---- what only the built model tells: its context (tiny_lm_dir: n_positions=64) ----

def hf_cfg(tmp_path, tiny_lm_dir, *more):
    return compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}", *more])


def test_max_new_tokens_beyond_an_hf_context_is_refused(tmp_path, tiny_lm_dir):
    from klbench.models.policies import build_policy
    cfg = hf_cfg(tmp_path, tiny_lm_dir, "task.max_new_tokens=64")
    with pytest.raises(ValueError, match=r"^task\.max_new_tokens=64 does not fit .* n_positions=64 .* must be < 64"):
        build_policy(cfg.model, cfg.task.max_new_tokens)
    assert build_policy(cfg.model, 63).context == ("n_positions", 64)


def test_a_prompt_longer_than_the_context_is_named_when_the_data_is_loaded(tmp_path, tiny_lm_dir):
    import json

    from klbench.models.policies import build_policy
    from klbench.tasks.train import build_data
    long = " ".join(["the movie was great"] * 40)  # far over 64 tokens
    train = tmp_path / "train prompts.jsonl"
    train.write_text("".join(json.dumps({"text": p}) + "\n" for p in ["a film", long, "the plot"] * 4))
    (tmp_path / "val.jsonl").write_text(json.dumps({"text": "the end"}) + "\n")
    cfg = hf_cfg(tmp_path, tiny_lm_dir, "dataset=jsonl", f"dataset.train_path={train}",
                 f"dataset.val_path={tmp_path}/val.jsonl", "dataset.field=text", "task.max_new_tokens=16")
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    with pytest.raises(ValueError) as e:
        build_data(cfg, policy.fixed_prompt, policy)
    msg = str(e.value)
    assert msg.startswith(f"dataset.train_path={train} (field 'text'): its longest prompt (#2: 'the movie"), msg
    assert "task.max_new_tokens=16" in msg and "(n_positions=64)" in msg and "at most 48 tokens" in msg
    # prompts that reach the model another way (task=probe) are stopped at the rollout, not by an IndexError
    with pytest.raises(ValueError, match=r"has \d+ tokens; with task\.max_new_tokens=16 .* \(n_positions=64\)"):
        policy.rollout(["a film", long], 1)
    short = [" ".join(["the movie was great"] * 2)] * 12
    train.write_text("".join(json.dumps({"text": p}) + "\n" for p in short))
    assert build_data(cfg, policy.fixed_prompt, policy).train == short


def test_a_tabular_step_of_100000_prompts_is_one_block(tmp_path):
    """task.prompts_per_step=100000 on the tabular model was slow: past 2^20 / K rows the exact per-position
    KL looped over sequences in Python (what it cost: docs/estimators.md, "Small vocabularies"). The tabular
    batch is one block."""
    from klbench.estimators import gradient_estimator
    from klbench.models.policies import build_policy
    cfg = compose_cfg(tmp_path, ["experiment=tabular", "task.prompts_per_step=100000"])
    policy = build_policy(cfg.model, 1)
    batch = policy.score(policy.rollout([policy.fixed_prompt] * cfg.task.prompts_per_step, cfg.task.n_samples))
    assert batch.mask.shape == (400_000, cfg.model.T) and batch.chunk_rows >= batch.mask.numel()
    gradient_estimator("rb")(batch).mean().backward()
    assert policy.theta.grad.isfinite().all()


# ---- local DDP listens on loopback only ----

def listening(pids: set[int]) -> dict[int, list[str]]:
    """pid -> the TCP addresses ("127.0.0.1:41237", "::ffff:...") it listens on, from /proc."""
    import os
    import socket
    owner = {}  # socket inode -> pid
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # exited meanwhile
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    out: dict[int, list[str]] = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()  # local address, state (0A: LISTEN) and inode are columns 1, 3 and 9
            if cols[3] == "0A" and cols[9] in owner:
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)  # 32-bit words in little-endian order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.setdefault(owner[cols[9]], []).append(f"{socket.inet_ntop(family, raw)}:{int(hexport, 16)}")
    return out


def process_tree(root: int) -> set[int]:
    import os
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from Linux's /proc")
def test_local_ddp_listens_on_loopback_only(tmp_path):
    """torch's TCPStore listens on every interface whatever MASTER_ADDR says; klbench hosts it on 127.0.0.1
    (klbench.tasks.train.local_ddp_store). Every socket the 2 ranks listen on, sampled through the run, is loopback."""
    import ipaddress
    import os
    import subprocess
    import sys
    import time
    env = {**os.environ, "KLBENCH_OUTPUTS": str(tmp_path / "outputs"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for var in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(var, None)
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "klbench.cli", "experiment=tabular", "hardware=ddp",
                                 "hardware.accelerator=cpu", "hardware.devices=2", "task.max_steps=200",
                                 "logger=none"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        seen: dict[int, set[str]] = {}
        while proc.poll() is None:
            for pid, addrs in listening(process_tree(proc.pid)).items():
                seen.setdefault(pid, set()).update(addrs)
            time.sleep(0.25)
    assert proc.returncode == 0, (tmp_path / "log").read_text()[-3000:]
    assert len(seen) >= 2, seen  # both ranks listen (gloo), rank 0 also serves the store
    addrs = {a for s in seen.values() for a in s}
    assert all(ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback for a in addrs), seen


# ---- renamed for issue 46, accepted for one release: kl_norm=fused is kl_norm=before, kl_fused is kl_before ----

def test_old_kl_norm_name_is_the_new_one_with_one_line(tmp_path, capsys, monkeypatch):
    """estimator=kl_fused and estimator.kl_norm=fused still run, as kl_before, and say the new names once."""
    import klbench.estimators.options as options
    from klbench.config.schema import validate
    from klbench.estimators import gradient_estimator
    monkeypatch.setattr(options, "_told", set())
    new = compose_cfg(tmp_path, ["estimator=kl_before"])
    old = compose_cfg(tmp_path, ["estimator=kl_fused"])
    assert new.estimator.kl_norm == "before" and old.estimator.kl_norm == "fused"
    assert {**old.estimator, "kl_norm": "before"} == dict(new.estimator)
    validate(new)
    assert capsys.readouterr().err == ""
    validate(old)
    assert gradient_estimator("in_reward", kl_norm="fused").kl_norm == "before"
    err = capsys.readouterr().err.splitlines()
    assert err == [options.RENAMED[("kl_norm", "fused")][1]], err
    assert "kl_norm=before" in err[0] and "estimator=kl_before" in err[0]
    # the old name keeps its refusals, worded with the new one
    from klbench.config.schema import ConfigError
    with pytest.raises(ConfigError, match="estimator.kl_norm=before puts the sequence KL"):
        validate(compose_cfg(tmp_path, ["estimator=kl_fused", "estimator.baseline=loo"]))


def test_arith_checkpoint_from_before_the_chat_keys_resumes(tmp_path):
    """dataset=arith's config gained chat_template and system_prompt (every dataset declares them) with issue 46:
    a checkpoint made before, without them, is no config change."""
    from omegaconf import OmegaConf
    from klbench.record.resume import config_changes
    cfg = compose_cfg(tmp_path, ["experiment=arith"])
    saved = OmegaConf.to_container(cfg, resolve=True)
    del saved["dataset"]["chat_template"], saved["dataset"]["system_prompt"]
    assert config_changes(saved, cfg) == []
    saved["dataset"]["chat_template"] = True
    assert config_changes(saved, cfg) == ["dataset.chat_template (True in the checkpoint, False now)"]
