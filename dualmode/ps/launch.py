"""``python -m dualmode.run --ps --server_num S --worker_num W train.py``: every role of a
parameter server job on this machine.

The scheduler and the S servers run as plain processes (``DIR/scheduler.log``,
``DIR/server_<i>.log``). Each of the W workers runs as its own one-rank MPI job
(``mpiexec -n 1``, through the launcher's rank monitor and :mod:`dualmode._rank_wrapper`:
``DIR/worker_<i>.log``, worker 0 echoed to the terminal); at ``init()`` the workers join
into one MPI world (:mod:`.workers_world`), over which the weights not held by the
servers are all-reduced. Every process gets ``DM_ROLE``, ``DM_SERVER_NUM``,
``DM_WORKER_NUM``, ``DM_SCHED_HOST`` and ``DM_SCHED_PORT`` (``--master_addr`` /
``--master_port``, default 127.0.0.1 and a free port).

Faults. A worker that raises, the scheduler or a server failing: the launcher stops
every role and exits 1 naming it. A worker that dies otherwise (a signal, ``os._exit``)
does not stop the others, since no mpiexec job holds them together: when every
trainable weight is on the servers they go on (the servers continue with the live
workers after the heartbeat timeout) and the launcher exits 1 at the end, naming the
dead worker. When the workers also all-reduce among themselves (weights not on the
servers), they wait for the dead one in their next collective: the launcher ends the
job once a live worker has waited there for a few seconds, naming the dead worker.
Nothing is left running.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

from .._rank_monitor import rank_command, read_record, record_path
from .._rank_wrapper import FAIL_MARK, PS_WORKER_VAR, STATE_DIR_VAR, read_state
from .workers_world import JOIN_DIR_VAR

__all__ = ["launch_ps"]

_PREFIX = "dualmode.run"
_GRACE = 30.0          # seconds the scheduler and servers get to stop after the workers
#: seconds a live worker may wait in a collective after another worker died
_SHARED_FATE_GRACE = 2.0


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


def _describe_status(status: int) -> str:
    """A wait status as words: ``was killed by signal 9 (SIGKILL)`` / ``exited with
    code 7``."""
    if os.WIFSIGNALED(status):
        num = os.WTERMSIG(status)
        try:
            return f"was killed by signal {num} ({signal.Signals(num).name})"
        except ValueError:
            return f"was killed by signal {num}"
    return f"exited with code {os.WEXITSTATUS(status)} (without a Python traceback)"


def _kill(procs: Sequence[subprocess.Popen], pids: Sequence[int] = ()) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid in pids:                # a worker that left its mpiexec's process group
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
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
    state_dir = tempfile.mkdtemp(prefix="dualmode_ps_")
    roles: Dict[str, subprocess.Popen] = {}
    logs: Dict[str, str] = {}

    def start(name: str, role: str) -> None:
        path = os.path.join(log_dir, f"{name}.log")
        logs[name] = path
        with open(path, "wb") as fh:
            roles[name] = subprocess.Popen([sys.executable, script, *args],
                                           env=dict(env, DM_ROLE=role), stdout=fh,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    failures: List[str] = []

    def pump(stream) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace")
            if line.startswith(FAIL_MARK):
                failures.append("worker " + line[len(FAIL_MARK):].strip())
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    start("scheduler", "DM_SCHED")
    for i in range(server_num):
        start(f"server_{i}", "DM_PSERVER")
    workers: List[subprocess.Popen] = []
    readers = []
    worker_env = dict(env, DM_ROLE="DM_WORKER", **{STATE_DIR_VAR: state_dir,
                                                   JOIN_DIR_VAR: state_dir})
    for i in range(worker_num):
        proc = subprocess.Popen([mpiexec, "-n", "1", *rank_command(log_dir, script, args)],
                                env=dict(worker_env, **{PS_WORKER_VAR: str(i)}),
                                stderr=subprocess.PIPE, start_new_session=True)
        workers.append(proc)
        readers.append(threading.Thread(target=pump, args=(proc.stderr,), daemon=True))
        readers[-1].start()
    everything = list(roles.values()) + workers
    start_time = time.monotonic()
    failed: Optional[str] = None
    dead: Dict[int, str] = {}              # worker -> how it ended (no traceback)
    waiting_since: Dict[int, float] = {}   # live worker -> in a collective since
    workers_done: Optional[float] = None
    try:
        while failed is None:
            for name, p in roles.items():
                code = p.poll()
                if code not in (None, 0):
                    failed = f"{name} failed ({_describe(code)}); see {logs[name]}"
                    break
            if failed is not None:
                break
            for i, p in enumerate(workers):
                code = p.poll()
                if code in (None, 0) or i in dead:
                    continue
                readers[i].join(timeout=5)
                mine = [f for f in failures if f.startswith(f"worker {i} ")]
                if mine:
                    failed = f"{mine[0]}; see {log_dir}/worker_{i}.log"
                    break
                rec = read_record(record_path(state_dir, str(i)))
                how = _describe_status(rec[0]) if rec is not None and rec[0] else \
                    f"ended (mpiexec {_describe(code)})"
                dead[i] = how
                sys.stderr.write(f"{_PREFIX}: worker {i} {how}; the other roles go on "
                                 f"without it; see {log_dir}/worker_{i}.log\n")
                sys.stderr.flush()
            if failed is not None:
                break
            if dead:
                failed = _shared_fate(workers, dead, state_dir, waiting_since)
                if failed is not None:
                    failed += f"; see {log_dir}/worker_<i>.log"
                    break
            if all(p.poll() is not None for p in workers):
                if all(p.poll() is not None for p in roles.values()):
                    break
                if workers_done is None:
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
        pids = []
        for i in range(worker_num):
            st = read_state(os.path.join(state_dir, f"rank_{i}"))
            if st is not None and st[1] == "run":
                pids.append(st[0])
        _kill(everything, pids)
        for t in readers:
            t.join(timeout=5)
        shutil.rmtree(state_dir, ignore_errors=True)
    if failed is not None:
        sys.stderr.write(f"{_PREFIX}: {failed}\n")
        return 1
    if dead:
        first = min(dead)
        sys.stderr.write(f"{_PREFIX}: worker {first} {dead[first]}; the other roles "
                         f"finished without it; see {log_dir}/worker_{first}.log\n")
        return 1
    return 0


def _shared_fate(workers, dead: Dict[int, str], state_dir: str,
                 waiting_since: Dict[int, float]) -> Optional[str]:
    """The verdict when a live worker has waited in an MPI collective (which needs the
    dead workers too) for ``_SHARED_FATE_GRACE`` seconds, else None."""
    now = time.monotonic()
    for i, p in enumerate(workers):
        if i in dead or p.poll() is not None:
            waiting_since.pop(i, None)
            continue
        st = read_state(os.path.join(state_dir, f"rank_{i}"))
        if st is None or st[1] != "run" or not st[2]:
            waiting_since.pop(i, None)
            continue
        since = waiting_since.setdefault(i, now)
        if now - since >= _SHARED_FATE_GRACE:
            first = min(dead)
            if st[4].endswith(("join_workers", "merge")):
                return (f"worker {first} {dead[first]} before the workers joined their "
                        f"MPI world, for which worker {i} waits in init() (ended every "
                        "role)")
            return (f"worker {first} {dead[first]} while worker {i} waits for it in "
                    f"{st[4]}: the workers all-reduce the weights that are not on the "
                    "servers, so they cannot go on without it (ended every role)")
    return None
