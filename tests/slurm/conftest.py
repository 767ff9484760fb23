"""`slurm_cluster`: a private single-node SLURM cluster with accounting (see cluster.py), for the session.

Tests marked `slurm` are in the default test set; they skip, saying why, where the cluster cannot start
(not root, or the packages of .ci/install_servers.sh missing). `python -m pytest -m slurm` runs only them.
Set KLBENCH_SLURM_KEEP=1 to leave a cluster this session started running for the next one (a restart, not a new start).
"""
import importlib.util
import os
from pathlib import Path

import pytest

# loaded by path: `import cluster` would depend on pytest's import mode and could meet another `cluster`
_spec = importlib.util.spec_from_file_location("klbench_tests_slurm_cluster", Path(__file__).with_name("cluster.py"))
cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cluster)


@pytest.fixture(scope="session")
def slurm_cluster():
    """Yields the env that reaches the cluster ({"SLURM_CONF": ...}), also set in os.environ for the
    session so sbatch/sacct/scancel called by submitit (and the jobs it starts) find it."""
    why = cluster.missing()
    if why:
        pytest.skip(why)
    started = cluster.start()
    env = cluster.env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if started and not os.environ.get("KLBENCH_SLURM_KEEP"):
        cluster.stop()


_spec2 = importlib.util.spec_from_file_location("klbench_tests_slurm_two_nodes", Path(__file__).with_name("two_nodes.py"))
two_nodes_cluster = importlib.util.module_from_spec(_spec2)
_spec2.loader.exec_module(two_nodes_cluster)


@pytest.fixture(scope="session")
def _two_nodes_started(slurm_cluster):
    """The two-node cluster of two_nodes.py (its munge and slurmdbd are slurm_cluster's), for the session."""
    why = two_nodes_cluster.missing()
    if why:
        pytest.skip(f"two-node cluster: {why}")
    started = two_nodes_cluster.start()
    yield two_nodes_cluster
    if started and not os.environ.get("KLBENCH_SLURM_KEEP"):
        two_nodes_cluster.stop()  # its namespaces and bridge too


@pytest.fixture
def two_nodes(_two_nodes_started, monkeypatch):
    """The two_nodes module, with SLURM_CONF naming the two-node cluster for this test (the session's other SLURM
    tests keep the single-node cluster's)."""
    for k, v in _two_nodes_started.env().items():
        monkeypatch.setenv(k, v)
    return _two_nodes_started
