"""The record under the conditions users create: parallel first starts on a fresh store, a half-migrated
or unreadable store, `kill -9` mid-run, a crash and its resume, a checkpoint from another config or not
a checkpoint at all, and a bad value on the command line.

Subprocess tests run the real `klbench` CLI against their own outputs folder.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch

import cli_inprocess
from klbench.record import runs, store
from klbench.tasks.rl import RLTask
from klbench.tasks.train import run_task
from test_config import compose_cfg

TABULAR = ["experiment=tabular", "task.max_steps=20", "task.val_every=10", "task.log_every=1"]


def env_for(outputs: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "KLBENCH_PARENT_RUN_ID",
                                                            "KLBENCH_RESUME_CKPT")}
    env.update(KLBENCH_OUTPUTS=str(outputs), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def klbench(outputs: Path, *overrides: str, timeout: int = 180) -> subprocess.CompletedProcess:
    """The CLI in this process (tests/cli_inprocess.py): what it prints and its exit status, as a process's."""
    return cli_inprocess.run(overrides, cwd=outputs.parent, env=env_for(outputs))


def client_of(outputs: Path):
    return mlflow.MlflowClient(f"sqlite:///{outputs}/mlflow.db")


def all_runs(client):
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def steps(client, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


# ---- 1. the store ----

OPEN_AND_LOG = """
import sys
from mlflow import MlflowClient
from klbench.record.store import ensure_experiment
uri = sys.argv[1]
exp = ensure_experiment(uri, "parallel", sys.argv[2])
client = MlflowClient(uri)
run_id = client.create_run(exp).info.run_id
client.log_metric(run_id, "x", 1.0)
client.set_terminated(run_id, "FINISHED")
"""


@pytest.mark.parametrize("rep", range(2))
def test_parallel_first_opens_of_a_fresh_store(tmp_path, rep):
    """6 processes open one fresh store at the same moment: one creates it, all six log a run."""
    uri = f"sqlite:///{tmp_path}/outputs/mlflow.db"
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AND_LOG, uri, str(tmp_path / "art")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [e[-2000:] for _, e in outs]
    assert sum("created the MLflow store" in e for _, e in outs) == 1
    client = mlflow.MlflowClient(uri)
    assert sorted(r.info.status for r in all_runs(client)) == ["FINISHED"] * 6
    assert subprocess.run([sys.executable, "-c", OPEN_AND_LOG, uri, str(tmp_path / "art")]).returncode == 0
    assert store.inspect(Path(f"{tmp_path}/outputs/mlflow.db"))[0] == "current"


OPEN_FROM_TEMPLATE = OPEN_AND_LOG.replace('sys.argv[2])', 'sys.argv[2], sys.argv[3])')


def test_fresh_stores_are_copies_of_one_migrated_template(tmp_path):
    """3 processes create 3 fresh stores at once from one cache: the migration runs once, into the template;
    each store is current, with its own Default experiment next to it, and takes a run."""
    cache = tmp_path / "cache"
    uris = [f"sqlite:///{tmp_path}/out{i}/mlflow.db" for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_FROM_TEMPLATE, uri, str(tmp_path / "art"), str(cache)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for uri in uris]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 3, [e[-2000:] for _, e in outs]
    (template,) = (cache / "mlflow").glob("*.db")
    con = sqlite3.connect(f"file:{template}?mode=ro", uri=True)
    assert con.execute("SELECT count(*) FROM experiments").fetchone() == (0,)  # each copy makes its Default
    con.close()
    made = template.stat().st_mtime_ns
    for i, uri in enumerate(uris):
        assert store.inspect(Path(uri[len("sqlite:///"):]))[0] == "current"
        client = mlflow.MlflowClient(uri)
        assert client.get_experiment("0").artifact_location == store.file_uri(tmp_path / f"out{i}/mlartifacts/0")
        assert [r.info.status for r in all_runs(client)] == ["FINISHED"]
    uri = f"sqlite:///{tmp_path}/out3/mlflow.db"
    proc = subprocess.run([sys.executable, "-c", OPEN_FROM_TEMPLATE, uri, str(tmp_path / "art"), str(cache)])
    assert proc.returncode == 0
    assert template.stat().st_mtime_ns == made  # made once, copied since


@pytest.mark.slow
def test_parallel_klbench_runs_on_a_fresh_outputs_folder(tmp_path):
    """The issue's reproduction: 6 `klbench` runs started at once on an empty outputs/, 5 times over."""
    for rep in range(5):
        outputs = tmp_path / f"rep{rep}" / "outputs"
        outputs.parent.mkdir()
        procs = [subprocess.Popen([sys.executable, "-m", "klbench.cli", *TABULAR, f"seed={i}", "logger.experiment=par"],
                                  cwd=outputs.parent, env=env_for(outputs), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for i in range(6)]
        errs = [p.communicate(timeout=600)[1] for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, [e[-2000:] for e in errs]
        assert sorted(r.info.status for r in all_runs(client_of(outputs))) == ["FINISHED"] * 6
        assert_a_folder_per_run(outputs, 6)
        assert klbench(outputs, *TABULAR, "seed=9", "logger.experiment=par").returncode == 0


def assert_a_folder_per_run(outputs: Path, n: int) -> None:
    """Runs started together each got a folder of their own (the folder name has a one-second resolution:
    before klbench/record/rundir.py, 16 starts got 2, 2 and 1 folders), and each folder's checkpoint is the run's
    that its mlflow_run_id.txt names, with that run's seed."""
    folders = sorted(outputs.glob("runs/*/*"))
    ids = [(f / runs.RUN_ID_FILE).read_text() for f in folders]
    assert len(folders) == n and len(set(ids)) == n, folders
    by_id = {r.info.run_id: r for r in all_runs(client_of(outputs))}
    for f, run_id in zip(folders, ids):
        payload = torch.load(f / "checkpoints" / "last.ckpt", weights_only=True)["klbench"]
        assert payload["mlflow_run_id"] == run_id
        assert str(payload["config"]["seed"]) == by_id[run_id].data.params["seed"]


def test_half_migrated_store_is_reported_then_repaired(tmp_path):
    """What parallel first opens used to leave behind: never reused, never deleted; a one-line recovery."""
    path = tmp_path / "mlflow.db"
    uri = f"sqlite:///{path}"
    exp = store.ensure_experiment(uri, "kept", str(tmp_path / "art"))
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(exp).info.run_id
    client.log_metric(run_id, "x", 2.5, step=3)
    client.set_tag(run_id, "note", "keep me")
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config
    script = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    previous = script.get_revision(script.get_current_head()).down_revision
    with sqlite3.connect(path) as con:  # a migration step that died half-way through a batch copy of tags
        con.execute("CREATE TABLE _alembic_tmp_tags AS SELECT * FROM tags")
        con.execute("DROP TABLE tags")
        con.execute("UPDATE alembic_version SET version_num = ?", (previous,))
    store._checked.clear()
    with pytest.raises(store.StoreError) as e:
        store.open_store(uri)
    assert str(path) in str(e.value) and f"python -m klbench.record.store repair {path}" in str(e.value)
    assert path.stat().st_size > 0  # left as it was
    fix = cli_inprocess.run(["repair", path], cwd=tmp_path, env=os.environ, main="klbench.record.store")
    assert fix.returncode == 0, fix.stderr
    assert store.inspect(path)[0] == "current" and list(tmp_path.glob("mlflow.db.*.bak"))
    assert "1 runs kept" in fix.stdout
    # read back by a new process, as the next run would (this one's MLflow holds the old file open)
    check = ("import sys; from mlflow import MlflowClient; from klbench.record.store import open_store; open_store(sys.argv[1]);"
             "c = MlflowClient(sys.argv[1]); r = c.get_run(sys.argv[2]); "
             "print(r.info.experiment_id, r.data.tags['note'], [(m.step, m.value) for m in c.get_metric_history(sys.argv[2], 'x')])")
    out = subprocess.run([sys.executable, "-c", check, uri, run_id], capture_output=True, text=True)
    assert out.stdout.strip() == f"{exp} keep me [(3, 2.5)]", out.stderr[-2000:]


@pytest.mark.parametrize("kind", ["corrupt", "not a folder"])
def test_unusable_store_fails_fast_with_its_path(tmp_path, kind):
    if kind == "corrupt":
        path = tmp_path / "mlflow.db"
        path.write_bytes(os.urandom(4096))
    else:
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "mlflow.db"
    t0 = time.time()
    with pytest.raises(store.StoreError, match=str(path.parent if kind != "corrupt" else path)):
        store.open_store(f"sqlite:///{path}")
    assert time.time() - t0 < 5


def test_a_run_records_its_design_its_folder_and_its_console(tmp_path):
    """Issue 21: params are the experiment's design (paths, checkpoint, logger and store settings are
    `klbench.config.*` tags); every run, not only a sweep's trials, carries `klbench.run_dir`, its folder; the
    folder's klbench.log holds every line the console showed, with its time."""
    from klbench.record.experiments import is_bookkeeping
    outputs = tmp_path / "outputs"
    proc = klbench(outputs, *TABULAR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = all_runs(client_of(outputs))
    (folder,) = outputs.glob("runs/*/*")
    params, tags = run.data.params, run.data.tags
    assert run.info.run_name == "rb b=0.5 s0 rl-tabular"
    assert not [k for k in params if is_bookkeeping(k)], params
    assert {"estimator.name", "estimator.beta", "model.kind", "reward.kind", "seed", "task.max_steps"} <= set(params)
    assert tags["klbench.run_dir"] == str(folder)
    assert tags["klbench.config.paths.ckpt_dir"] == str(folder / "checkpoints")
    assert tags["klbench.config.ckpt_allow_changes"] == "[]"
    log = (folder / "klbench.log").read_text()
    shown = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(shown) > 10 and [line for line in shown if line not in log] == []
    assert f"[stdout] klbench: run folder  {folder}" in log
    assert all(line.startswith("[20") for line in log.splitlines() if line.strip())  # each with its time


# ---- 2. a run's status says what happened ----

def test_status_running_then_failed_then_resumed_without_duplicates(tmp_path, monkeypatch):
    """RUNNING while it trains (not FINISHED after the step-0 validation); an exception at step 15 ends it
    FAILED with the error tagged and its progress (10 of 20) visible; the resume goes back to RUNNING,
    ends FINISHED, and every metric has one value per step, equal to an uninterrupted run's."""
    seen = {}
    step = RLTask.training_step

    def crash_at_15(self, prompts, batch_idx):
        if self.global_step == 3 and self.logger:
            seen["status"] = self.logger.client.get_run(self.logger.run_id).info.status
        if self.global_step == 15 and not seen.get("crashed"):
            seen["crashed"] = True
            raise RuntimeError("the node went away")
        return step(self, prompts, batch_idx)

    monkeypatch.setattr(RLTask, "training_step", crash_at_15)
    cfg = compose_cfg(tmp_path, TABULAR)
    with pytest.raises(RuntimeError, match="the node went away"):
        run_task(cfg)
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    (r,) = all_runs(client)
    assert seen["status"] == "RUNNING"
    assert r.info.status == "FAILED" and r.data.tags[runs.ERROR] == "RuntimeError: the node went away"
    assert (r.data.tags[runs.STEPS_DONE], r.data.tags[runs.MAX_STEPS]) == ("10", "20")
    assert steps(client, r.info.run_id, "train/kl_mc") == list(range(15))  # what led to the failure

    out = run_task(compose_cfg(tmp_path, TABULAR + ["ckpt_path=last"]))
    r = client.get_run(r.info.run_id)
    assert r.info.status == "FINISHED" and r.data.tags[runs.STEPS_DONE] == "20" and runs.ERROR not in r.data.tags
    for key in ("train/kl_mc", "train/reward", "train/grad_norm"):
        assert steps(client, r.info.run_id, key) == list(range(20)), key
    assert steps(client, r.info.run_id, "val/reward") == [0, 10, 20]

    monkeypatch.setattr(RLTask, "training_step", step)
    straight = run_task(compose_cfg(tmp_path / "straight", TABULAR))
    assert out["val/seq_kl"] == pytest.approx(straight["val/seq_kl"], rel=1e-9)
    other = mlflow.MlflowClient(compose_cfg(tmp_path / "straight", TABULAR).logger.tracking_uri)
    (s,) = all_runs(other)
    for key in ("train/kl_mc", "train/loss"):
        assert ([m.value for m in sorted(client.get_metric_history(r.info.run_id, key), key=lambda m: m.step)]
                == pytest.approx([m.value for m in sorted(other.get_metric_history(s.info.run_id, key),
                                                          key=lambda m: m.step)], rel=1e-6)), key


def test_interrupted_run_is_killed(tmp_path, monkeypatch):
    step = RLTask.training_step

    def interrupt(self, prompts, batch_idx):
        if self.global_step == 5:
            raise KeyboardInterrupt
        return step(self, prompts, batch_idx)

    monkeypatch.setattr(RLTask, "training_step", interrupt)
    cfg = compose_cfg(tmp_path, TABULAR)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        run_task(cfg)
    (r,) = all_runs(mlflow.MlflowClient(cfg.logger.tracking_uri))
    assert r.info.status == "KILLED" and "interrupted" in r.data.tags[runs.ENDED]


def test_kill_9_mid_run_is_noticed_and_resumed(tmp_path):
    """A run killed with SIGKILL stays RUNNING until something notices (here klbench-pareto), which marks
    it KILLED; resumed, it finishes in the same MLflow run with no step logged twice."""
    outputs = tmp_path / "outputs"
    args = ["experiment=tabular", "task.max_steps=1000", "task.val_every=20", "task.log_every=1",
            f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.Popen([sys.executable, "-m", "klbench.cli", *args], cwd=tmp_path, env=env_for(outputs),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    run_id = None
    while time.time() < deadline and proc.poll() is None:
        if (tmp_path / "run" / "mlflow_run_id.txt").is_file():
            run_id = (tmp_path / "run" / "mlflow_run_id.txt").read_text().strip()
            r = client_of(outputs).get_run(run_id)
            if int(r.data.tags.get(runs.STEPS_DONE, 0)) >= 40:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read()[-2000:]
    assert r.info.status == "RUNNING" and r.data.tags[runs.MAX_STEPS] == "1000"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    client = client_of(outputs)
    assert client.get_run(run_id).info.status == "RUNNING"  # nobody has looked yet
    pareto = cli_inprocess.run(["--experiment", "klbench", "--out", tmp_path / "p"], cwd=tmp_path,
                               env=env_for(outputs), main="klbench.analysis.pareto")
    assert "1 status KILLED" in pareto.stdout, pareto.stdout + pareto.stderr
    assert client.get_run(run_id).info.status == "KILLED"
    assert "is gone; noticed by klbench-pareto" in client.get_run(run_id).data.tags[runs.ENDED]

    resumed = klbench(outputs, *args, "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED" and r.data.tags[runs.STEPS_DONE] == "1000"
    assert len(all_runs(client)) == 1
    assert steps(client, run_id, "train/kl_mc") == list(range(1000))
    assert steps(client, run_id, "val/reward") == list(range(0, 1001, 20))


# ---- 4. checkpoints ----

def test_checkpoint_from_another_config_is_refused(tmp_path):
    cfg = compose_cfg(tmp_path, TABULAR)
    run_task(cfg)
    other = compose_cfg(tmp_path, TABULAR + ["model.ref_seed=5", "estimator=seq", "ckpt_path=last"])
    with pytest.raises(ValueError, match=r"estimator\.name \('rb' in the checkpoint, 'seq' now\).*model\.ref_seed"):
        run_task(other)
    longer = TABULAR + ["task.max_steps=30", "ckpt_path=last"]
    with pytest.raises(ValueError, match=r"ckpt_allow_changes=\[task\.max_steps\]"):
        run_task(compose_cfg(tmp_path, longer))
    assert len(all_runs(mlflow.MlflowClient(cfg.logger.tracking_uri))) == 1  # refusals logged nothing
    run_task(compose_cfg(tmp_path, longer + ["ckpt_allow_changes=[task.max_steps]"]))
    (r,) = all_runs(mlflow.MlflowClient(cfg.logger.tracking_uri))
    assert r.info.status == "FINISHED" and r.data.tags[runs.STEPS_DONE] == r.data.tags[runs.MAX_STEPS] == "30"


def test_validation_never_shifts_training(tmp_path):
    """The same run validated every 2 or every 6 steps trains on the same samples: the exact KL and
    reward of the final policy are identical."""
    over = ["logger=none", "task.max_steps=6"]
    often = run_task(compose_cfg(tmp_path / "a", TABULAR + over + ["task.val_every=2"]))
    rarely = run_task(compose_cfg(tmp_path / "b", TABULAR + over + ["task.val_every=6"]))
    assert often["val/seq_kl"] == rarely["val/seq_kl"] and often["val/reward"] == rarely["val/reward"]


def test_checkpoint_from_before_an_option_existed_resumes(tmp_path):
    """A checkpoint made before kl_ctl, task.inner_steps and task.clip_eps existed holds none of them:
    the values that do what klbench did then are no change, any other value is."""
    from omegaconf import OmegaConf

    from klbench.record.resume import config_changes
    cfg = compose_cfg(tmp_path, TABULAR)
    old = OmegaConf.to_container(cfg, resolve=True)
    del old["kl_ctl"], old["task"]["inner_steps"], old["task"]["clip_eps"]
    assert config_changes(old, cfg) == []
    changed = compose_cfg(tmp_path, TABULAR + ["task.inner_steps=2"])
    assert config_changes(old, changed) == ["task.inner_steps (1 in the checkpoint, 2 now)"]


class NotKlbench:  # an object that only unpickling code could rebuild
    pass


@pytest.mark.parametrize("content", ["garbage", "foreign", "pickled object"])
def test_not_a_klbench_checkpoint(tmp_path, content):
    path = tmp_path / "x.ckpt"
    if content == "garbage":
        path.write_bytes(os.urandom(1000))
    elif content == "foreign":
        torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    else:
        torch.save({"klbench": NotKlbench()}, path)
    cfg = compose_cfg(tmp_path, TABULAR + [f"ckpt_path={path}"])
    with pytest.raises(ValueError, match="is not a klbench checkpoint") as e:
        run_task(cfg)
    assert "weights_only" not in str(e.value)


# ---- 5. bad values stop before anything is built ----

@pytest.mark.parametrize("override,field", [
    ("estimator.beta=nan", "estimator.beta"), ("task.max_steps=0", "task.max_steps"),
    ("hardware.precision=garbage", "hardware.precision"), ("seed=abc", "seed"),
])
def test_bad_value_leaves_no_run_and_no_folder(tmp_path, override, field):
    outputs = tmp_path / "outputs"
    t0 = time.time()
    proc = klbench(outputs, override)
    assert proc.returncode == 1 and f"klbench: error: {field}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and time.time() - t0 < 30  # the 2 s target is a benchmark
    assert not outputs.exists() or not any(outputs.rglob("*")), sorted(outputs.rglob("*"))


def test_sweep_without_multirun_is_an_error(tmp_path):
    proc = klbench(tmp_path / "outputs", "sweep=rl_beta", "experiment=tabular")
    assert proc.returncode == 1 and "run it with -m" in proc.stderr
    assert not (tmp_path / "outputs" / "mlflow.db").exists()
