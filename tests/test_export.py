"""klbench-export (issue 42, item 3): a run's checkpointed policy as a save_pretrained folder that transformers
(and peft, for an adapter) loads and that scores a batch with the checkpointed policy's log-probs; its
tokenizer, chat template and a generation_config with the run's sampling beside it; one line for bad input,
nothing overwritten."""
from __future__ import annotations

import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_config import compose_cfg

import cli_inprocess

from klbench.models.policies import LMPolicy
from klbench.record import resume
from klbench.tasks.export import export, load_policy
from klbench.tasks.train import run_task

RUN = ["task.prompts_per_step=4", "task.val_prompts=4", "task.max_new_tokens=8", "task.max_steps=4",
       "task.val_every=4", "task.log_every=1", "task.temperature=0.7", "task.top_p=0.9",
       # naive_mc's per-sample noise moves the policy off pi_ref, so that a wrong export would show
       "estimator=naive_mc", "estimator.beta=1.0"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_arch):
    """A LoRA run on the tiny chat Llama (chat template, two stop ids), recorded in a real MLflow store."""
    tmp = tmp_path_factory.mktemp("lora_run")
    run_task(compose_cfg(tmp, ["model=hf", f"model.name_or_path={tiny_arch('llama')[0]}", "model.lora.r=4", *RUN]))
    return tmp / "run"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_lm_dir):
    """The whole tiny GPT-2 trained (no LoRA)."""
    tmp = tmp_path_factory.mktemp("full_run")
    run_task(compose_cfg(tmp, ["model=hf", f"model.name_or_path={tiny_lm_dir}", "logger=csv", *RUN]))
    return tmp / "run"


def checkpointed(run_dir: Path):
    """The checkpointed policy, loaded as task=probe loads it, and a rollout of it to score."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    cfg = OmegaConf.create(resume.load_payload(str(ckpt))["config"])
    policy, _ = load_policy(cfg, ckpt)
    torch.manual_seed(0)
    return policy, policy.rollout(["the film was", "a slow and quiet"], 3)


def logp(model, tok, ro, policy) -> torch.Tensor:
    """log pi_s of the rollout's response tokens under `model`, scored as `policy` scores (its sampling)."""
    with torch.no_grad():
        batch = LMPolicy(model, model, tok, 8, sampling=policy.sampling, eos_ids=policy.eos_ids).score(ro)
    return batch.logp[batch.mask]


def test_the_merged_export_loads_in_transformers_and_scores_as_the_checkpoint(lora_run, tiny_arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    out = export(str(lora_run))
    assert out == lora_run / "hf" and not (out / "adapter_config.json").exists()
    policy, ro = checkpointed(lora_run)
    with torch.no_grad():
        expected = policy.score(ro)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    got = logp(model, tok, ro, policy)
    want = expected.logp[expected.mask]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # merging W + BA rounds once per weight
    assert not torch.allclose(want, expected.ref_logp[expected.mask], atol=1e-3)  # the trained policy, not the base
    assert tok.chat_template == policy.tok.chat_template and tok.chat_template
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.top_p, gen.max_new_tokens) == (True, 0.7, 0, 0.9, 8)
    assert gen.eos_token_id == list(policy.eos_ids) and len(policy.eos_ids) == 2  # both stop ids


def test_the_adapter_export_loads_in_peft_on_its_base_and_scores_as_the_checkpoint(lora_run, tiny_arch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    out = export(str(lora_run / "checkpoints" / "last.ckpt"), adapter=True)
    assert out == lora_run / "hf-adapter" and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()  # the adapter alone
    policy, ro = checkpointed(lora_run)
    base = AutoModelForCausalLM.from_pretrained(tiny_arch("llama")[0], local_files_only=True)
    model = PeftModel.from_pretrained(base, out)
    got = logp(model, AutoTokenizer.from_pretrained(out, local_files_only=True), ro, policy)
    with torch.no_grad():
        expected = policy.score(ro)
    assert torch.equal(got, expected.logp[expected.mask])  # the same modules, the same arithmetic
    assert GenerationConfig.from_pretrained(out).temperature == 0.7


def test_a_whole_model_export_scores_bit_for_bit(full_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = export(str(full_run), out=str(full_run.parent / "exported" / "gpt2"))
    policy, ro = checkpointed(full_run)
    with torch.no_grad():
        expected = policy.score(ro)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(logp(model, AutoTokenizer.from_pretrained(out, local_files_only=True), ro, policy),
                       expected.logp[expected.mask])


def test_the_end_block_names_the_command(lora_run, full_run, capsys):
    from klbench.console.messages import print_run_where
    cfg = OmegaConf.create(resume.load_payload(str(lora_run / "checkpoints" / "last.ckpt"))["config"])
    print_run_where(cfg, False)
    assert f"klbench: to export   klbench-export {lora_run}   (--adapter: the LoRA adapter alone)" in capsys.readouterr().out
    cfg.paths.ckpt_dir = str(full_run.parent / "elsewhere" / "checkpoints")  # no checkpoint there: no line
    print_run_where(cfg, False)
    assert "klbench-export" not in capsys.readouterr().out


def klbench_export(*args, cwd) -> str:
    proc = cli_inprocess.run(args, cwd=cwd, env=os.environ, main="klbench.tasks.export")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.startswith("klbench-export: error: "), proc.stderr
    return proc.stderr.strip()


def test_bad_input_is_one_line_and_nothing_is_overwritten(tmp_path, full_run):
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "notes.txt").write_text("mine")
    assert "is not a klbench run folder" in klbench_export(tmp_path / "notarun", cwd=tmp_path)
    never = tmp_path / "never"  # a run stopped before its first validation: Hydra's files only
    (never / ".hydra").mkdir(parents=True)
    (never / ".hydra" / "config.yaml").write_text("seed: 0\n")
    assert "never checkpointed" in klbench_export(never, cwd=tmp_path)
    assert "no such file or folder" in klbench_export(tmp_path / "missing", cwd=tmp_path)
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    line = klbench_export(full_run, "--out", target, cwd=tmp_path)
    assert line == f"klbench-export: error: {target} exists; klbench-export never overwrites: give --out a path " \
                   "that does not exist"
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and (target / "keep.txt").read_text() == "mine"
    assert "has no adapter" in klbench_export(full_run, "--adapter", "--out", tmp_path / "new", cwd=tmp_path)
    assert not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder left
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    assert "is not a klbench checkpoint" in klbench_export(junk, cwd=tmp_path)


# ---- issue 50 (round 5) and issue 51 items 1 and 3: exports that lie, lose work or say too much ----

def export_lines(*args, cwd, monkeypatch=None) -> tuple[int, str, str]:
    proc = cli_inprocess.run(args, cwd=cwd, env=os.environ, main="klbench.tasks.export")
    return proc.returncode, proc.stdout, proc.stderr


def tensor_entry(path: Path, tensor: torch.Tensor) -> zipfile.ZipInfo:
    """The archive entry that holds `tensor`'s bytes (torch stores each storage uncompressed as data/<key>)."""
    want = tensor.contiguous().numpy().tobytes()
    with zipfile.ZipFile(path) as z:
        return next(i for i in z.infolist() if "/data/" in i.filename and want in z.read(i))


def test_a_checkpoint_damaged_inside_a_weights_entry_is_refused_naming_the_entry(tmp_path, full_run):
    """Issue 50.1: 1,024 zeroed bytes inside lm_head's entry loaded as weights (torch never checks the CRCs)."""
    ckpt = tmp_path / "last.ckpt"
    shutil.copy(full_run / "checkpoints" / "last.ckpt", ckpt)
    head = torch.load(ckpt, weights_only=True)["state_dict"]["policy.model.lm_head.weight"]
    info = tensor_entry(ckpt, head)
    with open(ckpt, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
        f.write(bytes(1024))
    assert torch.load(ckpt, weights_only=True)["state_dict"]["policy.model.lm_head.weight"].ne(head).any()  # loads
    rc, out, err = export_lines(ckpt, "--out", tmp_path / "x", cwd=tmp_path)
    assert rc == 1 and err.count("\n") == 1 and f"{info.filename} fails the zip archive's CRC-32 check" in err, err
    assert not (tmp_path / "x").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def altered(src: Path, dst: Path, change) -> Path:
    data = torch.load(src, weights_only=True)
    change(data)
    torch.save(data, dst)
    return dst


def test_non_finite_weights_are_refused_naming_the_tensors(tmp_path, full_run):
    """Issue 50.2: a NaN policy exported with exit 0, every tensor NaN."""
    def nan(data):
        data["state_dict"]["policy.model.transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
        data["state_dict"]["policy.model.lm_head.weight"][1, 1] = float("inf")
    ckpt = altered(full_run / "checkpoints" / "last.ckpt", tmp_path / "nan.ckpt", nan)
    rc, out, err = export_lines(ckpt, "--out", tmp_path / "x", cwd=tmp_path)
    # lm_head is tied to wte in GPT-2: three names, two storages
    assert rc == 1 and err.count("\n") == 1 and "non-finite policy weights (NaN or inf) in 3 tensor(s)" in err, err
    assert "model.transformer.h.0.mlp.c_fc.weight" in err and "model.lm_head.weight" in err
    assert not (tmp_path / "x").exists()


def test_the_step_named_is_the_step_written_while_the_run_checkpoints(tmp_path, full_run, monkeypatch, capsys):
    """Issue 50.3: the checkpoint replaced (os.replace, as RecordCheckpoint does) after each of the export's reads:
    three reads named step 4 and wrote step 5's weights. One read gives one version."""
    a = tmp_path / "a.ckpt"
    shutil.copy(full_run / "checkpoints" / "last.ckpt", a)

    def later(data):  # the next checkpoint: another step, other weights
        data["klbench"]["step"] = 5
        for k, v in data["state_dict"].items():
            if k.startswith("policy.") and v.is_floating_point():
                v.add_(1.0)
    b = altered(a, tmp_path / "b.ckpt", later)
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    last = run / "last.ckpt"
    shutil.copy(a, last)
    real, versions = torch.load, [b, a]

    def load_then_replace(*args, **kwargs):
        data = real(*args, **kwargs)
        nxt = versions.pop(0)
        versions.append(nxt)
        shutil.copy(nxt, str(last) + ".tmp")
        os.replace(str(last) + ".tmp", last)
        return data
    monkeypatch.setattr(torch, "load", load_then_replace)
    out = export(str(last), out=str(tmp_path / "x"))
    line = capsys.readouterr().out
    monkeypatch.setattr(torch, "load", real)
    from safetensors.torch import load_file
    wte = load_file(out / "model.safetensors")["transformer.wte.weight"]
    step = int(line.split(" at step ")[1].split()[0])
    written = torch.load(a if step == 4 else b, weights_only=True)["state_dict"]["policy.model.transformer.wte.weight"]
    assert torch.equal(wte, written), line


def test_sigterm_removes_the_hidden_folder_and_the_next_export_removes_stale_ones(tmp_path, full_run):
    """Issue 50.7: SIGTERM during the export left `.<out>.<random>/` (config, weights, no tokenizer) and printed
    nothing; kill -9 leaves one whatever the code does, so the next export to the same target removes it."""
    import signal
    import subprocess
    import sys
    import time
    target = tmp_path / "x"
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT: Ctrl-C, 130
        proc = subprocess.Popen([sys.executable, "-m", "klbench.tasks.export", str(full_run), "--out", str(target)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not [p for p in tmp_path.iterdir() if p.name.startswith(".x.")] and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + sig and err.count("\n") == 1, out + err
        assert f"stopped by {signal.Signals(sig).name}" in err, out + err
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")] and not target.exists()
    dead = subprocess.run(["true"], check=True).args and subprocess.Popen(["true"])  # a pid that has ended
    dead.wait()
    stale = [tmp_path / f".x.{dead.pid}.abcd_123", tmp_path / ".x.k2j4h5g6"]  # killed: this code's and older names
    running = tmp_path / f".x.{os.getpid()}.zzzzzzzz"  # an export still writing: kept
    other = tmp_path / f".y.{dead.pid}.abcd_123"  # another target's
    for p in (*stale, running, other):
        p.mkdir()
        (p / "config.json").write_text("{}")
    rc, out, err = export_lines(full_run, "--out", target, cwd=tmp_path)
    assert rc == 0, err
    for p in stale:
        assert not p.exists() and f"removed {p}, the unfinished folder of an export to {target}" in out
    assert running.exists() and other.exists() and (target / "tokenizer_config.json").is_file()


def test_the_export_follows_the_umask_and_names_an_unfinished_run(tmp_path, full_run):
    """Issue 50.14: mkdtemp's 0700 kept other users and model servers out. 50.16: an export of a run still
    training named its step and not that the run was unfinished."""
    def unfinished(data):
        data["klbench"]["step"] = 2
        data["klbench"]["val_metrics"] = {}
    ckpt = altered(full_run / "checkpoints" / "last.ckpt", tmp_path / "mid.ckpt", unfinished)
    old = os.umask(0o022)
    try:
        rc, out, err = export_lines(ckpt, "--out", tmp_path / "x", cwd=tmp_path)
    finally:
        os.umask(old)
    assert rc == 0, err
    assert (tmp_path / "x").stat().st_mode & 0o777 == 0o755
    assert "at step 2 of 4, an unfinished run (still training, or stopped before task.max_steps)" in out
    rc, out, err = export_lines(full_run, "--out", tmp_path / "y", cwd=tmp_path)
    assert rc == 0 and " at step 4 of " in out and "unfinished" not in out


def test_each_broken_checkpoint_or_target_is_one_line(tmp_path, full_run, read_only, monkeypatch):
    """Issue 50.11 (tracebacks of 11 to 21 lines) and 51.3 (a target that cannot be written is said before the
    model is loaded: for a large model that took minutes)."""
    src = full_run / "checkpoints" / "last.ckpt"
    cases = {
        "empty": (lambda d: d.__setitem__("state_dict", {}), "holds no policy weights (its state_dict has no policy"),
        "nokey": (lambda d: d.pop("state_dict"), "holds no policy weights (it has no state_dict)"),
        "shape": (lambda d: d["state_dict"].__setitem__("policy.model.transformer.ln_f.weight", torch.zeros(3)),
                  "holds policy.model.transformer.ln_f.weight of shape [3], the run's model has [32]"),
    }
    for name, (change, says) in cases.items():
        assert says in klbench_export(altered(src, tmp_path / f"{name}.ckpt", change), "--out", tmp_path / name,
                                      cwd=tmp_path)
    (tmp_path / "file").write_text("mine")
    assert "cannot write" in klbench_export(src, "--out", tmp_path / "file" / "sub" / "x", cwd=tmp_path)
    import klbench.models.policies as policies

    def never(*a, **k):
        raise AssertionError("the model was loaded before the target was checked")
    monkeypatch.setattr(policies, "build_policy", never)
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(ro)
    line = klbench_export(src, "--out", ro / "deeper" / "x", cwd=tmp_path)
    assert line.startswith(f"klbench-export: error: cannot write {ro / 'deeper' / 'x'}"), line
    assert not (ro / "deeper").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, full_run):
    """Issue 50.11: disk full on --out gave 15 and 21 lines (safetensors' writer and the tokenizer's)."""
    import subprocess
    disk = tmp_path / "small"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        rc, out, err = export_lines(full_run, "--out", disk / "x", cwd=tmp_path)
        line = err.strip().splitlines()[-1]  # after the run's own sampling notice (issue 51.6)
        assert rc == 1 and "Traceback" not in err and line.startswith(
            f"klbench-export: error: could not write {disk / 'x'}: No space left on device"), err
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_the_adapter_samples_as_the_run_through_peft_loaders_given_the_line(lora_run, tiny_arch, tmp_path, capsys):
    """Issue 51.1: peft's two loaders take the base folder's generation_config (here temperature 0.9, top-p 0.95,
    repetition_penalty 1.1) and never read the adapter folder's. The export says what to pass; passed, both
    loaders draw the run's tokens (klbench's rollout at the run's sampling, seed for seed)."""
    import json

    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    from klbench.models.rollout import kv_cache_sample
    base = tmp_path / "base"
    shutil.copytree(tiny_arch("llama")[0], base)
    GenerationConfig(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.1,
                     eos_token_id=2).save_pretrained(base)
    out = export(str(lora_run), out=str(tmp_path / "adapter"), adapter=True)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (f"klbench-export: peft samples with the base's generation_config, not this folder's: pass "
                    f"generation_config=GenerationConfig.from_pretrained(\"{out}\") to generate() to sample as the "
                    "run did")
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    policy, _ = checkpointed(lora_run)
    enc = policy.tok(["the film was", "a slow and quiet"], return_tensors="pt", padding=True)
    gen = GenerationConfig.from_pretrained(str(out))  # what the line says to pass, literally
    torch.manual_seed(0)
    with torch.no_grad():
        want = kv_cache_sample(policy.model, enc.input_ids, enc.attention_mask, gen.max_new_tokens, policy.eos_ids,
                               policy.tok.pad_token_id, policy.sampling).tokens
    loaded = {"AutoPeftModelForCausalLM": AutoPeftModelForCausalLM.from_pretrained(out),
              "PeftModel": PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)}
    for name, model in loaded.items():
        assert model.generation_config.repetition_penalty == 1.1, name  # why the line is needed
        torch.manual_seed(0)
        with torch.no_grad():
            got = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, generation_config=gen)
        assert torch.equal(got[:, enc.input_ids.shape[1]:], want), name
