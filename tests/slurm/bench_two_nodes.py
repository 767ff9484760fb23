"""Time per step: one job on the two nodes of two_nodes.py against the same job on 2 local ranks, interleaved.

    python tests/slurm/bench_two_nodes.py [rounds]        (as root, .ci/install_servers.sh installed)

Each round runs both, one after the other (the two-node trial first in even rounds, second in odd ones), so that
load from elsewhere on the machine falls on both alike: hardware=ddp on the tabular model (600 steps) and
hardware=fsdp on a tiny Llama folder (16 steps). A step's time is taken from the MLflow record: the timestamps of
train/loss between the first training step logged after step 1 and the last, so neither the models' build nor the
second local rank's start (Lightning launches it inside the first validate, inside the run's own "N steps in T s")
is counted. Prints one row per run and the ratios (two nodes / local) per round; docs/scale-out.md "Two nodes"
quotes them with the machine's load.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import two_nodes  # noqa: E402
from tiny_lms import save_chat_tokenizer, save_tiny_arch  # noqa: E402

TWO = ["hydra/launcher=slurm", "hydra.launcher.partition=two", "hydra.launcher.nodes=2",
       "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.gpus_per_node=0",
       "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10", "hydra.sweeper.n_trials=1",
       'hydra.sweeper.params={estimator.beta:"choice(0.1)"}']


def run(cwd: Path, args: list[str], slurm: bool) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "KLBENCH_OUTPUTS": str(cwd / "outputs")}
    env.pop("MLFLOW_TRACKING_URI", None)
    if slurm:
        env.update(two_nodes.env())
    cwd.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "klbench.cli", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=1200)
    if p.returncode:
        raise SystemExit(f"{args}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    from mlflow import MlflowClient
    c = MlflowClient(f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")
    exps = [e.experiment_id for e in c.search_experiments()]
    (run,) = [r for r in c.search_runs(exps) if "train/loss" in r.data.metrics]
    hist = sorted((m.step, m.timestamp) for m in c.get_metric_history(run.info.run_id, "train/loss"))
    hist = [h for h in hist if h[0] >= 2]
    return (hist[-1][1] - hist[0][1]) / 1000 / (hist[-1][0] - hist[0][0])


def main(rounds: int) -> None:
    two_nodes.one.start()
    two_nodes.start()
    root = Path(tempfile.mkdtemp(prefix="klbench-bench2n-"))
    tok = save_chat_tokenizer(root / "tok")
    policy, ref = save_tiny_arch("llama", root / "p", seed=0, tokenizer=tok), save_tiny_arch("llama", root / "r", 1, tokenizer=tok)
    jobs = {"ddp tabular": ["experiment=tabular", "estimator=rb", "task.max_steps=600", "task.val_every=300",
                            "hardware=ddp", "hardware.accelerator=cpu"],
            "fsdp tiny llama": ["model=hf", f"model.name_or_path={policy}", f"model.ref_name_or_path={ref}",
                                "estimator=naive_mc", "task.prompts_per_step=4", "task.n_samples=2",
                                "task.max_new_tokens=8", "task.val_prompts=4", "task.max_steps=16",
                                "task.val_every=8", "hardware=fsdp", "hardware.accelerator=cpu"]}
    print(f"load before: {os.getloadavg()}")
    for r in range(rounds):
        for name, job in jobs.items():
            two = ["-m", "sweep=rl_beta", *job, "hardware.devices=1", "hardware.num_nodes=2", *TWO]
            local = [*job, "hardware.devices=2", "estimator.beta=0.1"]
            order = [("2 nodes", two, True), ("2 local ranks", local, False)]
            times = {}
            for label, args, slurm in (order if r % 2 == 0 else order[::-1]):
                times[label] = run(root / f"{name}-{r}-{label}".replace(" ", "_"), args, slurm)
                print(f"round {r} {name:<16} {label:<14} {times[label] * 1000:8.1f} ms/step", flush=True)
            print(f"round {r} {name:<16} ratio 2 nodes / 2 local ranks: {times['2 nodes'] / times['2 local ranks']:.2f}"
                  f"  (load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
