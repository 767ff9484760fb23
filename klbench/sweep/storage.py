"""The sweep's Optuna storage, made to wait out a database that is briefly gone.

A study on a database server (store=server) used to lose the sweep to a restart of that server: the
sweeper's next call failed, the sweep exited 1 and the trials it had just trained stayed RUNNING; after a
quick restart a stale pooled connection failed the call that records a trained trial, which the plugin
then marked FAIL. Here, in the sweep's process:

- a pooled connection is tested before it is used (SQLAlchemy's pool_pre_ping), and
- a call that fails because the connection is lost is retried, waiting 1, 2, 4, ... 15 s between tries,
  for at most $KLBENCH_OPTUNA_RETRY_S seconds in all (default 120; 0: no retry). The console says what
  it waits for; when the time is up it says so in one line and the process exits with status 1, before
  the plugin could mark a trained trial FAIL; any later call in the process is refused at once. The
  rerun of the same command settles the trials it left (klbench.sweep.study).

The plugin builds its study from the URL string in hydra.sweeper.storage, and a Hydra config cannot hold
a storage object, so `install` makes optuna.storages.get_storage return this storage for that one URL.
Look here when the plugin or Optuna is upgraded.

Limit: a connection lost while the database commits a new trial can leave that trial RUNNING and empty
besides the one the retry creates; the next resume marks it FAIL.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from optuna.storages import RDBStorage

from klbench.record.redact import redact

log = logging.getLogger(__name__)

RETRY_ENV = "KLBENCH_OPTUNA_RETRY_S"
DEFAULT_RETRY_S = 120.0
FIRST_WAIT_S, MAX_WAIT_S = 1.0, 15.0
CONNECT_TIMEOUT_S = 10  # a server that does not answer at all must not hold one try for minutes

# the calls retried: every read and write of a study and its trials
RETRIED = ("create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr",
           "get_study_id_from_name", "get_study_name_from_id", "get_study_directions", "get_study_user_attrs",
           "get_study_system_attrs", "get_all_studies", "create_new_trial", "set_trial_param", "get_trial_param",
           "set_trial_state_values", "set_trial_intermediate_value", "set_trial_user_attr",
           "set_trial_system_attr", "get_trial_id_from_study_id_trial_number", "get_trial", "get_all_trials",
           "get_best_trial", "get_n_trials", "get_trial_params", "get_trial_user_attrs",
           "get_trial_system_attrs", "get_trial_number_from_id",
           # what Optuna's cache in front of it calls
           "_create_new_trial", "_get_best_trial_id", "_get_trials", "_set_trial_param")


class StorageUnreachable(SystemExit):
    """The database stayed unreachable for the whole retry budget: the sweep's process ends (status 1)
    after the one line that says so. A SystemExit, so that no `except Exception` on the way (the plugin
    marks a trial FAIL in one) takes it for a failed trial."""


def retry_budget() -> float:
    """$KLBENCH_OPTUNA_RETRY_S: seconds to retry an unreachable storage (0: no retry); EnvError (a ValueError)."""
    from klbench.record.env_values import positive_seconds
    return positive_seconds(RETRY_ENV, DEFAULT_RETRY_S, "the seconds to retry an unreachable Optuna storage",
                            zero_ok=True)


def lost_connection(e: BaseException) -> bool:
    """Whether `e` (or what Optuna wrapped into it) says the database could not be reached."""
    from sqlalchemy import exc
    for err in (e, e.__cause__, e.__context__):
        if isinstance(err, (exc.OperationalError, exc.InterfaceError)) or (
                isinstance(err, exc.DBAPIError) and err.connection_invalidated):
            return True
    return False


class RetryingStorage(RDBStorage):
    """RDBStorage with pre-pinged connections and bounded retries on a lost connection (module docstring)."""

    def __init__(self, url: str, retry_s: float):
        self._retry_s, self._shown, self._gave_up = retry_s, redact(url), False
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if url.startswith("postgresql") and "connect_timeout" not in url:
            kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
        self._retrying("connect", lambda: RDBStorage.__init__(self, url, engine_kwargs=kwargs))

    def _retrying(self, what: str, call: Callable[[], Any], settled: Callable[[], bool] | None = None) -> Any:
        """call(), retried while the connection is lost, within the budget. `settled()`: whether a try that
        seemed to fail did take effect (its commit reached the database before the connection went)."""
        if self._gave_up:
            raise StorageUnreachable(1)
        start, wait, tries = time.monotonic(), FIRST_WAIT_S, 0
        while True:
            try:
                return call()
            except Exception as e:
                if tries and settled is not None and settled():
                    return True
                if not lost_connection(e):
                    raise
                waited = time.monotonic() - start
                if waited >= self._retry_s:
                    self._gave_up = True
                    log.error("the Optuna storage %s is still unreachable after %.0f s (%s=%g): giving up; "
                              "rerun the same command once it is back", self._shown, waited, RETRY_ENV,
                              self._retry_s)
                    raise StorageUnreachable(1) from e
                if tries == 0:
                    log.warning("the Optuna storage %s is unreachable (%s: %s); retrying for up to %g s (%s)",
                                self._shown, type(e.__cause__ or e).__name__, str(e.__cause__ or e).strip()
                                .splitlines()[0][:200], self._retry_s, RETRY_ENV)
                else:
                    log.warning("still waiting for the Optuna storage %s (%s; %.0f of %g s)", self._shown,
                                what, waited, self._retry_s)
                tries += 1
                time.sleep(min(wait, max(0.0, self._retry_s - waited)))
                wait = min(2 * wait, MAX_WAIT_S)

    def set_trial_state_values(self, trial_id, state, values=None) -> bool:
        def settled() -> bool:  # the earlier try was committed: the trial is already what was asked
            try:
                t = RDBStorage.get_trial(self, trial_id)
            except Exception:
                return False
            return t.state == state and (values is None or list(t.values or []) == list(values))
        return self._retrying("record a trial's state", lambda: RDBStorage.set_trial_state_values(
            self, trial_id, state, values), settled)


def _retried(name: str):
    method = getattr(RDBStorage, name)

    def call(self, *args, **kwargs):
        return self._retrying(name.strip("_").replace("_", " "), lambda: method(self, *args, **kwargs))
    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


for _name in RETRIED:
    if _name not in RetryingStorage.__dict__:
        setattr(RetryingStorage, _name, _retried(_name))

_installed: dict[str, RetryingStorage] = {}


def install(url: str) -> RetryingStorage | None:
    """This process's storage for `url`; from now on optuna.create_study/load_study(storage=url) use it.
    None for SQLite (store=local): a file has no connection to lose, and its errors do not pass."""
    import optuna.storages as storages
    if url.startswith("sqlite"):
        return None
    if url not in _installed or _installed[url]._gave_up:
        _installed[url] = RetryingStorage(url, retry_budget())
    if not getattr(storages.get_storage, "_klbench", False):
        original = storages.get_storage

        def get_storage(storage):
            return original(_installed.get(storage, storage) if isinstance(storage, str) else storage)
        get_storage._klbench = True
        storages.get_storage = get_storage
    return _installed[url]
