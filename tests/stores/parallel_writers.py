"""N processes writing to a store at the same moment:  python parallel_writers.py optuna|mlflow URL N

The library is imported once and the writers forked from here (8 interpreters each importing MLflow would
spend more CPU on imports than on the writes under test). Each writer opens its own connection, waits at a barrier until all
have, then writes. The last line printed is a JSON list: one result per writer.
"""
import json
import multiprocessing as mp
import os
import sys


def optuna_writer(url: str, barrier) -> str:
    import optuna
    study = optuna.load_study(study_name="concurrent", storage=url)
    barrier.wait()

    def objective(trial):
        trial.set_user_attr("pid", os.getpid())
        return trial.suggest_float("x", -1, 1) ** 2
    study.optimize(objective, n_trials=1)
    return str(os.getpid())


def mlflow_writer(url: str, barrier) -> str:
    from mlflow import MlflowClient
    client = MlflowClient(url)
    run_id = client.create_run(client.get_experiment_by_name("concurrent").experiment_id).info.run_id
    barrier.wait()
    for step in range(20):
        client.log_metric(run_id, "loss", 1.0 / (step + 1), step=step)
    client.set_terminated(run_id)
    return run_id


def _child(writer, url, barrier, results):
    results.put(writer(url, barrier))


def main(kind: str, url: str, n: int) -> int:
    if kind == "optuna":
        import optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    else:
        import mlflow  # noqa: F401
    writer = {"optuna": optuna_writer, "mlflow": mlflow_writer}[kind]
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n, timeout=120)  # one writer failing breaks it: the others fail too, no hang
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_child, args=(writer, url, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    out = [results.get() for _ in range(n - len(failed))]
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
