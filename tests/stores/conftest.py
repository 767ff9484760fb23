"""Real stores for the tests, each started once per session and listening on 127.0.0.1 only.

- `postgres_url`: a private PostgreSQL cluster (Debian's /usr/lib/postgresql/*/bin) with an empty database;
  yields "postgresql+psycopg://klbench:PASSWORD@127.0.0.1:PORT/klbench" (SQLAlchemy / Optuna storage URL).
- `mlflow_server`: `mlflow server` of this venv on a SQLite store; yields "http://127.0.0.1:PORT".
- `postgres_ctl`: stop() and start() for the cluster behind `postgres_url` (pg_ctl stop -m fast / start), to
  test an outage; a test that stops it must start it again.

Each skips, saying why, where its binaries are missing (.ci/install_servers.sh installs PostgreSQL).
"""
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from glob import glob
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def _wait(ready, proc: subprocess.Popen | None, what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}; {log}:\n{_tail(log)}")
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout} s; {log}:\n{_tail(log)}")


_PG_CONTROL: dict[str, object] = {}  # postgres_url -> its cluster's control, for postgres_ctl


class PostgresControl:
    def __init__(self, pg, data: Path, log: Path, opts: str):
        self._pg, self._data, self._log, self._opts = pg, data, log, opts

    @property
    def running(self) -> bool:
        return (self._data / "postmaster.pid").exists()

    def stop(self) -> None:
        r = self._pg("pg_ctl", "-D", str(self._data), "-m", "fast", "-w", "stop")
        if r.returncode:
            raise RuntimeError(f"pg_ctl stop failed: {r.stderr}")

    def start(self) -> None:
        r = self._pg("pg_ctl", "-D", str(self._data), "-l", str(self._log), "-o", self._opts, "-w", "-t", "60",
                     "start")
        if r.returncode:
            raise RuntimeError(f"pg_ctl start failed: {r.stderr}\n{_tail(self._log)}")


@pytest.fixture(scope="session")
def postgres_url():
    initdbs = sorted(glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not initdbs:
        pytest.skip("PostgreSQL not installed (no /usr/lib/postgresql/*/bin/initdb): run .ci/install_servers.sh")
    pytest.importorskip("psycopg", reason="the PostgreSQL driver is missing: pip install 'psycopg[binary]'")
    bin_dir = Path(initdbs[-1]).parent
    # initdb and postgres refuse to run as root; anyone else runs them as themselves
    as_user = {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}
    # not tmp_path_factory: pytest's 0700 root directory is closed to the postgres user
    root = Path(tempfile.mkdtemp(prefix="klbench-pg-"))
    if as_user:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    data, log, pwfile = root / "data", root / "postgres.log", root / "pw"
    password = secrets.token_hex(12)
    pwfile.write_text(password)
    if as_user:
        os.chown(pwfile, pw.pw_uid, pw.pw_gid)

    def pg(*cmd, **kw):
        return subprocess.run([str(bin_dir / cmd[0]), *cmd[1:]], cwd=root, capture_output=True, text=True,
                              **as_user, **kw)

    try:
        r = pg("initdb", "-D", str(data), "-U", "klbench", f"--pwfile={pwfile}", "--auth=scram-sha-256",
               "-E", "UTF8", "--no-sync")
        if r.returncode:
            raise RuntimeError(f"initdb failed: {r.stderr}")
        for _ in range(3):  # the free port can be taken between _free_port and the bind
            port = _free_port()
            # fsync off: a test database is thrown away, and a crash in the middle does not matter
            opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c full_page_writes=off"
            r = pg("pg_ctl", "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "60", "start")
            if r.returncode == 0:
                break
        else:
            raise RuntimeError(f"PostgreSQL did not start: {r.stderr}\n{_tail(log)}")
        r = pg("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "klbench", "klbench",
               env={**os.environ, "PGPASSWORD": password})
        if r.returncode:
            raise RuntimeError(f"createdb failed: {r.stderr}")
        url = f"postgresql+psycopg://klbench:{password}@127.0.0.1:{port}/klbench"
        _PG_CONTROL[url] = PostgresControl(pg, data, log, opts)
        yield url
    finally:
        if (data / "postmaster.pid").exists():
            pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_ctl(postgres_url):
    """Stops and starts the cluster of `postgres_url`; started again after the test whatever happened."""
    ctl = _PG_CONTROL[postgres_url]
    try:
        yield ctl
    finally:
        if not ctl.running:
            ctl.start()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def own_mlflow_server(tmp_path):
    """A server of the test's own, which the test may stop and start again (same port, same store)."""
    server = MlflowServer(tmp_path / "mlflow_server")
    server.start()
    try:
        yield server
    finally:
        server.stop()


class MlflowServer:
    """`mlflow server` on 127.0.0.1 over a SQLite store in `root`."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.port, self.proc = root, _free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        log = self.root / "server.log"
        exe = Path(sys.executable).with_name("mlflow")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
        # 2 workers: the default 4 each import MLflow, slow to start on a small CI machine
        cmd += ["server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "2",
                "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination", str(self.root / "artifacts")]
        # without this, MLflow 3 also starts a job runner and 7 huey consumer processes (GenAI evaluation
        # jobs, trace rollups), none of which tracking needs: seconds of CPU at start and stop
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        with open(log, "a") as out:
            # own process group: the server's workers go down with it
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env)
        _wait(healthy, self.proc, "mlflow server", log, timeout=120)
        return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
