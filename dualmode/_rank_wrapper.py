"""One rank of a job started by :mod:`dualmode.run` (``mpiexec ... python
.../_rank_monitor.py python -m dualmode._rank_wrapper --log_dir DIR [--echo_rank 0] --
script.py args``: the monitor runs this wrapper as its child).

It reads its rank from the MPI launcher (``PMI_RANK`` / ``OMPI_COMM_WORLD_RANK``; for a
worker of ``dualmode.run --ps``, which runs as its own one-rank MPI job, its worker id
``DM_PS_WORKER_RANK`` and the worker count ``DM_WORKER_NUM``), sets
``RANK_ID`` and ``RANK`` (the rank), ``RANK_SIZE`` and ``WORLD_SIZE`` (the world size),
``LOCAL_RANK`` (the rank's index on its node) and ``DEVICE_ID`` (the local rank, or the
rank's ``device_id`` in ``RANK_TABLE_FILE``), sends its stdout and stderr to
``DIR/worker_<rank>.log`` (the echo rank also to the terminal), initialises MPI and runs
the script as ``__main__``.

When the script raises (or exits with a non-zero code) the wrapper writes the traceback
to the log, prints one line ``[dualmode.run] rank R failed: <Type>: <message>`` on the
job's stderr (the launcher collects it, also from other machines) and into
``DIR/worker_<rank>.failed``, and calls
``MPI.COMM_WORLD.Abort``: MPICH's mpiexec then kills every other rank at once, including
ranks blocked in a collective (a rank that merely exits, even non-zero, is not enough:
the others would wait for it forever).

Supervision (when the launcher passes ``DM_RUN_STATE_DIR``): a thread writes this rank's
state to ``$DM_RUN_STATE_DIR/rank_<rank>`` every 0.25 s -- its pid, ``run`` / ``done``,
whether the main thread is blocked in an MPI collective, a progress counter (bumped
whenever the main thread's Python stack changed since the last look) and where the main
thread is. The launcher reads these files to end a job in which one rank exited while
others wait for it, or in which no rank made progress for ``--timeout`` seconds. SIGUSR1
writes every thread's Python stack to the log (:mod:`faulthandler`); so do fatal signals.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import runpy
import sys
import threading
import time
import traceback
from typing import List, Optional, Tuple

from .communication.rank_table import load_rank_table
from .ps.workers_world import RANK_VAR

FAIL_MARK = "[dualmode.run] rank "
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_LOCAL_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
#: environment variable naming the launcher's directory of per-rank state files
STATE_DIR_VAR = "DM_RUN_STATE_DIR"
_STATE_PERIOD = 0.25
#: the modules whose frames mean "blocked in an MPI collective" (the backend's, and the
#: parameter server workers' joining into one world)
_COLLECTIVE_FILES = (os.sep + os.path.join("communication", "mpi.py"),
                     os.sep + os.path.join("ps", "workers_world.py"))
#: the name of the backend's wait loop (``MPIBackend._complete`` in communication/mpi.py)
_WAIT_LOOP = "_complete"
#: a parameter server worker's id, set by ``dualmode.run --ps`` for the worker's own
#: one-rank MPI job (its rank among the workers instead of its MPI rank)
PS_WORKER_VAR = RANK_VAR


def _env_first(names, default: Optional[str] = None) -> Optional[str]:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return default


def _identity() -> Tuple[int, int, int]:
    """(rank, size, local rank) from the MPI launcher's environment (for a parameter
    server worker of ``dualmode.run --ps``: its worker id and the worker count)."""
    if os.environ.get(PS_WORKER_VAR):
        rank = int(os.environ[PS_WORKER_VAR])
        return rank, int(os.environ["DM_WORKER_NUM"]), rank
    rank = _env_first(_RANK_VARS)
    size = _env_first(_SIZE_VARS)
    if rank is None or size is None:
        raise RuntimeError("dualmode._rank_wrapper: PMI_RANK/PMI_SIZE are not set; this "
                           "module is started by python -m dualmode.run through mpiexec")
    return int(rank), int(size), int(_env_first(_LOCAL_VARS, rank))


class _Tee:
    """Copy everything written to fd ``fd`` into the log and the original ``fd``."""

    def __init__(self, fd: int, log_fd: int):
        self.original = os.dup(fd)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self.log_fd = log_fd
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()

    def _pump(self, read: int) -> None:
        # the log gets whole lines only, so stdout and stderr lines do not interleave
        pending = b""
        while True:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            os.write(self.original, chunk)
            pending += chunk
            cut = pending.rfind(b"\n") + 1
            if cut:
                os.write(self.log_fd, pending[:cut])
                pending = pending[cut:]
        if pending:
            os.write(self.log_fd, pending)
        os.close(read)


class _Output:
    """This rank's stdout/stderr: to the log file, and for the echo rank also echoed."""

    def __init__(self, log_path: str, echo: bool):
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                              0o644)
        self.err = os.dup(2)                    # the job's stderr, for the failure line
        self.tees: List[_Tee] = []
        if echo:
            self.tees = [_Tee(1, self.log_fd), _Tee(2, self.log_fd)]
        else:
            os.dup2(self.log_fd, 1)
            os.dup2(self.log_fd, 2)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)

    def close(self) -> None:
        """Flush, end the echo (later output goes to the log only) and wait for it."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if self.tees:
            os.dup2(self.log_fd, 1)
            os.dup2(self.log_fd, 2)
            for tee in self.tees:
                tee.thread.join(timeout=5)
            self.tees = []

    def report(self, line: str, status_path: str) -> None:
        """Write ``line`` to the log, to ``status_path`` (read by a launcher on this
        machine) and to the job's stderr (forwarded by mpiexec from any machine)."""
        data = (line + "\n").encode("utf-8", "replace")
        os.write(self.log_fd, data)
        with open(status_path, "wb") as fh:
            fh.write(data)
        os.write(self.err, data)


def read_state(path: str) -> Optional[Tuple[int, str, bool, int, str]]:
    """``(pid, status, in_collective, progress, where)`` from a state file, or None when
    it is missing or being replaced."""
    try:
        with open(path, encoding="utf-8") as fh:
            words = fh.read().split(" ", 4)
        return (int(words[0]), words[1], words[2] == "1", int(words[3]),
                words[4].strip())
    except (OSError, ValueError, IndexError):
        return None


class _StateWriter:
    """Publish this rank's state for the launcher (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        self.main = threading.main_thread().ident
        self.status = "run"
        self.progress = 0
        self.last = None
        self.stop = threading.Event()
        self.write()
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name="dualmode-rank-state")
        self.thread.start()

    def _look(self) -> Tuple[tuple, bool, str]:
        """The main thread's stack signature, whether it is in a collective, and where."""
        frame = sys._current_frames().get(self.main)
        sig = []
        in_coll = False
        where = "?"
        top = True
        while frame is not None:
            code = frame.f_code
            if code.co_name == _WAIT_LOOP and code.co_filename.endswith(_COLLECTIVE_FILES):
                # the backend's wait loop polls (its lines change): it and what it calls
                # are not progress; the collective that waits is its caller
                sig, in_coll, where, top = [], False, "?", True
                frame = frame.f_back
                continue
            sig.append((id(code), frame.f_lineno))
            if top:
                where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
                top = False
            if not in_coll and code.co_filename.endswith(_COLLECTIVE_FILES):
                in_coll = True
                where = f"the MPI collective {code.co_name.lstrip('_')}"
            frame = frame.f_back
        return tuple(sig), in_coll, where

    def write(self, in_coll: bool = False, where: str = "starting") -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()} {self.status} {int(in_coll)} {self.progress} {where}\n")
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self.stop.wait(_STATE_PERIOD):
            sig, in_coll, where = self._look()
            if sig != self.last:
                self.last = sig
                self.progress += 1
            try:
                self.write(in_coll, where)
            except OSError:             # the launcher removed the directory: it is over
                return

    def finish(self, status: str) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        self.status = status
        self.progress += 1
        try:
            self.write(False, "exited")
        except OSError:
            pass


def _summary(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: exit code {exc.code!r}"
    text = " ".join(str(exc).split())
    if len(text) > 500:
        text = text[:500] + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _device_id(rank: int, local: int) -> int:
    path = os.environ.get("RANK_TABLE_FILE")
    if not path:
        return local
    table = load_rank_table(path, "RANK_TABLE_FILE")
    flat = [d for ids in table.device_ids for d in ids]
    return flat[rank] if rank < len(flat) else local


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dualmode._rank_wrapper")
    parser.add_argument("--log_dir", required=True)
    parser.add_argument("--echo_rank", type=int, default=0)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    rank, size, local = _identity()
    os.makedirs(ns.log_dir, exist_ok=True)
    out = _Output(os.path.join(ns.log_dir, f"worker_{rank}.log"), rank == ns.echo_rank)
    # every thread's stack to the log on SIGUSR1 (the launcher's --timeout) and on crashes
    stacks = os.fdopen(os.dup(out.log_fd), "w")
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    state = None
    state_dir = os.environ.get(STATE_DIR_VAR)
    if state_dir and os.path.isdir(state_dir):
        state = _StateWriter(os.path.join(state_dir, f"rank_{rank}"))
    mpi = None
    try:
        try:
            from mpi4py import MPI as mpi     # initialise MPI first: Abort needs it
        except ImportError:
            mpi = None
        os.environ["RANK_ID"] = os.environ["RANK"] = str(rank)
        os.environ["RANK_SIZE"] = os.environ["WORLD_SIZE"] = str(size)
        os.environ["LOCAL_RANK"] = str(local)
        os.environ["DEVICE_ID"] = str(_device_id(rank, local))
        script = os.path.abspath(ns.script)
        sys.argv = [ns.script] + list(ns.args)
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
    except BaseException as exc:            # noqa: BLE001 -- every failure ends the job
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            if state is not None:
                state.finish("done")
            out.close()
            return
        if state is not None:
            state.finish("failed")
        traceback.print_exc()
        out.close()
        out.report(f"{FAIL_MARK}{rank} failed: {_summary(exc)}",
                   os.path.join(ns.log_dir, f"worker_{rank}.failed"))
        time.sleep(0.2)                     # let mpiexec forward the line before the abort
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(1)
        os._exit(1)
    if state is not None:
        state.finish("done")
    out.close()


if __name__ == "__main__":
    main()
