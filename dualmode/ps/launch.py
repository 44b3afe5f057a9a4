"""``python -m dualmode.run --ps --server_num S --worker_num W train.py``: every role of a
parameter server job on this machine.

The scheduler and the S servers run as plain processes (``DIR/scheduler.log``,
``DIR/server_<i>.log``); the W workers run under MPICH's ``mpiexec`` through
:mod:`dualmode._rank_wrapper` (``DIR/worker_<rank>.log``, worker 0 echoed to the
terminal), so the weights not held by the servers are all-reduced among them. Every
process gets ``DM_ROLE``, ``DM_SERVER_NUM``, ``DM_WORKER_NUM``, ``DM_SCHED_HOST`` and
``DM_SCHED_PORT`` (``--master_addr`` / ``--master_port``, default 127.0.0.1 and a free
port). The launcher exits 0 when every role did; otherwise it stops the others and exits
1 naming the first role that failed (its exit code or signal, and its log).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from .._rank_wrapper import FAIL_MARK

__all__ = ["launch_ps"]

_PREFIX = "dualmode.run"
_GRACE = 30.0          # seconds the scheduler and servers get to stop after the workers


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def launch_ps(script: str, args: Sequence[str], server_num: int, worker_num: int,
              log_dir: str, mpiexec: str, host: Optional[str] = None,
              port: Optional[int] = None, timeout: Optional[float] = None) -> int:
    """Run the job; 0, or 1 after naming the failed role on stderr."""
    os.makedirs(log_dir, exist_ok=True)
    host = host or "127.0.0.1"
    port = port or _free_port(host)
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("DM_", "MS_ROLE")):
            del env[k]
    env.update({"DM_SERVER_NUM": str(server_num), "DM_WORKER_NUM": str(worker_num),
                "DM_SCHED_HOST": host, "DM_SCHED_PORT": str(port)})
    env.setdefault("OMP_NUM_THREADS",
                   str(max(1, (os.cpu_count() or 1) // (worker_num + server_num + 1))))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    roles: Dict[str, subprocess.Popen] = {}
    logs: Dict[str, str] = {}

    def start(name: str, role: str) -> None:
        path = os.path.join(log_dir, f"{name}.log")
        logs[name] = path
        with open(path, "wb") as fh:
            roles[name] = subprocess.Popen([sys.executable, script, *args],
                                           env=dict(env, DM_ROLE=role), stdout=fh,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    start("scheduler", "DM_SCHED")
    for i in range(server_num):
        start(f"server_{i}", "DM_PSERVER")
    workers = subprocess.Popen([mpiexec, "-n", str(worker_num), sys.executable, "-m",
                                "dualmode._rank_wrapper", "--log_dir", log_dir, script, *args],
                               env=dict(env, DM_ROLE="DM_WORKER"), stderr=subprocess.PIPE,
                               start_new_session=True)
    failures: List[str] = []

    def pump() -> None:
        for raw in workers.stderr:
            line = raw.decode("utf-8", "replace")
            if line.startswith(FAIL_MARK):
                failures.append("worker " + line[len(FAIL_MARK):].strip())
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    everything = list(roles.values()) + [workers]
    start_time = time.monotonic()
    failed: Optional[str] = None
    workers_done: Optional[float] = None
    try:
        while failed is None:
            for name, p in roles.items():
                code = p.poll()
                if code not in (None, 0):
                    failed = f"{name} failed ({_describe(code)}); see {logs[name]}"
                    break
            code = workers.poll()
            if failed is None and code is not None:
                if code != 0:
                    reader.join(timeout=5)
                    first = failures[0] if failures else f"the workers failed (mpiexec " \
                                                         f"{_describe(code)})"
                    failed = f"{first}; see {log_dir}/worker_<rank>.log"
                elif all(p.poll() is not None for p in roles.values()):
                    break
                elif workers_done is None:
                    workers_done = time.monotonic()
                elif time.monotonic() - workers_done > _GRACE:
                    left = [n for n, p in roles.items() if p.poll() is None]
                    failed = (f"{left[0]} did not stop within {_GRACE:g} s after the workers "
                              f"finished; see {logs[left[0]]}")
            if timeout is not None and time.monotonic() - start_time > timeout:
                failed = f"the job did not finish within --timeout={timeout:g} s"
            time.sleep(0.1)
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        _kill(everything)
    if failed is not None:
        sys.stderr.write(f"{_PREFIX}: {failed}\n")
        return 1
    return 0
