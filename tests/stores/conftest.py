"""Real stores for the tests, each started once per session and listening on 127.0.0.1 only.

- `postgres_url`: a private PostgreSQL cluster (Debian's /usr/lib/postgresql/*/bin) with an empty database;
  yields "postgresql+psycopg://klbench:PASSWORD@127.0.0.1:PORT/klbench" (SQLAlchemy / Optuna storage URL).
- `mlflow_server`: `mlflow server` of this venv on a SQLite store; yields "http://127.0.0.1:PORT".

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
        yield f"postgresql+psycopg://klbench:{password}@127.0.0.1:{port}/klbench"
    finally:
        if (data / "postmaster.pid").exists():
            pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_server")
    log = root / "server.log"
    port = _free_port()
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
    # 2 workers: the default 4 each import MLflow, slow to start on a small CI machine
    cmd += ["server", "--host", "127.0.0.1", "--port", str(port), "--workers", "2",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts")]
    url = f"http://127.0.0.1:{port}"
    # without this, MLflow 3 also starts a job runner and 7 huey consumer processes (GenAI evaluation jobs,
    # trace rollups), none of which tracking needs: seconds of CPU at start and stop
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    with open(log, "w") as out:
        # own process group: the server's workers go down with it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    try:
        _wait(healthy, proc, "mlflow server", log, timeout=120)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
