import atexit
import os
import shutil
import signal
import tempfile

import pytest

import cli_inprocess  # noqa: F401  first: it notes the warning filters that modules install as they import
import torch

# tests never reach a model hub: transformers must use local files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# tests never write to the user's cache (~/.cache/klbench) or to a record or run named in the environment:
# the embedded models they build go to one cache for the session (a test may set its own KLBENCH_CACHE),
# shared by every test and the `klbench` subprocesses they start. Under pytest-xdist the workers inherit
# the controller's cache (builds into it take a file lock), so the embedded models are built once per run
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("KLBENCH_TEST_CACHE"):
    os.environ["KLBENCH_CACHE"] = os.environ["KLBENCH_TEST_CACHE"]  # removed by the controller at its exit
else:
    os.environ["KLBENCH_CACHE"] = os.environ["KLBENCH_TEST_CACHE"] = tempfile.mkdtemp(prefix="klbench-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KLBENCH_CACHE"], ignore_errors=True)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # pytest-xdist workers share the cores: one torch thread each (and in the `klbench` processes they start),
    # or OpenMP barriers spin on threads the other worker has descheduled
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # a suite started in the background by a shell without job control (`nohup ... &` in a script) inherits
    # SIGINT ignored, and so would every `klbench` it starts: the Ctrl-C tests would wait for a stop that never
    # comes. A Python handler here is reset to the default in each child, as in a terminal's foreground
    signal.signal(signal.SIGINT, signal.default_int_handler)
RECORD_VARS = ("MLFLOW_TRACKING_URI", "KLBENCH_PARENT_RUN_ID", "KLBENCH_RESUME_CKPT")
for _var in RECORD_VARS:
    os.environ.pop(_var, None)


# the server tests share one session fixture each (a SLURM cluster on fixed ports, one PostgreSQL): under
# pytest-xdist (-n 2 in pyproject.toml) each kind runs on one worker, started once; the rest spread out
SERVER_GROUPS = ("slurm", "servers")
# modules whose module-scoped fixture is a whole sweep (and, for the UI, its served store and a browser): on one
# worker each it is built once, where spread over both it was built twice (20 s and 11 s of each run)
MODULE_GROUPS = {"test_mlflow_browser.py": "ui", "test_sweeps.py": "sweeps"}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for group in SERVER_GROUPS:
            if item.get_closest_marker(group):
                item.add_marker(pytest.mark.xdist_group(group))
        if item.path.name in MODULE_GROUPS:
            item.add_marker(pytest.mark.xdist_group(MODULE_GROUPS[item.path.name]))
    if getattr(config.option, "loadgroup", False) or getattr(config.option, "dist", "") == "loadgroup":
        _group_ids(items)


def _group_ids(items) -> None:
    """xdist's loadgroup keeps the tests whose id ends in @<group> on one worker. pytest-xdist 3.8 appends the group
    to item._nodeid, which pytest 9 no longer reads (a node's id is item._id): the groups were silently ignored
    and every worker built the servers, the cluster and the module fixtures above. The suffix goes where pytest 9
    reads it (after xdist's own hook: this one runs last)."""
    from _pytest.nodeid import coerce_node_id
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.fixture(autouse=True)
def _record_env_stays_clean():
    """A test must not send later tests' runs to its store: mlflow.set_tracking_uri() (which tests of
    MLflow's fluent API call) also sets $MLFLOW_TRACKING_URI, and a sweep callback run in-process sets
    KLBENCH_PARENT_RUN_ID / KLBENCH_RESUME_CKPT. Every test starts and ends without them."""
    yield
    for var in RECORD_VARS:
        os.environ.pop(var, None)


@pytest.fixture
def single_thread():
    """Run a test with one torch thread: on tiny tensors threads buy nothing, and on a busy 2-core machine
    every OpenMP barrier waits for a descheduled thread (measured: docs/estimators.md, "Cost of rb")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _save_tiny_lm(path, texts_seed: int, vocab_size: int, seed: int) -> str:
    from klbench.models.embedded.build import build_gpt2, train_tokenizer
    from klbench.models.embedded.corpus import generate_reviews
    tok = train_tokenizer(generate_reviews(300, seed=texts_seed), vocab_size)
    model = build_gpt2(len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64, seed=seed,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """A tiny GPT-2 + embedded-style tokenizer saved with save_pretrained, loaded back like a hub model."""
    return _save_tiny_lm(tmp_path_factory.mktemp("tiny_lm"), 0, 300, seed=0)


@pytest.fixture(scope="session")
def other_tiny_lm_dir(tmp_path_factory):
    """Same architecture, a tokenizer trained on other texts with another size: a different vocabulary."""
    return _save_tiny_lm(tmp_path_factory.mktemp("other_lm"), 5, 320, seed=1)



@pytest.fixture(scope="session")
def tiny_arch(tmp_path_factory):
    """arch -> (policy folder, teacher folder): tiny random models of each architecture of tests/tiny_lms.py's
    ARCHITECTURES on one chat tokenizer, built on first use and kept for the session."""
    from tiny_lms import save_chat_tokenizer, save_tiny_arch
    built, root = {}, tmp_path_factory.mktemp("arch")
    tok = save_chat_tokenizer(root / "tokenizer")

    def get(arch: str) -> tuple[str, str]:
        if arch not in built:
            built[arch] = (save_tiny_arch(arch, root / arch, seed=0, tokenizer=tok),
                           save_tiny_arch(arch, root / f"{arch}-teacher", seed=1, tokenizer=tok))
        return built[arch]
    return get


@pytest.fixture
def read_only():
    """make(path): `path` becomes read-only for the test's processes, root's included: a read-only bind mount
    as root (whom permissions do not stop; skipped where mounting is not allowed), else chmod a-w. Undone
    at the end."""
    import stat
    import subprocess
    undo = []

    def make(path) -> None:
        path = str(path)
        if os.geteuid() != 0:
            mode = os.stat(path).st_mode
            os.chmod(path, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
            undo.append(lambda: os.chmod(path, mode))
            return
        if subprocess.run(["mount", "--bind", path, path], capture_output=True).returncode != 0:
            pytest.skip("running as root, and a read-only bind mount is not allowed here")
        undo.append(lambda: subprocess.run(["umount", "--lazy", path], check=True))  # lazy: a client may hold it
        subprocess.run(["mount", "-o", "remount,bind,ro", path], check=True, capture_output=True)
    yield make
    for step in reversed(undo):
        step()
