"""The `klbench` command run inside the test's own process, where the process itself is not under test.

`run(args, cwd=, env=)` stands for `subprocess.run([sys.executable, "-m", "klbench.cli", *args], cwd=, env=,
capture_output=True, text=True)` and returns the same CompletedProcess: what the command printed on stdout and
stderr, and the exit status a process would have had (a `sys.exit("klbench: error: ...")` prints its line to
stderr and gives 1, as Python does). It saves the 4 s each process spends starting Python and importing torch,
Lightning, Hydra and MLflow before any work (issue 46).

What a fresh process would start without, and what a later test must not inherit, is set and put back around
each call, in one place (`fresh_process`): sys.argv, os.environ, the current directory, stdout/stderr (also at
the file-descriptor level), signal handlers, logging's handlers and levels, warning filters, Hydra's global
state, MLflow's fluent globals, torch's RNG, thread count and deterministic flag, Python's collector, handlers
registered with atexit (klbench's and MLflow's run at the call's end, as at a process's exit), and klbench's
own per-process memory (klbench.record.interrupts, rundir, store, console.messages, sweep.jobs/storage).

Real processes stay where they are the point: signals, kill -9, parallel first starts, what a run imports at
start-up, DDP/FSDP ranks, SLURM, the servers and Chromium.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCONT)
# klbench's per-process memory, as a fresh process has it: (module, attribute, fresh value factory)
PROCESS_STATE = (
    ("klbench.record.interrupts", "received", lambda: None),
    ("klbench.record.interrupts", "_early", lambda: False),
    ("klbench.record.interrupts", "_deferred_since", lambda: None),
    ("klbench.record.rundir", "created", list),
    ("klbench.record.store", "_checked", set),
    ("klbench.console.messages", "_installed", set),
    ("klbench.sweep.storage", "_installed", dict),
    ("klbench.tasks.train", "_ddp_store", lambda: None),
)
# atexit handlers of these packages run when the call ends, as they would when its process exits
AT_EXIT_OF = ("klbench", "mlflow")


def run(args, *, cwd, env: dict, main: str = "klbench.cli", stderr=None) -> subprocess.CompletedProcess:
    """`python -m <main> *args` in `cwd` with exactly the environment `env`, in this process;
    `stderr=subprocess.STDOUT` writes both streams to stdout, as a process started so would."""
    import importlib
    entry = importlib.import_module(main)
    argv = [entry.__file__, *map(str, args)]
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, \
            tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        err = out if stderr == subprocess.STDOUT else err
        with fresh_process(argv, Path(cwd), env, out, err):
            code = _exit_code(entry.main)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), "" if err is out else err.read())


def _exit_code(main) -> int:
    """The exit status of a process that ran `sys.exit(main())`; Python's report of an uncaught exception."""
    try:
        raise SystemExit(main())
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT  # Python ends itself with SIGINT
    except BaseException:
        traceback.print_exc()
        return 1


@contextmanager
def fresh_process(argv: list[str], cwd: Path, env: dict, out, err):
    with ExitStack() as stack:
        for cm in (_argv_env_cwd(argv, cwd, env), _output(out, err), _signals(), _logging(), _warnings(),
                   _hydra(), _mlflow(), _torch(env), _collector(), _klbench_state(), _atexit()):
            stack.enter_context(cm)
        yield


@contextmanager
def _argv_env_cwd(argv, cwd, env):
    saved_argv, saved_env, saved_cwd = sys.argv[:], dict(os.environ), os.getcwd()
    sys.argv[:] = argv
    os.environ.clear()
    os.environ.update({k: str(v) for k, v in env.items()})
    os.chdir(cwd)
    try:
        yield
    finally:
        sys.argv[:] = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


@contextmanager
def _output(out, err):
    """sys.stdout/stderr and file descriptors 1 and 2 go to `out`/`err`, as a pipe each (not a terminal)."""
    saved = sys.stdout, sys.stderr
    for stream in saved:
        stream.flush()
    fds = os.dup(1), os.dup(2)
    out.reconfigure(line_buffering=True)
    err.reconfigure(line_buffering=True)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        out.flush()
        err.flush()
        sys.stdout, sys.stderr = saved
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)


@contextmanager
def _signals():
    """A fresh Python process: SIGINT raises KeyboardInterrupt, the others are the system's defaults."""
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    if threading_main():
        for s in SIGNALS:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    try:
        yield
    finally:
        if threading_main():
            for s, handler in saved.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def threading_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _logging():
    """Hydra configures the root logger (console and klbench.log), klbench and Lightning their loggers."""
    manager = logging.root.manager

    def state(lg):
        return lg.level, lg.handlers[:], lg.filters[:], lg.propagate, lg.disabled
    saved = {name: state(lg) for name, lg in [("", logging.root), *manager.loggerDict.items()]
             if isinstance(lg, logging.Logger)}
    saved_disable, saved_capture = manager.disable, logging._warnings_showwarning
    root_handlers = logging.root.handlers[:]
    logging.root.handlers[:] = []  # as in a fresh process: Hydra's logging configures an empty root
    try:
        yield
    finally:
        logging.root.handlers[:] = root_handlers
        kept = {id(h) for s in saved.values() for h in s[1]}
        for name, lg in [("", logging.root), *manager.loggerDict.items()]:
            if not isinstance(lg, logging.Logger):
                continue
            for h in lg.handlers:
                if id(h) not in kept:
                    h.close()
            if name in saved:
                lg.level, handlers, filters, lg.propagate, lg.disabled = saved[name]
                lg.handlers[:], lg.filters[:] = handlers, filters
            else:
                lg.handlers[:] = []
        manager.disable = saved_disable
        if (logging._warnings_showwarning is None) != (saved_capture is None):
            logging.captureWarnings(saved_capture is not None)
        manager._clear_cache()


@contextmanager
def _warnings():
    """The filters of a fresh `python -m` once it has imported what this process has: Python's own, then
    those the modules' top-level code installed, in order (pytest's filterwarnings, and the import-time
    filters it dropped with the test that imported a module, are not a process's); a warning is printed
    to stderr (pytest would record it instead)."""
    with warnings.catch_warnings():
        warnings.filters[:] = PYTHON_FILTERS
        warnings._filters_mutated()  # the modules' registries of warnings shown are stale now
        for add, args, kwargs in IMPORT_TIME_FILTERS:
            add(*args, **kwargs)
        warnings.showwarning = warnings._showwarning_orig
        warnings._showwarnmsg_impl = _print_warning
        yield


def _print_warning(msg) -> None:
    """Python's own warnings._showwarnmsg_impl."""
    (msg.file or sys.stderr).write(warnings._formatwarnmsg(msg))


IMPORT_TIME_FILTERS: list[tuple] = []  # (warnings function, args, kwargs) of each call from a module's top level


def _record_import_time_filters() -> None:
    """From now on (tests/conftest.py imports this module before torch), a warnings filter that a module
    installs as it is imported is noted, to be installed again in each call's fresh process."""
    for name in ("filterwarnings", "simplefilter"):
        add = getattr(warnings, name)
        if getattr(add, "_noted", False):
            continue

        def noting(*args, _add=add, **kwargs):
            if sys._getframe(1).f_code.co_name == "<module>":
                IMPORT_TIME_FILTERS.append((_add, args, kwargs))
            return _add(*args, **kwargs)
        noting._noted = True
        setattr(warnings, name, noting)


_record_import_time_filters()
PYTHON_FILTERS = [("default", None, DeprecationWarning, "__main__", 0),
                  ("ignore", None, DeprecationWarning, None, 0),
                  ("ignore", None, PendingDeprecationWarning, None, 0),
                  ("ignore", None, ImportWarning, None, 0),
                  ("ignore", None, ResourceWarning, None, 0)]


@contextmanager
def _hydra():
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    saved = HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = saved


@contextmanager
def _mlflow():
    """MLflow's fluent API keeps the tracking URI, the active experiment and run in module globals."""
    if "mlflow" not in sys.modules:
        yield
        return
    import mlflow
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils
    saved = utils._tracking_uri, fluent._active_experiment_id
    utils._tracking_uri, fluent._active_experiment_id = None, None
    try:
        yield
    finally:
        while mlflow.active_run():  # what mlflow's atexit handler does at a process's end
            mlflow.end_run()
        utils._tracking_uri, fluent._active_experiment_id = saved


@contextmanager
def _torch(env):
    import numpy as np
    import torch
    saved = (torch.random.get_rng_state(), np.random.get_state(), random.getstate(), torch.get_num_threads(),
             torch.are_deterministic_algorithms_enabled(), torch.is_warn_always_enabled(),
             torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_float32_matmul_precision())
    if env.get("OMP_NUM_THREADS"):  # what a process started with it would use
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        torch.random.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        torch.set_num_threads(saved[3])
        torch.use_deterministic_algorithms(saved[4])
        torch.set_warn_always(saved[5])
        torch.set_default_dtype(saved[6])
        torch.set_grad_enabled(saved[7])
        torch.set_float32_matmul_precision(saved[8])


@contextmanager
def _collector():
    """A single job freezes the objects torch and Lightning made (klbench.cli.app): given back here."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    try:
        yield
    finally:
        if not frozen:
            gc.unfreeze()
        (gc.enable if enabled else gc.disable)()


@contextmanager
def _klbench_state():
    """A module not imported yet is fresh; one imported is given a fresh value for the call, its own after."""
    saved = []
    for module, name, fresh in PROCESS_STATE:
        if module in sys.modules:
            saved.append((module, name, getattr(sys.modules[module], name)))
            setattr(sys.modules[module], name, fresh())
    jobs = sys.modules.get("klbench.sweep.jobs")
    claims = dict(jobs._claims) if jobs else {}
    if jobs:
        jobs._claims.clear()
    try:
        yield
    finally:
        if "klbench.sweep.jobs" in sys.modules:
            sys.modules["klbench.sweep.jobs"].release_claims()  # the locks a process's end releases
            sys.modules["klbench.sweep.jobs"]._claims.update(claims)
        for module, name, fresh in PROCESS_STATE:  # imported during the call: as fresh as it was
            if module in sys.modules:
                setattr(sys.modules[module], name, fresh())
        for module, name, value in saved:
            setattr(sys.modules[module], name, value)


@contextmanager
def _atexit():
    """Handlers registered during the call: klbench's and MLflow's run at its end (a process's exit),
    the rest (a library's import-time clean-up) are registered for this process's real exit."""
    registered = []
    real_register, real_unregister = atexit.register, atexit.unregister

    def register(func, *args, **kwargs):
        registered.append((func, args, kwargs))
        return func

    def unregister(func):
        registered[:] = [r for r in registered if r[0] != func]
        real_unregister(func)
    atexit.register, atexit.unregister = register, unregister
    try:
        yield
    finally:
        atexit.register, atexit.unregister = real_register, real_unregister
        for func, args, kwargs in reversed(registered):
            if getattr(func, "__module__", "").split(".")[0] in AT_EXIT_OF:
                try:
                    func(*args, **kwargs)
                except Exception:
                    traceback.print_exc(file=sys.__stderr__)
            else:
                real_register(func, *args, **kwargs)

