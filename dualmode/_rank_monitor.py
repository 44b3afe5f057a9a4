"""The process mpiexec starts for each rank of ``python -m dualmode.run``: it runs the
rank as its child and records how and when it ended.

    python .../dualmode/_rank_monitor.py RANK_COMMAND...

Run by path, not as ``-m dualmode._rank_monitor``: it imports nothing of dualmode (nor
numpy), so it starts in a fraction of a second. The child inherits the environment and
the PMI connection (``PMI_FD``) and is the MPI process; this process keeps its own copy
of that connection open. So when the rank dies without finalizing MPI (a signal,
``os._exit``), mpiexec learns of it only when this monitor exits, after it wrote
``$DM_RUN_STATE_DIR/exit_<rank>``: ``<wait status> <CLOCK_MONOTONIC seconds>``. Every
other rank mpiexec then kills was ended by that cleanup, after the record; the launcher
names the rank with the earliest record, whatever mpiexec's banner says. The monitor
then ends as its rank did (the same exit code, or the same signal), so mpiexec's own
statuses are unchanged. Signals sent to the monitor (SIGINT, SIGTERM, SIGUSR1, ...)
are passed on to the rank; a monitor killed outright takes its rank with it
(``PR_SET_PDEATHSIG``).
"""
import os
import signal
import subprocess
import sys
import time

#: environment variable naming the launcher's directory of per-rank state files
STATE_DIR_VAR = "DM_RUN_STATE_DIR"
_RANK_VARS = ("DM_PS_WORKER_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
_FORWARD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2)


def rank_command(log_dir: str, script: str, args) -> list:
    """What mpiexec starts for each rank: this monitor (run by path) running the
    wrapper (logs, environment, failure report) running the script."""
    return [sys.executable, os.path.abspath(__file__), sys.executable, "-m",
            "dualmode._rank_wrapper", "--log_dir", log_dir, script, *args]


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the monitor dies (Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def record_path(state_dir: str, rank: str) -> str:
    return os.path.join(state_dir, f"exit_{rank}")


def read_record(path: str):
    """``(wait status, monotonic time)`` from an exit record, or None."""
    try:
        with open(path, encoding="ascii") as fh:
            status, when = fh.read().split()
        return int(status), float(when)
    except (OSError, ValueError):
        return None


def _write_record(state_dir: str, rank: str, status: int) -> None:
    path = record_path(state_dir, rank)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(f"{status} {time.monotonic():.6f}\n")
        os.replace(tmp, path)
    except OSError:                       # the launcher removed the directory: it is over
        pass


def main(argv) -> None:
    if not argv:
        sys.stderr.write("usage: python _rank_monitor.py COMMAND...\n")
        os._exit(2)
    rank = next((os.environ[v] for v in _RANK_VARS if os.environ.get(v)), "0")
    keep = []
    if os.environ.get("PMI_FD", "").isdigit():
        keep.append(int(os.environ["PMI_FD"]))
    child = subprocess.Popen(argv, pass_fds=keep, preexec_fn=_die_with_parent)

    def forward(num, frame):
        try:
            child.send_signal(num)
        except OSError:
            pass

    for sig in _FORWARD:
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(child.pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = 0
            break
    child.returncode = 0                  # reaped here; Popen must not wait again
    state_dir = os.environ.get(STATE_DIR_VAR)
    if state_dir and os.path.isdir(state_dir):
        _write_record(state_dir, rank, status)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        num = os.WTERMSIG(status)
        if num not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(num, signal.SIG_DFL)
        os.kill(os.getpid(), num)
        time.sleep(1)
        os._exit(128 + num)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
