"""Issue 43, "when things go wrong, round 4": each defect as the issue reproduced it, on real parts (tiny
save_pretrained folders, real klbench processes, real MLflow stores and Optuna studies). Each test failed on the
code before the fix."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cli_inprocess
from klbench.record import runs
from test_record import all_runs, client_of, env_for


def klbench(outputs: Path, *overrides: str, env: dict | None = None, timeout: int = 300):
    """The CLI in this process (tests/cli_inprocess.py); the parallel and killed runs below are processes."""
    return cli_inprocess.run(overrides, cwd=outputs.parent, env={**env_for(outputs), **(env or {})})


def one_line_error(proc, *words: str) -> str:
    """The process failed with klbench's one line (no traceback), holding every one of `words`."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("klbench: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


# ---- 1, 3 and the base's fingerprint: what a LoRA checkpoint must hold to resume ----

def _lora_args(base: str, run_dir: Path, *extra: str) -> list[str]:
    # naive_mc at beta 1 moves the adapter off zero (the random model earns no reward), so that a resume from a
    # zeroed adapter would differ
    return ["model=hf", f"model.name_or_path={base}", "model.lora.r=4", "estimator=naive_mc", "estimator.beta=1.0",
            "task.prompts_per_step=4", "task.val_prompts=4", "task.max_new_tokens=8", "task.val_every=4",
            "task.log_every=1", f"hydra.run.dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def finished_lora(tmp_path_factory, tiny_arch):
    """A LoRA run of 8 steps, FINISHED, on a copy of the tiny Llama whose generation_config adds
    repetition_penalty. Each test that changes its files puts them back."""
    tmp = tmp_path_factory.mktemp("lora")
    base = str(shutil.copytree(tiny_arch("llama")[0], tmp / "base"))
    generation = Path(base, "generation_config.json")
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "repetition_penalty": 1.2}))
    outputs, run_dir = tmp / "outputs", tmp / "D"
    first = klbench(outputs, *_lora_args(base, run_dir, "task.max_steps=8"))
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = all_runs(client_of(outputs))
    return SimpleNamespace(base=base, outputs=outputs, run_dir=run_dir, first=first, run=run,
                           ckpt=run_dir / "checkpoints" / "last.ckpt")


def _refused_resume(lora, *extra: str, allow: str = "task.max_steps"):
    """A resume to step 12 of the finished run: refused in one line, the run left FINISHED as it was."""
    proc = klbench(lora.outputs, *_lora_args(lora.base, lora.run_dir, "task.max_steps=12", "ckpt_path=last",
                                             f"ckpt_allow_changes=[{allow}]", *extra))
    (now,) = all_runs(client_of(lora.outputs))
    assert now.info.status == "FINISHED" and now.info.end_time == lora.run.info.end_time
    assert now.data.tags[runs.STEPS_DONE] == "8"
    return proc


def test_a_lora_run_says_what_it_uses(finished_lora):
    """Issue 42, item 5: stop ids, LoRA's rank, modules and trainable parameters, and the generation options the
    run does not apply, once at the start and as params; the run's name carries the rank."""
    out, run = finished_lora.first.stdout, finished_lora.run
    for line in ("klbench: a response ends at any of the tokens 1 (</s>), 4 (<|im_end|>)\n",
                 "klbench: LoRA rank 4 (alpha 16) on q_proj, v_proj (peft's default): 896 trainable parameters of ",
                 f"klbench: {finished_lora.base}'s generation_config sets repetition_penalty=1.2, which klbench does "
                 "not apply"):
        assert out.count(line) == 1, out[-3000:]
    assert {k: v for k, v in run.data.params.items() if k.startswith("used.")} == {
        "used.stop_ids": "1 (</s>), 4 (<|im_end|>)", "used.lora_rank": "4", "used.lora_modules": "q_proj,v_proj",
        "used.trainable_params": "896", "used.generation_config.unapplied": "repetition_penalty=1.2"}
    assert run.info.run_name == "naive_mc b=1 r=4 s0 rl-hf"


def test_a_checkpoint_without_the_adapter_is_refused(finished_lora):
    """Defect 1: last.ckpt rewritten with an empty state_dict resumed silently from a zero adapter, FINISHED."""
    ckpt, intact = finished_lora.ckpt, finished_lora.ckpt.read_bytes()
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved["state_dict"] = {}
    torch.save(saved, ckpt)
    try:
        one_line_error(_refused_resume(finished_lora), str(ckpt), "holds no weights for", "lora_A")
    finally:
        ckpt.write_bytes(intact)


def test_a_lora_rank_change_is_refused_in_one_line(finished_lora):
    """Defect 3: the rank changed with ckpt_allow_changes printed 45 lines and turned the FINISHED run FAILED."""
    proc = _refused_resume(finished_lora, "model.lora.r=8", allow="task.max_steps,model.lora.r")
    one_line_error(proc, "lora_A.default.weight of shape [4, 32], this model's is [8, 32]",
                   "model.lora.r (4 in the checkpoint, 8 now)")


def test_a_replaced_base_is_refused(finished_lora, tiny_arch):
    """The base replaced at the same path (another model of the same architecture) resumed silently."""
    weights = [n for n in os.listdir(finished_lora.base) if n.endswith(".safetensors")]
    try:
        for name in weights:
            shutil.copy(os.path.join(tiny_arch("llama")[1], name), os.path.join(finished_lora.base, name))
        one_line_error(_refused_resume(finished_lora), "other frozen weights", finished_lora.base,
                       "ckpt_allow_changes=[model]")
    finally:
        for name in weights:
            shutil.copy(os.path.join(tiny_arch("llama")[0], name), os.path.join(finished_lora.base, name))


def test_a_deleted_last_ckpt_is_not_called_before_the_first_checkpoint(finished_lora):
    ckpt, intact = finished_lora.ckpt, finished_lora.ckpt.read_bytes()
    ckpt.unlink()
    try:
        one_line_error(_refused_resume(finished_lora), "is FINISHED at step 8", "deleted or moved")
    finally:
        ckpt.write_bytes(intact)


# ---- 2 and 4: a model folder's files that cannot be used are named ----

def _copy(src: str, dst: Path) -> str:
    return str(shutil.copytree(src, dst))


@pytest.mark.parametrize("follow", ["follow", "klbench"])
def test_a_malformed_generation_config_is_named(tmp_path, tiny_arch, follow):
    """transformers ignores a generation_config.json it cannot parse: under `follow` the run sampled at T = 1, and
    under either setting the second stop id of eos_token_id [1, 4] was dropped."""
    from klbench.config.errors import ConfigError
    from klbench.models.policies import build_policy
    from test_config import compose_cfg
    folder = _copy(tiny_arch("llama")[0], tmp_path / "m")
    path = Path(folder, "generation_config.json")
    path.write_text('{"eos_token_id": [1, 4], "temperature": 0.7,, "do_sample": true}')
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={folder}", f"model.generation_config={follow}"])
    with pytest.raises(ConfigError, match=rf"^model\.name_or_path: {path} is not valid JSON \(.*\): its stop ids "
                                          r"and sampling options would be ignored; correct the file"):
        build_policy(cfg.model, cfg.task.max_new_tokens)


def test_a_chat_template_that_renders_nothing_is_named(tmp_path, tiny_arch):
    """`{# renders nothing #}` ended in a 124-line traceback from the model (cannot reshape a tensor of 0 elements)."""
    from klbench.config.errors import ConfigError
    from klbench.models.policies import build_policy
    from klbench.tasks.train import build_data
    from test_instruct import ROWS, _chat_cfg
    folder = _copy(tiny_arch("llama")[0], tmp_path / "m")
    template = Path(folder, "chat_template.jinja")
    template.write_text("{# renders nothing #}")
    cfg = _chat_cfg(tmp_path, folder, ROWS, "dataset.chat_template=true")
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    with pytest.raises(ConfigError, match=rf"the chat template \({template}\) renders prompt #1 as an empty text: "
                                          "correct the template"):
        build_data(cfg, None, policy)


# ---- 5, 6, 7: the embedded LMs' cache ----

def _cached_reference(cache: Path, tiny_lm_dir: str) -> Path:
    """A cached embedded reference LM as ensure_embedded_lm finds it (a tiny GPT-2 in its folder): no pretraining."""
    from klbench.models.embedded.cache import embedded_lm_dir
    from klbench.models.embedded.spec import preset_spec
    spec = preset_spec("reference", {})
    folder = Path(embedded_lm_dir(spec, cache))
    shutil.copytree(tiny_lm_dir, folder)
    (folder / "spec.json").write_text(json.dumps(spec))
    return folder


def test_a_damaged_cached_model_names_its_folder_and_the_fix(tmp_path, tiny_lm_dir):
    """Random bytes or a truncated model.safetensors: a 37-line SafetensorError and a run folder left behind
    before; a bad config.json got advice for a user's folder (save it again with save_pretrained)."""
    from klbench.models.embedded.cache import CacheUnusable, ensure_embedded_lm
    from klbench.models.embedded.spec import preset_spec
    cache = tmp_path / "cache"
    folder = _cached_reference(cache, tiny_lm_dir)
    assert ensure_embedded_lm(preset_spec("reference", {}), cache) == str(folder)  # whole: used as it is
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    fix = "task=pretrain model.preset=reference task.force=true"
    for damage, said in ((lambda: weights.write_bytes(whole[: len(whole) // 2]), "model.safetensors is cut short"),
                         (lambda: (folder / "config.json").write_text("{,"), "config.json cannot be read")):
        damage()
        with pytest.raises(CacheUnusable, match=rf"^the cached embedded reference LM {folder} is damaged \({said}"):
            ensure_embedded_lm(preset_spec("reference", {}), cache)
        shutil.rmtree(folder)
        folder = _cached_reference(cache, tiny_lm_dir)
    # random bytes, in a real run: one line, and no run folder
    weights.write_bytes(os.urandom(len(whole)))
    outputs = tmp_path / "outputs"
    proc = klbench(outputs, "task.max_steps=2", env={"KLBENCH_CACHE": str(cache)})
    one_line_error(proc, str(folder), "model.safetensors", fix, "delete that folder")
    assert not (outputs / "runs").exists() or not any((outputs / "runs").rglob("*-rl-rb*"))


def test_a_cache_that_is_a_file_or_read_only_is_one_line(tmp_path, read_only):
    """KLBENCH_CACHE at a file, or a read-only folder without the models: 31-line tracebacks before."""
    outputs = tmp_path / "outputs"
    (afile := tmp_path / "cachefile").write_text("not a folder")
    for cache, run in ((afile, ()), (afile / "sub", ("experiment=tabular",))):
        proc = klbench(outputs, *run, "task.max_steps=2", env={"KLBENCH_CACHE": str(cache)})
        one_line_error(proc, f"the klbench cache {cache} ($KLBENCH_CACHE", f"{afile} is a file, not a folder",
                       "point KLBENCH_CACHE at a folder you can write")
        assert not outputs.exists()  # refused before anything was made
    (ro := tmp_path / "ro").mkdir()
    read_only(ro)
    proc = klbench(outputs, "task.max_steps=2", env={"KLBENCH_CACHE": str(ro)})
    one_line_error(proc, f"the klbench cache {ro}", "cannot hold the embedded tokenizer", "cannot be written")


def test_a_full_disk_while_building_the_embedded_lm_is_one_line(tmp_path):
    """A 51-line `No space left on device` traceback before; nothing half-written was left then either."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        # a 1.7 MB model on 512 KiB: the tokenizer fits, the model does not
        spec = ["model.spec.corpus_size=200", "model.spec.vocab_size=300", "model.spec.n_embd=128",
                "model.spec.n_layer=2", "model.spec.n_head=2", "model.spec.n_positions=64", "model.spec.steps=2",
                "model.spec.batch_size=4", "model.spec.max_len=32"]
        proc = klbench(tmp_path / "outputs", "task=pretrain", *spec, env={"KLBENCH_CACHE": str(disk)})
        one_line_error(proc, f"the disk under the klbench cache {disk}", "filled up while building the embedded "
                       "reference LM: nothing was kept", "point KLBENCH_CACHE at another disk")
        left = [p.name for p in (disk / "embedded").iterdir()]
        assert not [n for n in left if n.startswith(("reference", ".tmp-"))], left  # nothing half-written
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---- 8. a sweep over a sampling option ----

def test_a_sweep_over_the_temperature_draws_its_frontier(tmp_path):
    """The issue's command exited 0 with its parent FAILED: the runs differ in the derived param sampling.used,
    which the sweep's frontier did not let vary with task.temperature."""
    from test_sweeps import klbench_multirun, mlflow_client
    outputs = tmp_path / "outputs"
    proc = klbench_multirun(outputs, "sweep=rl_beta", "experiment=tabular", "estimator=rb",
                            "task.temperature=choice(0.7,1.0)", "estimator.beta=choice(0.1,1.0)",
                            "hydra.sweeper.n_trials=4", "task.max_steps=20", "task.val_every=10",
                            "hydra.sweeper.study_name=temperature")
    assert "could not summarise" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    client = mlflow_client(outputs)
    (parent,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                   "tags.`klbench.sweep` = 'rl_beta'")
    assert parent.info.status == "FINISHED", parent.data.tags.get("klbench.error")
    assert "pareto/n_runs" in parent.data.metrics or any(k.startswith("pareto/") for k in parent.data.metrics)
    used = {r.data.params.get("sampling.used") for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert len(used) == 2, used  # both temperatures in one frontier


def test_a_sweep_whose_parent_ends_failed_does_not_exit_0(tmp_path):
    """Every trial refused by its config: no frontier, the parent FAILED; the sweep exited 0 all the same."""
    from test_sweeps import cli_env
    outputs = tmp_path / "outputs"
    proc = cli_inprocess.run(["-m", "sweep=rl_beta", "experiment=tabular", "estimator.beta=choice(-1.0,-2.0)",
                              "hydra.sweeper.n_trials=2", "task.max_steps=4", "hydra.sweeper.study_name=refused"],
                             cwd=tmp_path, env=cli_env(outputs))
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "ended FAILED" in proc.stderr, proc.stderr[-3000:]


# ---- smaller findings ----

@pytest.mark.parametrize("answer", ['""', '"   "', "NaN", '"#### "'])
def test_empty_blank_or_nan_reference_answers_are_refused(tmp_path, answer):
    """Such prompts can never score under reward=answer; they were accepted without a word."""
    from klbench.config.errors import ConfigError
    from klbench.data.prompts import load_answers
    from test_answer import _ds
    rows = ['{"q": "1+1=", "a": "2"}', f'{{"q": "2+5=", "a": {answer}}}']
    (train := tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    (val := tmp_path / "val.jsonl").write_text(rows[0] + "\n")
    cfg = _ds(source="jsonl", train_path=str(train), val_path=str(val), field="q", answer_field="a")
    with pytest.raises(ConfigError, match=rf"^{train}: 1 of 2 rows have an empty, blank or NaN reference answer in "
                                          r"dataset.answer_field='a' \(the first: row 2 .*prompt '2\+5='\)"):
        load_answers(cfg)


def test_the_run_name_says_what_sets_it_apart_within_its_task():
    """experiment=arith's run was named `rb b=0.02 s0 rl-embedded`, like the VADER default (issue 42, item 5)."""
    from klbench.config.compose import compose
    from klbench.record.experiments import run_name
    assert run_name(compose([])) == "rb b=0.05 s0 rl-embedded"
    assert run_name(compose(["experiment=arith"])) == "rb b=0.02 grpo s0 rl-embedded:arith"
    assert run_name(compose(["experiment=tabular", "task.temperature=0.7", "task.top_p=0.9"])) == \
        "rb b=0.5 T=0.7 top_p=0.9 s0 rl-tabular"


def test_a_chat_template_run_names_its_template(tmp_path, tiny_arch, capsys):
    from klbench.models.policies import build_policy
    from klbench.tasks.uses import shown_uses
    from test_instruct import ROWS, _chat_cfg
    cfg = _chat_cfg(tmp_path, tiny_arch("llama")[0], ROWS, "dataset.chat_template=true")
    uses = shown_uses(cfg, build_policy(cfg.model, cfg.task.max_new_tokens))
    template = str(Path(tiny_arch("llama")[0], "chat_template.jinja"))
    assert uses["used.chat_template"] == template and "used.lora_rank" not in uses
    assert f"klbench: prompts rendered with the chat template {template}\n" in capsys.readouterr().out


def test_lora_runs_started_at_once_and_one_killed_and_resumed(tmp_path, tiny_arch):
    """As every round, on the LoRA path after these changes: three runs started at once on a fresh outputs folder
    all finish, each in its own folder; one killed with kill -9 after its first checkpoint resumes to the end with
    every train/ step logged once."""
    import signal
    import time
    from test_record import steps
    base, outputs = tiny_arch("llama")[0], tmp_path / "outputs"
    cmd = [sys.executable, "-m", "klbench.cli"]
    procs = [subprocess.Popen([*cmd, *_lora_args(base, tmp_path / f"R{i}", f"seed={i}", "task.max_steps=8")],
                              cwd=tmp_path, env=env_for(outputs), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(3)]
    long = ("seed=9", "task.max_steps=100", "task.val_every=20")
    killed = subprocess.Popen([*cmd, *_lora_args(base, tmp_path / "K", *long)], cwd=tmp_path,
                              env=env_for(outputs), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # killed at its first checkpoint, while the three others run (waiting for them first let it reach its end)
    ckpt = tmp_path / "K" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.is_file() and time.time() < deadline and killed.poll() is None:
        time.sleep(0.1)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()[-3000:]
    resumed = klbench(outputs, *_lora_args(base, tmp_path / "K", *long, "ckpt_path=last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step" in resumed.stderr + resumed.stdout  # killed mid-run, not after its end
    assert "not resumable" not in resumed.stderr + resumed.stdout  # Lightning's notice: the prompts continue exactly
    client = client_of(outputs)
    found = all_runs(client)
    assert len(found) == 4 and all(r.info.status == "FINISHED" for r in found), [r.info.status for r in found]
    (k,) = [r for r in found if r.data.params["seed"] == "9"]
    assert steps(client, k.info.run_id, "train/reward") == list(range(100))  # each step once


def test_a_param_that_changed_on_a_resume_is_said_not_fatal(tmp_path, capsys):
    """A resume under ckpt_allow_changes can change what the run uses (used.stop_ids of a replaced base accepted with
    ckpt_allow_changes=[model]); MLflow refuses a param's new value, which ended the reopened run FAILED."""
    import mlflow
    from klbench.record.store import ensure_experiment, sqlite_uri
    from klbench.record.tracking import RecordLogger, log_params
    uri = sqlite_uri(tmp_path / "mlflow.db")
    exp = ensure_experiment(uri, "x", str(tmp_path / "artifacts"))
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(exp).info.run_id
    logger = RecordLogger(client, run_id, "x")
    log_params(logger, {"used.stop_ids": "1 (</s>)", "used.lora_rank": "4"})
    log_params(logger, {"used.stop_ids": "1 (</s>), 4 (<|im_end|>)", "used.lora_rank": "4"})
    assert client.get_run(run_id).data.params["used.stop_ids"] == "1 (</s>)"
    assert "klbench: warning: the param used.stop_ids was '1 (</s>)' when this run started" in capsys.readouterr().out
