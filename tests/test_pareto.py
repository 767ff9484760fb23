"""Pareto analysis: the frontier definition (ties included), share, hypervolume, the plot, and the MLflow
round trip (collect child runs of a sweep, log to its parent, the klbench-pareto command) on a real
SQLite store."""
import csv
import os
import random

import numpy as np
import pytest
import torch

from klbench.analysis.frontier import frontier_share, group_runs, hypervolume, non_dominated
from klbench.analysis.mlflow_io import collect_runs, log_pareto
from klbench.analysis.pareto import main
from klbench.analysis.plots import plot_pareto
from klbench.exact.tabular import Frontier


def brute_force(rewards, kls):
    n = len(rewards)
    return np.array([not any(rewards[j] >= rewards[i] and kls[j] <= kls[i]
                             and (rewards[j] > rewards[i] or kls[j] < kls[i]) for j in range(n))
                     for i in range(n)])


def test_non_dominated_hand_made():
    #        A    B    C    D    E
    r = [1.0, 2.0, 3.0, 1.0, 0.5]
    k = [1.0, 3.0, 2.0, 0.0, 0.0]
    # C dominates B (more reward, less KL); D dominates A (same reward, less KL) and E (same KL, more reward)
    assert non_dominated(r, k).tolist() == [False, False, True, True, False]


def test_non_dominated_ties():
    # exact duplicates of a frontier point are all kept; a duplicated dominated point stays dominated
    r, k = [1.0, 1.0, 2.0, 0.5, 0.5], [1.0, 1.0, 2.0, 1.5, 1.5]
    assert non_dominated(r, k).tolist() == [True, True, True, False, False]
    assert non_dominated([3.0], [7.0]).tolist() == [True]
    assert non_dominated([], []).tolist() == []


def test_non_dominated_matches_definition_and_ignores_order():
    rng = random.Random(0)
    for _ in range(50):  # a coarse grid makes ties on one or both axes common
        r = [float(rng.randint(0, 4)) for _ in range(12)]
        k = [float(rng.randint(0, 4)) for _ in range(12)]
        mask = non_dominated(r, k)
        assert mask.tolist() == brute_force(r, k).tolist()
        perm = list(range(12))
        rng.shuffle(perm)
        assert non_dominated([r[i] for i in perm], [k[i] for i in perm]).tolist() == [mask[i] for i in perm]


def test_non_dominated_rejects_nan():
    with pytest.raises(ValueError, match="finite"):
        non_dominated([1.0, float("nan")], [1.0, 2.0])


def test_frontier_share():
    share = frontier_share(["rb", "mc", "rb", "rb", "mc", "seq"], [True, True, True, True, False, False])
    assert share == {"mc": 0.25, "rb": 0.75, "seq": 0.0}
    assert sum(share.values()) == pytest.approx(1.0)


def test_hypervolume_hand_computed():
    ref = (0.0, 10.0)
    # frontier (kl, reward) = (1, 1), (3, 2), (6, 3): strips [1,3]x1 + [3,6]x2 + [6,10]x3 = 2 + 6 + 12
    r, k = [1.0, 2.0, 3.0], [1.0, 3.0, 6.0]
    assert hypervolume(r, k, ref) == pytest.approx(20.0)
    # a dominated point, one below the reference reward and one beyond the reference KL add nothing
    assert hypervolume(r + [1.5, -1.0, 5.0], k + [4.0, 0.5, 12.0], ref) == pytest.approx(20.0)
    assert hypervolume([2.0], [4.0], ref) == pytest.approx(6 * 2)
    assert hypervolume([-0.5], [4.0], ref) == 0.0


def test_plot_writes_png(tmp_path):
    pts = {"estimator": ["rb", "rb", "mc", "mc"], "reward": [0.2, 0.6, 0.1, 0.7], "seq_kl": [1.0, 3.0, 2.0, 6.0]}
    exact = Frontier(torch.tensor([1.0, 0.5, 0.2]), torch.tensor([0.3, 0.7, 0.9]), torch.tensor([0.8, 2.5, 5.0]))
    path = plot_pareto(pts, tmp_path / "sub" / "pareto.png", exact_frontier=exact, ref_point=(-1.0, 10.0))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ---- MLflow round trip ----

RB = [(0.2, 1.0), (0.5, 2.0), (0.8, 5.0)]  # (reward, seq_kl): all three on the frontier
MC = [(0.1, 1.5), (0.9, 8.0), (0.3, 3.0)]  # only (0.9, 8.0) is on it
HV = 1 * 1.2 + 3 * 1.5 + 3 * 1.8 + 12 * 1.9  # reference (-1, 20)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root.resolve() / 'mlflow.db'}"
    assert uri.startswith("sqlite:////")
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("sweep-a", artifact_location=str((root / "artifacts").resolve()))
    parent = client.create_run(exp, run_name="sweep-parent").info.run_id

    def child(name, est, beta, reward=None, kl=None, status="FINISHED", parent_id=parent, steps=60, reward_kind="vader"):
        tags = {"mlflow.parentRunId": parent_id} if parent_id else {}
        tags.update({"klbench.steps_done": str(steps), "klbench.max_steps": "60"})
        rid = client.create_run(exp, run_name=name, tags=tags).info.run_id
        params = [Param("estimator.name", est), Param("estimator.beta", str(beta)), Param("seed", "0"),
                  Param("reward.kind", reward_kind), Param("task.max_steps", "60")]
        metrics = []  # an early bad value, then the final one that must be used
        if reward is not None:
            metrics += [Metric("val/reward", -0.9, 0, 0), Metric("val/reward", reward, 1, 1)]
        if kl is not None:
            metrics += [Metric("val/seq_kl", 50.0, 0, 0), Metric("val/seq_kl", kl, 1, 1)]
        client.log_batch(rid, metrics=metrics, params=params)
        client.set_terminated(rid, status)
        return rid

    ids = {f"{est}{i}": child(f"{est}-{i}", est, 0.1 * (i + 1), r, k)
           for est, pts in (("rb", RB), ("mc", MC)) for i, (r, k) in enumerate(pts)}
    failed = child("crashed", "rb", 0.05, 0.99, 0.1, status="FAILED")  # would dominate everything
    no_kl = child("no-kl", "mc", 0.05, 0.5)
    outsider = child("not-in-sweep", "seq", 0.1, 0.95, 12.0, parent_id=None)  # frontier only over the experiment
    # a killed sweep's trial marked FINISHED at step 20 of 60: it would dominate, and must not count
    partial = child("partial", "rb", 0.05, 0.99, 0.05, steps=20)
    client.set_terminated(parent)
    # another reward scale in another experiment: never on one frontier with the vader runs
    other = client.create_experiment("tabular-a", artifact_location=str((root / "artifacts2").resolve()))
    exp = other  # child() reads it
    tabular = child("tabular", "rb", 0.5, 1.7, 2.0, parent_id=None, reward_kind="tabular")
    return {"uri": uri, "client": client, "parent": parent, "children": ids, "failed": failed,
            "no_kl": no_kl, "outsider": outsider, "partial": partial, "tabular": tabular}


def test_collect_runs_children_of_parent(store):
    runs = collect_runs(store["client"], parent_run_id=store["parent"])
    assert {r["run_id"] for r in runs} == set(store["children"].values())
    assert runs.skipped == {"status FAILED": [store["failed"]], "missing metric val/seq_kl": [store["no_kl"]],
                            "stopped before max_steps": [store["partial"]]}
    rb0 = next(r for r in runs if r["run_id"] == store["children"]["rb0"])
    assert (rb0["estimator"], rb0["reward"], rb0["seq_kl"], rb0["seed"]) == ("rb", 0.2, 1.0, 0)
    assert rb0["beta"] == pytest.approx(0.1) and rb0["lam"] is None and rb0["experiment"] == "sweep-a"


def test_collect_runs_experiment_and_run_ids(store):
    client = store["client"]
    runs = collect_runs(client, experiment_names=["sweep-a"])
    assert len(runs) == 7 and store["outsider"] in {r["run_id"] for r in runs}
    assert runs.skipped["sweep parent run"] == [store["parent"]]
    picked = collect_runs(client, run_ids=[store["children"]["mc1"], store["failed"]])
    assert [r["run_id"] for r in picked] == [store["children"]["mc1"]] and picked.n_skipped == 1
    with pytest.raises(ValueError, match="available: .*sweep-a"):
        collect_runs(client, experiment_names=["nope"])


def test_log_pareto_on_parent(store):
    client, parent = store["client"], store["parent"]
    summary = log_pareto(client, parent, collect_runs(client, parent_run_id=parent))
    assert summary["share"] == {"mc": 0.25, "rb": 0.75}
    assert summary["hypervolume"] == pytest.approx(HV)
    assert {a.path for a in client.list_artifacts(parent)} >= {"pareto.html", "pareto.png", "pareto.csv"}
    html = open(client.download_artifacts(parent, "pareto.html")).read()
    assert len(html) > 1_000_000 and "<script src=\"https://cdn.plot.ly" not in html  # plotly.js inside: no network
    assert "`pareto.html`" in client.get_run(parent).data.tags["mlflow.note.content"]  # the description points at it
    metrics = client.get_run(parent).data.metrics
    assert metrics["pareto/share/rb"] == 0.75 and metrics["pareto/share/mc"] == 0.25
    assert metrics["pareto/n_points"] == 6 and metrics["pareto/n_frontier"] == 4
    assert metrics["pareto/hypervolume"] == pytest.approx(HV)
    rows = list(csv.DictReader(open(client.download_artifacts(parent, "pareto.csv"))))
    assert len(rows) == 6 and sum(r["on_frontier"] == "True" for r in rows) == 4
    assert {r["run_id"] for r in rows if r["on_frontier"] == "True"} == {
        store["children"][k] for k in ("rb0", "rb1", "rb2", "mc1")}


def test_cli(store, tmp_path, capsys):
    out = tmp_path / "pareto"
    assert main(["--experiment", "sweep-a", "--tracking-uri", store["uri"], "--out", str(out),
                 "--new-run", "pareto-all"]) == 0
    printed = capsys.readouterr().out
    assert "7 used, 4 skipped" in printed and "1 sweep parent run" in printed and "1 stopped before" in printed
    assert (out / "pareto.png").stat().st_size > 10_000
    assert (out / "pareto.html").stat().st_size > 10_000
    assert "?workflowType=machine_learning" in printed  # the link to the new run opens in Model training
    rows = list(csv.DictReader(open(out / "pareto.csv")))
    assert len(rows) == 7
    # the outsider (0.95, 12) joins the frontier; mc's (0.9, 8) stays: rb 3, mc 1, seq 1 of 5
    table = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if line.split()}
    assert table["rb"][:3] == ["3", "3", "60.0%"] and table["seq"][:3] == ["1", "1", "20.0%"]
    assert len(table["rb"]) == 5 and table["rb"][3].startswith("[")  # the share's bootstrap CI over runs
    new = store["client"].search_runs([store["client"].get_experiment_by_name("sweep-a").experiment_id],
                                      "attributes.run_name = 'pareto-all'")
    assert len(new) == 1 and new[0].data.metrics["pareto/share/seq"] == pytest.approx(0.2)
    # the summary run lands in the same experiment; a recomputation names it instead of using it
    assert collect_runs(store["client"], experiment_names=["sweep-a"]).skipped["pareto summary run"] == [
        new[0].info.run_id]


def test_cli_errors(store, tmp_path, capsys):
    assert main(["--experiment", "nope", "--tracking-uri", store["uri"], "--out", str(tmp_path)]) == 1
    assert "available: ['Default', 'sweep-a', 'tabular-a']" in capsys.readouterr().err
    assert main(["--run-ids", store["failed"], "--tracking-uri", store["uri"], "--out", str(tmp_path)]) == 1
    assert "no usable runs" in capsys.readouterr().err
    assert main(["--experiment", "sweep-a", "--tracking-uri", store["uri"], "--out", str(tmp_path / "x"),
                 "--log-to", "no-such-run"]) == 1
    assert "no-such-run" in capsys.readouterr().err and not (tmp_path / "x").exists()
    missing = f"sqlite:///{(tmp_path / 'none.db').resolve()}"
    assert main(["--experiment", "sweep-a", "--tracking-uri", missing]) == 1
    assert "no MLflow store at" in capsys.readouterr().err and not (tmp_path / "none.db").exists()


def test_runs_of_another_setup_are_never_merged(store, tmp_path, capsys):
    """A vader sweep and a tabular run: one frontier each, or a refusal naming the differing key."""
    client = store["client"]
    both = collect_runs(client, experiment_names=["sweep-a", "tabular-a"])
    groups = group_runs(both)
    assert [(labels, len(pts)) for labels, pts in groups] == [({"reward.kind": "vader"}, 7),
                                                              ({"reward.kind": "tabular"}, 1)]
    assert group_runs(both, vary=["reward"])[0][1] == list(both)  # unless the user says the key may vary
    args = ["--experiment", "sweep-a", "--experiment", "tabular-a", "--tracking-uri", store["uri"]]
    assert main(args + ["--out", str(tmp_path / "p")]) == 0
    printed = capsys.readouterr().out
    assert "not merged: 2 groups of runs that differ in reward.kind" in printed
    assert (tmp_path / "p" / "group-1" / "pareto.png").is_file() and (tmp_path / "p" / "group-2" / "pareto.csv").is_file()
    assert main(args + ["--out", str(tmp_path / "q"), "--new-run", "mixed"]) == 1
    assert "not logging one frontier for runs that are not comparable" in capsys.readouterr().err


def test_pareto_reads_the_store_runs_write(store, tmp_path, monkeypatch, capsys):
    """klbench-pareto resolves the store as runs do: $KLBENCH_OUTPUTS/mlflow.db, not ./outputs."""
    import shutil
    outputs = tmp_path / "elsewhere"
    outputs.mkdir()
    shutil.copy(store["uri"][len("sqlite:///"):], outputs / "mlflow.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("KLBENCH_OUTPUTS", str(outputs))
    monkeypatch.chdir(tmp_path)
    assert main(["--experiment", "sweep-a"]) == 0
    assert f"tracking URI: sqlite:///{outputs.resolve()}/mlflow.db" in capsys.readouterr().out
    assert list((outputs / "pareto").glob("*/pareto.png")) and not (tmp_path / "outputs").exists()


def test_pareto_reads_a_read_only_store(store, tmp_path, monkeypatch, capsys, read_only):
    """A store on a read-only filesystem (or folder) is read, with --out elsewhere: reading takes no lock
    file and writes nothing (issue 34: it could not even open it)."""
    import shutil
    outputs = tmp_path / "archive"
    outputs.mkdir()
    shutil.copy(store["uri"][len("sqlite:///"):], outputs / "mlflow.db")
    read_only(outputs)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("KLBENCH_OUTPUTS", str(outputs))
    assert main(["--experiment", "sweep-a", "--out", str(tmp_path / "out"), "--bootstrap", "0"]) == 0, \
        capsys.readouterr().err
    assert (tmp_path / "out" / "pareto.csv").is_file() and sorted(os.listdir(outputs)) == ["mlflow.db"]


# ---- one run per trial: a sweep that lost track of a trial may have trained it twice ----

def test_one_per_trial_keeps_the_newest_run_of_each_trial():
    from klbench.analysis.frontier import one_per_trial
    base = {"estimator.name": "rb", "estimator.beta": "0.1", "seed": "0", "task.max_steps": "60"}

    def point(run_id, parent, start, **params):
        return {"run_id": run_id, "parent": parent, "start_time": start, "params": {**base, **params}}
    again = point("again", "P", 2, **{"paths.ckpt_dir": "/b/0/checkpoints", "ckpt_path": "last"})
    first = point("first", "P", 1, **{"paths.ckpt_dir": "/a/0/checkpoints"})  # the same trial: bookkeeping differs
    other_beta = point("beta", "P", 3, **{"estimator.beta": "0.2"})
    other_seed = point("seed", "P", 0, seed="1")
    other_sweep = point("sweep", "Q", 0)  # another sweep's run of the same config: its own point
    by_hand = [point("hand1", None, 5), point("hand2", None, 6)]  # a config run twice by hand: a repeat
    kept, dropped = one_per_trial([again, first, other_beta, other_seed, other_sweep, *by_hand])
    assert [p["run_id"] for p in kept] == ["again", "beta", "seed", "sweep", "hand1", "hand2"]
    assert [p["run_id"] for p in dropped] == ["first"]
    kept, dropped = one_per_trial([first, again])  # the newest wins whatever the order
    assert [p["run_id"] for p in kept] == ["again"] and [p["run_id"] for p in dropped] == ["first"]


def test_collect_runs_counts_a_trial_once(store, tmp_path):
    from mlflow.entities import Metric, Param
    client = store["client"]
    exp = client.create_experiment("sweep-twice", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(exp, run_name="sweep-parent").info.run_id

    def trial(beta: float, reward: float, start: int, run_dir: str) -> str:
        tags = {"mlflow.parentRunId": parent, "klbench.steps_done": "60", "klbench.max_steps": "60"}
        rid = client.create_run(exp, start_time=start, tags=tags).info.run_id
        client.log_batch(rid, metrics=[Metric("val/reward", reward, start, 60), Metric("val/seq_kl", 1.0, start, 60)],
                         params=[Param("estimator.name", "rb"), Param("estimator.beta", str(beta)), Param("seed", "0"),
                                 Param("paths.ckpt_dir", f"{run_dir}/checkpoints")])
        client.set_terminated(rid, "FINISHED")
        return rid
    first = trial(0.1, 0.2, 1000, "/sweep/0")
    other = trial(0.3, 0.5, 1500, "/sweep/1")
    again = trial(0.1, 0.25, 2000, "/rerun/0")  # the rerun of a sweep that lost track of trial 0
    runs = collect_runs(client, parent_run_id=parent)
    assert sorted(r["run_id"] for r in runs) == sorted([other, again])
    assert runs.skipped == {"older run of the same trial": [first]}
    assert runs.describe() == "2 used, 1 skipped (1 older run of the same trial)"


# ---- the interactive figure (issue 21) ----

def test_frontier_band_bounds():
    """Every resample is a subset of the runs, so no band is above the runs' own frontier; a label with one
    run puts it in every resample, so the band's floor holds it from its KL on."""
    from klbench.analysis.frontier import attainment, frontier_band
    rng = np.random.default_rng(0)
    kls, rewards = rng.uniform(0, 5, 30), rng.uniform(0, 1, 30)
    labels = ["a"] + ["b"] * 29
    kls[0], rewards[0] = 1.0, 2.0  # the lone `a` run dominates from KL 1 on
    grid = np.unique(kls)
    lo, hi = frontier_band(labels, rewards, kls, grid, n_boot=200)
    full = attainment(rewards, kls, grid)
    assert (lo <= hi).all() and (hi <= full).all()
    assert (lo[grid >= 1.0] == 2.0).all() and np.isneginf(lo[grid < kls[1:].min()]).all()
    with pytest.raises(ValueError, match="n_boot"):
        frontier_band(labels, rewards, kls, grid, n_boot=0)


def test_pareto_figure_traces():
    from klbench.analysis.plotly_figure import pareto_figure
    pts = [{"estimator": e, "reward": r, "seq_kl": k, "run_name": f"{e} {i}"} for i, (e, r, k) in enumerate(
        [("rb", 0.2, 1.0), ("rb", 0.5, 2.0), ("mc", 0.4, 1.5), ("mc", 0.1, 3.0)])]
    exact = Frontier(betas=torch.tensor([1.0, 0.5]), rewards=torch.tensor([0.4, 0.9]), kls=torch.tensor([0.5, 2.5]))
    fig = pareto_figure(pts, exact, n_boot=50)
    names = [t.name or "" for t in fig.data]
    assert sum(n.startswith(("rb:", "mc:")) for n in names) == 2  # one colour per estimator
    assert any("bootstrap band" in n for n in names) and "empirical frontier (non-dominated runs)" in names
    ex = next(t for t in fig.data if (t.name or "").startswith("exact optimum"))
    np.testing.assert_allclose([ex.x, ex.y], [[0.5, 2.5], [0.4, 0.9]], rtol=1e-6)
    assert not any((t.name or "").startswith("exact") for t in pareto_figure(pts, None, n_boot=0).data)


def test_exact_frontier_from_params_matches_the_sweeps(tmp_path):
    """klbench-pareto rebuilds the tabular model's exact frontier from the runs' params, as a sweep does from
    its config (klbench.sweep.exact)."""
    from klbench.analysis.mlflow_io import exact_frontier_of
    from klbench.config.compose import compose
    from klbench.record.tracking import flat_params
    from klbench.sweep.exact import exact_frontier
    cfg = compose(["experiment=tabular", "model.ref_seed=3", "reward.seed=5"], outputs=tmp_path)
    points = [{"params": flat_params(cfg)}, {"params": flat_params(cfg)}]
    ours, theirs = exact_frontier_of(points), exact_frontier(cfg)
    np.testing.assert_allclose(ours.kls, theirs.kls) and np.testing.assert_allclose(ours.rewards, theirs.rewards)
    other = {**flat_params(cfg), "reward.seed": "6"}
    assert exact_frontier_of(points + [{"params": other}]) is None  # two rewards: no one exact frontier
    assert exact_frontier_of([{"params": {**other, "model.kind": "embedded"}}]) is None


def test_a_persons_run_description_is_kept(store):
    from klbench.analysis.mlflow_io import describe_frontier_run
    client = store["client"]
    rid = client.create_run(client.get_experiment_by_name("sweep-a").experiment_id).info.run_id
    client.set_tag(rid, "mlflow.note.content", "my notes")
    describe_frontier_run(client, rid)
    describe_frontier_run(client, rid)  # once
    note = client.get_run(rid).data.tags["mlflow.note.content"]
    assert note.startswith("my notes\n\n") and note.count("`pareto.html`") == 1
    client.delete_run(rid)


def test_a_library_setting_with_a_plus_is_a_valid_metric_name():
    """verl.kl_penalty.k3+ labels its runs `library:verl.kl_penalty.k3+`; MLflow refuses "+" in metric names,
    so the frontier's per-estimator metrics name it k3plus (the label in tables keeps the "+")."""
    from mlflow.utils.validation import _validate_metric_name
    from klbench.analysis.mlflow_io import estimator_label, metric_name
    label = estimator_label({"estimator.name": "library", "estimator.setting": "verl.kl_penalty.k3+"})
    assert label == "library:verl.kl_penalty.k3+"
    assert metric_name(label) == "library:verl.kl_penalty.k3plus"
    _validate_metric_name(f"pareto/share/{metric_name(label)}")
    assert metric_name("in_reward:k3") == "in_reward:k3"


def test_the_reward_axis_can_be_another_metric(tmp_path):
    """klbench-pareto --reward-metric val/accuracy (reward=answer): the points read it, runs without it are
    skipped, and the figure names it."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param
    uri = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("arith", artifact_location=str((tmp_path / "art").resolve()))
    ids = []
    for i, (reward, acc, kl) in enumerate([(0.9, 0.3, 1.0), (0.2, 0.6, 2.0), (0.5, None, 0.5)]):
        rid = client.create_run(exp, run_name=f"r{i}", tags={"klbench.steps_done": "60",
                                                             "klbench.max_steps": "60"}).info.run_id
        ms = [Metric("val/reward", reward, 0, 1), Metric("val/seq_kl", kl, 0, 1)]
        ms += [Metric("val/accuracy", acc, 0, 1)] if acc is not None else []
        client.log_batch(rid, metrics=ms, params=[Param("estimator.name", "rb"), Param("seed", str(i))])
        client.set_terminated(rid)
        ids.append(rid)
    runs = collect_runs(client, experiment_names=["arith"], reward_metric="val/accuracy")
    assert sorted(r["reward"] for r in runs) == [0.3, 0.6] and runs.skipped == {"missing metric val/accuracy": [ids[2]]}
    out = tmp_path / "pareto"
    assert main(["--experiment", "arith", "--tracking-uri", uri, "--out", str(out), "--reward-metric",
                 "val/accuracy", "--bootstrap", "0"]) == 0
    from klbench.analysis.plotly_figure import pareto_figure
    assert pareto_figure(list(runs), n_boot=0).layout.yaxis.title.text == "reward   (val/accuracy)"
    assert {float(r["reward"]) for r in csv.DictReader(open(out / "pareto.csv"))} == {0.3, 0.6}


def test_in_reward_placements_are_cells_of_their_own():
    from klbench.analysis.mlflow_io import estimator_label
    base = {"estimator.name": "in_reward", "estimator.value": "k1", "estimator.form": "sequence",
            "estimator.baseline": "none", "estimator.kl_norm": "after"}
    assert estimator_label(base) == "in_reward:k1"
    assert estimator_label({**base, "estimator.form": "reward_to_go"}) == "in_reward:k1:reward_to_go"  # frpo
    assert estimator_label({**base, "estimator.kl_norm": "fused"}) == "in_reward:k1:fused"  # kl_fused
