"""Launch a script as N ranks with backend "mpi": ``python -m dualmode.run``.

::

    python -m dualmode.run --worker_num 4 [--log_dir DIR] [--timeout S] train.py args...
    # several machines (run on each; node 0 starts the job):
    python -m dualmode.run --nproc_per_node 4 --nnodes 2 --node_rank R \\
        --master_addr HOST0 --master_port 29500 train.py args...
    # Kubernetes manifests of the same job instead of running it:
    python -m dualmode.run --k8s mpijob|ps [--image IMG] ... train.py args...

The ranks are started by MPICH's ``mpiexec`` (from the ``mpich`` wheel, found beside
``sys.executable``: no PATH set-up), each by :mod:`dualmode._rank_monitor` (which
records how and when its rank ended, so the first rank to fail is the one named)
through :mod:`dualmode._rank_wrapper`, which
sets ``RANK_ID``/``RANK``, ``RANK_SIZE``/``WORLD_SIZE``, ``LOCAL_RANK`` and
``DEVICE_ID``, writes ``DIR/worker_<rank>.log`` (default ``log_output/``) and echoes rank
0 to this terminal.

Supervision: a rank that raises aborts the job itself (its wrapper prints ``rank R
failed: <Type>: <message>`` and calls ``MPI_Abort``). Everything else the launcher sees
through the ranks' state files and mpiexec's report, and it ends the job (mpiexec and
every rank, in their own process group) with status 1 and one line naming the rank: a
rank killed by a signal (named), a rank that exited without a traceback, a rank that
exited while the others wait for it in a collective, no progress for ``--timeout``
seconds (every rank's Python stack written to its log first), SIGINT/SIGTERM to the
launcher. Nothing is left running.

Machines: ``--nnodes K`` with ``--node_rank/--master_addr/--master_port`` (node 0 waits
for the others on ``master_addr:master_port``, writes a hostfile of the addresses they
connected from and runs mpiexec, which starts the remote ranks over ssh; the other nodes
wait and exit with the job's status), or ``--hostfile FILE`` (MPICH's format,
``host:slots`` per line), or a ``RANK_TABLE_FILE`` whose ``server_list`` names several
servers; the remote hosts of a hostfile or rank table must answer ssh within
``--ssh_timeout`` seconds, else the launcher names the host before starting anything.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ._rank_monitor import rank_command, read_record
from ._rank_wrapper import FAIL_MARK, STATE_DIR_VAR, read_state
from . import k8s
from .communication.rank_table import RankTable, load_rank_table
from .ps.launch import launch_ps

__all__ = ["main", "build_command", "parse_args", "LaunchConfig"]

_PREFIX = "dualmode.run"


@dataclass(frozen=True)
class LaunchConfig:
    """The validated command line."""

    worker_num: int
    log_dir: str
    nnodes: int
    node_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    hostfile: Optional[str]
    rank_table: Optional[RankTable]
    rdzv_timeout: float
    mpiexec: str
    script: str
    args: Tuple[str, ...]
    ps: bool = False
    server_num: int = 0
    timeout: Optional[float] = None
    ssh_timeout: float = 10.0
    k8s: Optional[str] = None
    image: Optional[str] = None


class _Parser(argparse.ArgumentParser):
    def error(self, message):              # argparse's own errors, with our prefix
        self.print_usage(sys.stderr)
        self.exit(2, f"{_PREFIX}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dualmode.run", allow_abbrev=False,
                description="Run a dualmode script as N MPI ranks (backend 'mpi').")
    p.add_argument("--worker_num", type=int, default=None,
                   help="ranks in the job (all machines); default: the devices of "
                        "RANK_TABLE_FILE")
    p.add_argument("--nproc_per_node", type=int, default=None,
                   help="ranks on each machine (torchrun's spelling): --worker_num is "
                        "nproc_per_node * nnodes")
    p.add_argument("--timeout", type=float, default=None,
                   help="end the job when no rank made progress for this many seconds, "
                        "with every rank's Python stack in its log")
    p.add_argument("--log_dir", default="log_output",
                   help="directory of the per-rank logs worker_<rank>.log")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    p.add_argument("--node_rank", type=int, default=0, help="this machine's index")
    p.add_argument("--master_addr", default=None, help="address of node 0")
    p.add_argument("--master_port", type=int, default=None, help="port node 0 listens on")
    p.add_argument("--hostfile", default=None,
                   help="MPICH hostfile (host:slots per line) for a job over several "
                        "machines started from this one")
    p.add_argument("--rdzv_timeout", type=float, default=120.0,
                   help="seconds node 0 waits for the other nodes (and they for it)")
    p.add_argument("--ssh_timeout", type=float, default=10.0,
                   help="seconds to wait for ssh to reach each remote host of a hostfile "
                        "or rank table before anything starts (default 10)")
    p.add_argument("--mpiexec", default=None,
                   help="the mpiexec to use; default: the mpich wheel's, beside this "
                        "Python (no PATH set-up needed), else the one on PATH")
    p.add_argument("--ps", action="store_true",
                   help="parameter server mode: a scheduler, --server_num servers and "
                        "--worker_num workers (logs scheduler.log, server_<i>.log, "
                        "worker_<i>.log)")
    p.add_argument("--server_num", type=int, default=None,
                   help="servers of a --ps job")
    p.add_argument("--k8s", default=None,
                   help="print Kubernetes manifests for the job instead of running it: "
                        "'mpijob' (kubeflow MPI operator) or 'ps' (parameter server roles)")
    p.add_argument("--image", default=None,
                   help="container image of the --k8s manifests (default "
                        f"{k8s.DEFAULT_IMAGE!r}); it must hold dualmode and the script (for "
                        "mpijob also the mpi extra and an ssh server)")
    p.add_argument("script", help="the Python script to run on every rank")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def _find_mpiexec(given: Optional[str]) -> str:
    """``--mpiexec``, else the mpiexec installed beside this Python (the mpich wheel puts
    it in the environment's scripts directory, which need not be on PATH when the venv's
    python is called directly), else the one on PATH."""
    if given:
        path = shutil.which(given)
        if path is None:
            raise RuntimeError(f"{_PREFIX}: --mpiexec={given!r} was not found (not an "
                               "executable file, nor a command on PATH)")
        return path
    places = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    for place in places:
        path = shutil.which("mpiexec", path=place) if place else None
        if path is not None:
            return path
    path = shutil.which("mpiexec")
    if path is None:
        raise RuntimeError(f"{_PREFIX}: mpiexec was not found beside {sys.executable} (in "
                           f"{', '.join(sorted(set(p for p in places if p)))}) nor on PATH; "
                           "install MPICH with pip install 'dualmode[mpi]' (the mpich and "
                           "mpi4py wheels), or give --mpiexec PATH")
    return path


def parse_args(argv: Optional[Sequence[str]] = None) -> LaunchConfig:
    """Parse and validate the command line (ValueError naming the flag)."""
    ns = _parser().parse_args(argv)
    table = None
    table_path = os.environ.get("RANK_TABLE_FILE")
    if table_path:
        table = load_rank_table(table_path, "RANK_TABLE_FILE")
    worker_num = ns.worker_num
    if ns.nproc_per_node is not None:
        if ns.nproc_per_node < 1:
            raise ValueError(f"{_PREFIX}: --nproc_per_node={ns.nproc_per_node} is not valid; "
                             "expected an int >= 1")
        total = ns.nproc_per_node * max(ns.nnodes, 1)
        if worker_num is not None and worker_num != total:
            raise ValueError(f"{_PREFIX}: --worker_num={worker_num} contradicts "
                             f"--nproc_per_node={ns.nproc_per_node} with --nnodes={ns.nnodes} "
                             f"({total} ranks); give one of them")
        worker_num = total
    if ns.timeout is not None and not 0 < ns.timeout < float("inf"):
        raise ValueError(f"{_PREFIX}: --timeout={ns.timeout} is not valid; expected a number "
                         "of seconds > 0")
    if ns.k8s is not None and ns.k8s not in ("mpijob", "ps"):
        raise ValueError(f"{_PREFIX}: --k8s={ns.k8s!r} is not valid; expected 'mpijob' or 'ps'")
    if worker_num is None:
        if table is None:
            raise ValueError(f"{_PREFIX}: --worker_num is required (the number of ranks), "
                             "unless RANK_TABLE_FILE lists the devices")
        worker_num = table.world_size
    if worker_num < 1:
        raise ValueError(f"{_PREFIX}: --worker_num={worker_num} is not valid; expected an "
                         "int >= 1")
    if table is not None and table.world_size != worker_num:
        raise ValueError(f"{_PREFIX}: --worker_num={worker_num} does not match the "
                         f"{table.world_size} devices of RANK_TABLE_FILE={table_path!r}")
    if ns.nnodes < 1:
        raise ValueError(f"{_PREFIX}: --nnodes={ns.nnodes} is not valid; expected an int >= 1")
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ValueError(f"{_PREFIX}: --node_rank={ns.node_rank} is out of range for "
                         f"--nnodes={ns.nnodes}; expected 0 <= node_rank < {ns.nnodes}")
    if ns.nnodes > 1:
        if not ns.master_addr:
            raise ValueError(f"{_PREFIX}: --nnodes={ns.nnodes} needs --master_addr (the "
                             "address of node 0)")
        if ns.master_port is None or not 1 <= ns.master_port <= 65535:
            raise ValueError(f"{_PREFIX}: --nnodes={ns.nnodes} needs --master_port, an int "
                             f"in [1, 65535]; got {ns.master_port!r}")
        if worker_num % ns.nnodes:
            raise ValueError(f"{_PREFIX}: --worker_num={worker_num} is not divisible by "
                             f"--nnodes={ns.nnodes}; every node runs the same number of "
                             "ranks")
        if ns.hostfile or (table is not None and table.server_count > 1):
            raise ValueError(f"{_PREFIX}: --nnodes={ns.nnodes} finds the hosts itself; do "
                             "not combine it with --hostfile or a multi-server "
                             "RANK_TABLE_FILE (run those from one machine with --nnodes 1)")
    elif ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        raise ValueError(f"{_PREFIX}: --master_port={ns.master_port} is not valid; expected "
                         "an int in [1, 65535]")
    ps = ns.ps or ns.k8s == "ps"
    if ps:
        if ns.server_num is None or ns.server_num < 1:
            raise ValueError(f"{_PREFIX}: --ps needs --server_num, an int >= 1; got "
                             f"{ns.server_num!r}")
        if ns.nnodes > 1 or ns.hostfile:
            raise ValueError(f"{_PREFIX}: --ps starts every role on this machine; "
                             f"--nnodes={ns.nnodes} and --hostfile are not supported with it "
                             "(on several machines start the roles with the DM_* / MS_* "
                             "variables, see docs/parameter_server.md)")
    elif ns.server_num is not None:
        raise ValueError(f"{_PREFIX}: --server_num={ns.server_num} needs --ps")
    if ns.hostfile and not os.path.isfile(ns.hostfile):
        raise ValueError(f"{_PREFIX}: --hostfile={ns.hostfile!r} does not exist")
    if not 0 < ns.ssh_timeout < float("inf"):
        raise ValueError(f"{_PREFIX}: --ssh_timeout={ns.ssh_timeout} is not valid; expected a "
                         "number of seconds > 0")
    if ns.rdzv_timeout <= 0:
        raise ValueError(f"{_PREFIX}: --rdzv_timeout={ns.rdzv_timeout} is not valid; expected "
                         "a number of seconds > 0")
    args = list(ns.args)
    if args and args[0] == "--":
        args = args[1:]
    if ns.k8s is not None:      # manifests: the script runs in the container, not here
        return LaunchConfig(worker_num, ns.log_dir, ns.nnodes, ns.node_rank, ns.master_addr,
                            ns.master_port, ns.hostfile, table, ns.rdzv_timeout, "mpiexec",
                            ns.script, tuple(args), ps, ns.server_num or 0,
                            ns.timeout, ns.ssh_timeout, ns.k8s, ns.image)
    if not os.path.isfile(ns.script):
        raise ValueError(f"{_PREFIX}: script {ns.script!r} does not exist")
    return LaunchConfig(worker_num, os.path.abspath(ns.log_dir), ns.nnodes, ns.node_rank,
                        ns.master_addr, ns.master_port, ns.hostfile, table,
                        ns.rdzv_timeout, _find_mpiexec(ns.mpiexec),
                        os.path.abspath(ns.script), tuple(args), bool(ns.ps),
                        ns.server_num or 0, ns.timeout, ns.ssh_timeout)


def build_command(cfg: LaunchConfig, hostfile: Optional[str] = None) -> List[str]:
    """The mpiexec command line of the job (``hostfile`` overrides ``cfg.hostfile``)."""
    cmd = [cfg.mpiexec, "-print-all-exitcodes"]      # each rank's status, for _Job.killed
    hostfile = hostfile or cfg.hostfile
    if hostfile:
        cmd += ["-f", hostfile]
    cmd += ["-n", str(cfg.worker_num), *rank_command(cfg.log_dir, cfg.script, cfg.args)]
    return cmd


def _write_hostfile(cfg: LaunchConfig, hosts: Sequence[Tuple[str, int]]) -> str:
    os.makedirs(cfg.log_dir, exist_ok=True)
    path = os.path.join(cfg.log_dir, "hostfile")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("".join(f"{h}:{n}\n" for h, n in hosts))
    return path


def _read_hostfile(path: str) -> List[str]:
    hosts = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                hosts.append(line.split(":", 1)[0].strip())
    return hosts


def _is_local(host: str) -> bool:
    """Whether ``host`` names this machine (mpiexec starts its ranks without ssh)."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        raise ValueError(f"{_PREFIX}: host {host!r} (hostfile or RANK_TABLE_FILE) cannot be "
                         "resolved; expected a host name or address of a machine of the "
                         "job") from None
    mine = set()
    for name in names:
        try:
            mine |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return all(a.startswith("127.") or a == "::1" or a in mine for a in addrs)


def check_hosts(hosts: Sequence[str], timeout: float) -> None:
    """Every remote host answers ssh within ``timeout`` seconds (all tried at once), else
    RuntimeError naming the first that did not; no ssh process is left behind."""
    remote = [h for h in dict.fromkeys(hosts) if not _is_local(h)]
    if not remote:
        return
    ssh = shutil.which("ssh")
    if ssh is None:
        raise RuntimeError(f"{_PREFIX}: host {remote[0]!r} is another machine, which mpiexec "
                           "reaches over ssh, but ssh is not installed here")
    procs = {h: subprocess.Popen([ssh, "-o", "BatchMode=yes", "-o",
                                  f"ConnectTimeout={max(1, int(timeout))}", h, "true"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True)
             for h in remote}
    deadline = time.monotonic() + timeout
    bad = None
    try:
        for host, p in procs.items():
            try:
                code = p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                bad = (host, f"no answer within --ssh_timeout={timeout:g} s")
                break
            if code != 0:
                why = p.stderr.read().decode("utf-8", "replace").strip().splitlines()
                bad = (host, why[-1] if why else f"ssh exit code {code}")
                break
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            p.stderr.close()
    if bad is not None:
        raise RuntimeError(f"{_PREFIX}: host {bad[0]!r} cannot be reached over ssh ({bad[1]}); "
                           "mpiexec starts the ranks of other machines over passwordless "
                           "ssh: check the host name, the network and the ssh keys")


# ------------------------------------------------------------------ the job


def threads_per_rank(worker_num: int, nnodes: int = 1) -> int:
    """BLAS/OpenMP threads for each rank when the user set none: this machine's cores
    shared by its ranks (at least 1). numpy's BLAS otherwise starts one thread per core
    in every rank, and ranks oversubscribing the cores run their GEMMs ~10x slower."""
    ranks_here = max(1, -(-worker_num // max(nnodes, 1)))
    return max(1, (os.cpu_count() or 1) // ranks_here)


_HYDRA_PID = re.compile(r"^=\s+PID (\d+) RUNNING AT (\S+)")
_HYDRA_CODE = re.compile(r"^=\s+EXIT CODE: (-?\d+)")
_HYDRA_SIGNAL = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")
_HYDRA_CODES = re.compile(r"^\[mpiexec@[^\]]*\] Exit codes: (.*)$")
_HYDRA_BANNER = ("=====", "=   ", "YOUR APPLICATION TERMINATED", "This typically refers",
                 "Please see the FAQ", "\n")
#: seconds a rank may wait in a collective after another rank exited before the job ends
EXIT_GRACE = 2.0


def _signal_name(num: int) -> str:
    try:
        return f"signal {num} ({signal.Signals(num).name})"
    except ValueError:
        return f"signal {num}"


class _Job:
    """mpiexec and its ranks, supervised.

    mpiexec runs in its own session, so the whole job (mpiexec, its proxies and the
    ranks on this machine) is one process group that can be ended at once. A monitor
    reads the ranks' state files (written by :mod:`dualmode._rank_wrapper`) and ends the
    job when a rank exited while another waits for it in a collective, or when no rank
    made progress for ``--timeout`` seconds (after asking every rank for its stack).
    """

    def __init__(self, cmd: List[str], cfg: LaunchConfig):
        self.cfg = cfg
        self.failures: List[str] = []
        self.verdict: Optional[str] = None          # why the launcher ended the job
        self.hydra: List[Tuple[int, str]] = []      # (pid, signal or exit text) from mpiexec
        self.states = {}                            # rank -> last state tuple
        self.deaths: List[int] = []                 # ranks gone without a last word
        self.statuses: List[int] = []               # wait status of each rank, by mpiexec
        #: (rank, wait status) of the earliest abnormal end its monitor recorded
        self.first: Optional[Tuple[int, int]] = None
        self.state_dir = tempfile.mkdtemp(prefix="dualmode_run_")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(cfg.worker_num, cfg.nnodes)))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"]
                                    if env.get("PYTHONPATH") else "")
        env[STATE_DIR_VAR] = self.state_dir
        # mpiexec's helpers (hydra_pmi_proxy) live beside it: PATH need not be set up
        env["PATH"] = os.path.dirname(cfg.mpiexec) + os.pathsep + env.get("PATH", "")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, start_new_session=True)
        self.pumps = [threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout),
                                       daemon=True),
                      threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr),
                                       daemon=True)]
        for t in self.pumps:
            t.start()

    # ------------------------------------------------------------ output

    def _pump(self, stream, out) -> None:
        pid = None
        for raw in stream:
            line = raw.decode("utf-8", "replace")
            if line.startswith(FAIL_MARK):
                self.failures.append("rank " + line[len(FAIL_MARK):].strip())
                continue
            if self.verdict is not None and line.startswith(_HYDRA_BANNER):
                continue            # mpiexec's view of the ranks the launcher just ended
            m = _HYDRA_CODES.match(line)
            if m:        # "[host] 0,768 [host2] 0,0": wait statuses, host by host in rank order
                self.statuses = [int(x) for x in re.findall(r"-?\d+", re.sub(
                    r"\[[^\]]*\]", " ", m.group(1)).replace(",", " "))]
                continue
            m = _HYDRA_PID.match(line)
            if m:
                pid = int(m.group(1))
            m = _HYDRA_CODE.match(line) or _HYDRA_SIGNAL.search(line)
            if m and pid is not None:
                self.hydra.append((pid, line))
            out.write(line)
            out.flush()

    # ------------------------------------------------------------ state

    def _read_states(self) -> None:
        for name in os.listdir(self.state_dir):
            if name.startswith("rank_") and name[5:].isdigit():
                st = read_state(os.path.join(self.state_dir, name))
                if st is not None:
                    self.states[int(name[5:])] = st

    def _rank_of_pid(self, pid: int) -> Optional[int]:
        for rank, st in self.states.items():
            if st[0] == pid:
                return rank
        return None

    def _watch(self) -> None:
        """Poll mpiexec and the ranks until the job ends or must be ended."""
        timeout = self.cfg.timeout
        seen = {}                        # rank -> (progress, since)
        first_seen = {}                  # (rank, status) of a monitor's record -> since
        exited_at = None
        last_progress = time.monotonic()
        tick = 0
        while self.proc.poll() is None:
            time.sleep(0.05)
            if len(self.states) < self.cfg.worker_num:
                self._read_states()     # until every rank of this machine is known
            self._note_deaths()
            tick += 1
            if tick % 5:
                continue
            self._read_states()
            now = time.monotonic()
            first = self.first_exit()
            if first is not None and now - first_seen.setdefault(first, now) >= EXIT_GRACE:
                # mpiexec did not end the job by itself: the launcher does
                self._end(_status_text(*first))
                return
            for rank, st in self.states.items():
                if seen.get(rank, (None,))[0] != st[3]:
                    seen[rank] = (st[3], now)
                    last_progress = now
            done = sorted(r for r, st in self.states.items() if st[1] == "done")
            waiting = sorted(r for r, st in self.states.items()
                             if st[1] == "run" and st[2] and now - seen[r][1] >= EXIT_GRACE)
            if done and exited_at is None:
                exited_at = now
            if done and waiting and now - exited_at >= EXIT_GRACE:
                self._end(f"rank {done[0]} exited (status 0) while rank "
                          f"{_ranks(waiting)} still wait(s) for it in "
                          f"{self.states[waiting[0]][4]}; a rank that leaves early must not "
                          "be followed by collectives on the others")
                return
            if timeout is not None and self.states and now - last_progress >= timeout:
                self._stacks()
                stuck = sorted(r for r, st in self.states.items()
                               if st[1] == "run" and not st[2])
                inside = sorted(r for r, st in self.states.items() if st[1] == "run" and st[2])
                parts = [f"rank {r} at {self.states[r][4]}" for r in stuck]
                if inside:
                    parts.append(f"rank {_ranks(inside)} waiting in "
                                 f"{self.states[inside[0]][4]}")
                self._end(f"no rank made progress for {timeout:g} s (--timeout): "
                          + "; ".join(parts or ["no rank reported"])
                          + "; every rank's Python stack is in its log")
                return

    def _note_deaths(self) -> None:
        """Ranks whose process is gone without the wrapper's final state, in the order
        they went (the first is the one that took the job down)."""
        for rank, st in self.states.items():
            if st[1] == "run" and rank not in self.deaths and not _pid_alive(st[0]):
                fresh = read_state(os.path.join(self.state_dir, f"rank_{rank}"))
                if fresh is not None and fresh[1] == "run":
                    self.deaths.append(rank)
                else:
                    self.states[rank] = fresh or st

    def _stacks(self) -> None:
        """Every local rank writes its Python stacks to its log (faulthandler)."""
        for st in self.states.values():
            if st[1] == "run":
                try:
                    os.kill(st[0], signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)

    def _end(self, verdict: Optional[str]) -> None:
        """Stop mpiexec and every rank on this machine; nothing is left running."""
        if verdict is not None and self.verdict is None:
            self.verdict = verdict
        self._read_states()
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                except OSError:
                    pass
            for st in self.states.values():       # ranks that left the group, if any
                if st[1] == "run":
                    try:
                        os.kill(st[0], sig)
                    except OSError:
                        pass
            try:
                self.proc.wait(timeout=wait)
                if sig == signal.SIGTERM:
                    time.sleep(0.2)
                if not self._alive():
                    break
            except subprocess.TimeoutExpired:
                pass

    def _alive(self) -> bool:
        return any(_pid_alive(st[0]) for st in self.states.values())

    # ------------------------------------------------------------ run

    def run(self) -> int:
        stopped = []

        def on_signal(num, frame):
            stopped.append(num)
            raise KeyboardInterrupt

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._watch()
            self.proc.wait()
        except KeyboardInterrupt:
            num = stopped[0] if stopped else signal.SIGINT
            self._end(f"stopped by {signal.Signals(num).name}: ended mpiexec and every rank")
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            if self.verdict is not None or self.proc.poll() is None:
                self._end(None)
            for t in self.pumps:
                t.join(timeout=5)
            self._read_states()
            self.first = self.first_exit()
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return self.proc.returncode

    def first_exit(self) -> Optional[Tuple[int, int]]:
        """``(rank, wait status)`` of the rank of this machine whose monitor recorded
        the earliest abnormal end (a signal, or a non-zero exit code), or None."""
        found = []
        for name in os.listdir(self.state_dir):
            if name.startswith("exit_") and name[5:].isdigit():
                rec = read_record(os.path.join(self.state_dir, name))
                if rec is not None and rec[0] != 0:
                    found.append((rec[1], int(name[5:]), rec[0]))
        if not found:
            return None
        _, rank, status = min(found)
        return rank, status

    def killed(self, rc: int) -> List[str]:
        """The rank that took the job down without a Python traceback, and how.

        mpiexec kills the other ranks at once, and neither its report nor its exit codes
        nor the order in which processes vanish reliably single out the first. Each
        rank's monitor (:mod:`dualmode._rank_monitor`) does: it records its rank's end
        before mpiexec can learn of it, so the earliest record is the first rank to
        fail. Without records (ranks of other machines): the one dead rank that was not
        in a collective, else the rank mpiexec's report names, else one with a non-zero
        status, else the first seen to go."""
        if self.first is not None:
            return [_status_text(*self.first)]
        banner, banner_signal = None, None
        for pid, line in self.hydra:
            rank = self._rank_of_pid(pid)
            m = _HYDRA_SIGNAL.search(line)
            if m:
                banner_signal = int(m.group(1))
            if banner is None and rank is not None:
                banner = rank
        st = self.statuses
        outside = [r for r, state in self.states.items() if state[1] == "run" and not state[2]]
        if len(outside) == 1:
            rank = outside[0]
        elif banner is not None:
            rank = banner
        else:
            bad = [r for r in range(len(st)) if st[r]] or list(self.deaths[:1])
            if not bad:
                return []
            rank = bad[0]
        status = st[rank] if rank < len(st) else 0
        if status & 0x7f:
            return [f"rank {rank} was killed by {_signal_name(status & 0x7f)}"]
        if status >> 8:
            return [f"rank {rank} exited with code {status >> 8} (without a Python "
                    "traceback)"]
        if banner_signal is not None:
            return [f"rank {rank} was killed by {_signal_name(banner_signal)}"]
        return [f"rank {rank} ended (mpiexec exit code {rc})"]


def _status_text(rank: int, status: int) -> str:
    """How rank `rank` ended, from its wait status (signal or exit code)."""
    if os.WIFSIGNALED(status):
        return f"rank {rank} was killed by {_signal_name(os.WTERMSIG(status))}"
    return f"rank {rank} exited with code {os.WEXITSTATUS(status)} (without a Python traceback)"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _run_job(cmd: List[str], cfg: LaunchConfig) -> Tuple[int, List[str], Optional[str]]:
    """Run mpiexec supervised; its exit code, the ranks' failure lines, and the reason
    the launcher ended the job (or why mpiexec did), if any."""
    os.makedirs(cfg.log_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(cfg.log_dir, "worker_*.failed")):
        os.remove(stale)
    job = _Job(cmd, cfg)
    rc = job.run()
    failures = list(job.failures)
    # lines mpiexec had no time to forward before the abort: the ranks' status files
    files = sorted(glob.glob(os.path.join(cfg.log_dir, "worker_*.failed")),
                   key=os.path.getmtime)
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            line = fh.readline().strip()
        if line.startswith(FAIL_MARK):
            line = "rank " + line[len(FAIL_MARK):]
            if line not in failures:
                failures.append(line)
    verdict = job.verdict
    if verdict is None and not failures and rc != 0:
        killed = job.killed(rc)
        if killed:
            verdict = killed[0] + (f" ({len(killed) - 1} other rank(s) ended with it)"
                                   if len(killed) > 1 else "")
    return rc, failures, verdict


def _report(rc: int, failures: List[str], cfg: LaunchConfig,
            verdict: Optional[str] = None) -> int:
    sys.stdout.flush()
    if verdict is not None and (not failures or verdict.startswith("stopped by")):
        sys.stderr.write(f"{_PREFIX}: {verdict}; logs in {cfg.log_dir}\n")
        return 1
    if failures:
        first = failures[0]
        rank = first.split()[1]
        log = os.path.join(cfg.log_dir, f"worker_{rank}.log")
        more = f" ({len(failures) - 1} other rank(s) failed too)" if len(failures) > 1 else ""
        sys.stderr.write(f"{_PREFIX}: {first}; traceback in {log}{more}\n")
        return 1
    if rc != 0:
        sys.stderr.write(f"{_PREFIX}: the job failed (mpiexec exit code {rc}) without a rank "
                         f"reporting an error; see the logs in {cfg.log_dir}\n")
        return rc if 0 < rc < 256 else 1
    return 0


# ----------------------------------------------------------- several machines


def _rendezvous_master(cfg: LaunchConfig) -> Tuple[List[Tuple[str, int]], list]:
    """Node 0: wait for the other nodes; their addresses and open connections."""
    per_node = cfg.worker_num // cfg.nnodes
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", cfg.master_port))
    except OSError as exc:
        raise RuntimeError(f"{_PREFIX}: node 0 cannot listen on --master_port="
                           f"{cfg.master_port} ({exc.strerror or exc})") from None
    server.listen(cfg.nnodes)
    deadline = time.monotonic() + cfg.rdzv_timeout
    joined = {}
    try:
        while len(joined) < cfg.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{_PREFIX}: only {len(joined)} of the {cfg.nnodes - 1} "
                                   f"other nodes joined {cfg.master_addr}:{cfg.master_port} "
                                   f"within --rdzv_timeout={cfg.rdzv_timeout:g} s (joined: "
                                   f"{sorted(joined) or 'none'})")
            server.settimeout(left)
            try:
                conn, addr = server.accept()
            except socket.timeout:
                continue
            conn.settimeout(10)
            words = conn.makefile("r").readline().split()
            if len(words) != 2 or words[0] != "JOIN" or not words[1].isdigit():
                conn.close()
                continue
            rank = int(words[1])
            if not 1 <= rank < cfg.nnodes or rank in joined:
                conn.sendall(f"EXIT 1 node_rank {rank} is out of range or taken\n".encode())
                conn.close()
                continue
            joined[rank] = (addr[0], conn)
    finally:
        server.close()
    hosts = [(cfg.master_addr, per_node)] + [(joined[r][0], per_node)
                                             for r in range(1, cfg.nnodes)]
    return hosts, [joined[r][1] for r in range(1, cfg.nnodes)]


def _follow_master(cfg: LaunchConfig) -> int:
    """Nodes 1..K-1: join node 0, then wait for the job's end and return its status."""
    deadline = time.monotonic() + cfg.rdzv_timeout
    while True:
        try:
            conn = socket.create_connection((cfg.master_addr, cfg.master_port), timeout=5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{_PREFIX}: node {cfg.node_rank} could not reach "
                                   f"--master_addr={cfg.master_addr} --master_port="
                                   f"{cfg.master_port} within --rdzv_timeout="
                                   f"{cfg.rdzv_timeout:g} s ({exc})") from None
            time.sleep(0.2)
    conn.sendall(f"JOIN {cfg.node_rank}\n".encode())
    conn.settimeout(None)
    print(f"{_PREFIX}: node {cfg.node_rank} joined {cfg.master_addr}:{cfg.master_port}; "
          f"node 0 starts the ranks over ssh; logs of this node's ranks go to {cfg.log_dir}",
          flush=True)
    line = conn.makefile("r").readline().split(maxsplit=2)
    conn.close()
    if len(line) >= 2 and line[0] == "EXIT" and line[1].lstrip("-").isdigit():
        if len(line) == 3:
            sys.stderr.write(f"{_PREFIX}: {line[2]}\n")
        return int(line[1])
    sys.stderr.write(f"{_PREFIX}: node {cfg.node_rank} lost node 0 before the job ended\n")
    return 1


def k8s_manifests(cfg: LaunchConfig) -> str:
    """The ``--k8s`` manifests of the job, as YAML."""
    if cfg.k8s == "mpijob":
        if cfg.nnodes > 1 or cfg.hostfile:
            raise ValueError(f"{_PREFIX}: --k8s mpijob places the ranks on worker pods itself; "
                             "do not give --nnodes or --hostfile with it")
        docs = k8s.mpijob_manifests(cfg.script, cfg.args, cfg.worker_num, cfg.image,
                                    timeout=cfg.timeout)
    else:
        docs = k8s.ps_manifests(cfg.script, cfg.args, cfg.server_num, cfg.worker_num,
                                cfg.image, port=cfg.master_port)
    return k8s.to_yaml(docs)


# -------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the job; the exit status (0, or non-zero naming the failed rank)."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Optional[Sequence[str]]) -> int:
    try:
        cfg = parse_args(argv)
        if cfg.k8s is not None:
            sys.stdout.write(k8s_manifests(cfg))
            return 0
        if cfg.ps:
            return launch_ps(cfg.script, cfg.args, cfg.server_num, cfg.worker_num,
                             cfg.log_dir, cfg.mpiexec, cfg.master_addr, cfg.master_port)
        if cfg.nnodes > 1 and cfg.node_rank > 0:
            return _follow_master(cfg)
        peers = []
        hostfile = None
        if cfg.nnodes > 1:
            hosts, peers = _rendezvous_master(cfg)
            hostfile = _write_hostfile(cfg, hosts)
        elif cfg.rank_table is not None and cfg.rank_table.server_count > 1:
            check_hosts(cfg.rank_table.hosts, cfg.ssh_timeout)
            hostfile = _write_hostfile(cfg, list(zip(cfg.rank_table.hosts,
                                                     cfg.rank_table.slots)))
        elif cfg.hostfile:
            check_hosts(_read_hostfile(cfg.hostfile), cfg.ssh_timeout)
    except (ValueError, RuntimeError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    rc, failures, verdict = _run_job(build_command(cfg, hostfile), cfg)
    status = _report(rc, failures, cfg, verdict)
    note = failures[0] if failures else (verdict or f"mpiexec exit code {rc}")
    for conn in peers:
        try:
            conn.sendall(f"EXIT {status} {note if status else 'ok'}\n".encode())
            conn.close()
        except OSError:
            pass
    return status


if __name__ == "__main__":
    sys.exit(main())
