"""Backend "mpi": one device per MPI rank (mpi4py over MPICH).

Launch the script with ``mpiexec -n N python train.py`` (or ``python -m dualmode.run
--worker_num N train.py``); ``init()`` then picks this backend. Each process holds one
device, its own rank, so a stack has shape ``(1, *buffer shape)`` and
``local_ranks == (rank,)``.

Every collective is one MPI collective on the raw, contiguous numpy buffer of this rank
(the capital-letter mpi4py methods; nothing is pickled), in its non-blocking form
(``Iallreduce`` for ``Allreduce``, ``Ibarrier`` for ``Barrier``, ...) completed by
:meth:`MPIBackend._complete`, a wait limited to ``DUALMODE_COMM_TIMEOUT`` seconds
(:func:`comm_timeout`; default 1800, ``0``/``none`` forever):

============== ===========================================================
collective     MPI call (on the group's sub-communicator)
============== ===========================================================
all_reduce     ``Allreduce`` (``algorithm="ring"`` too: MPI picks its algorithm)
fused buckets  AllReduce: the packed bucket reduced in node shared memory (ranks on one
               machine), else one ``Allreduce(IN_PLACE)`` on it; ReduceScatter: the
               parts packed part-major, each member reducing its block in node shared
               memory, else one ``Reduce_scatter_block(IN_PLACE)``; AllGather: each
               member writing its buffers into their places of the results in node
               shared memory, copied out at once, else one ``Allgather``; buffers
               from a pool (no fresh pages per call)
all_gather     ``Allgather``, then the parts concatenated along ``axis``
reduce_scatter ``Reduce_scatter_block`` on the parts moved to a leading axis
all_to_all     ``Alltoall`` on the parts moved to a leading axis
broadcast      ``Bcast``
reduce         ``Reduce``
scatter        ``Scatter``
gather         ``Gather`` (non-root ranks get zeros, as under "sim")
send_recv      one ``Alltoallv`` over the world (zero counts for ranks not in a pair)
============== ===========================================================

Group specs: the world group in rank order is ``COMM_WORLD``; any other spec gets a
sub-communicator made once with ``Comm.Split`` (color = the row of the group that holds
this rank, key = its position in the row, so group rank = member order) and cached by
value. A rank in no group calls ``Split`` with ``MPI.UNDEFINED`` and keeps its buffer.
Groups of one rank move nothing and make no communicator.

Reductions map ``sum``/``mean`` to ``MPI.SUM`` (``mean`` then divides by the group size,
as "sim" does), ``max``/``min``/``prod`` to ``MAX``/``MIN``/``PROD``, and on bool
buffers ``sum``/``max`` to ``LOR`` and ``min``/``prod`` to ``LAND`` (what numpy's ufuncs
compute on bools). Dtypes MPI cannot reduce (float16, long double, complex max/min,
non-native byte order) are gathered as bytes and reduced with numpy, in member order.

Integer results, max and min equal the "sim" backend's exactly; float sums may be added
in another order by MPI and agree within rounding (as ``algorithm="ring"`` under "sim").

Checks at construction, on every rank and before any communication, so a misconfigured
job fails with a named error instead of hanging: ``device_num`` (when set) and the
environment variables ``RANK_SIZE``, ``RANK_ID``, ``DEVICE_ID`` and ``RANK_TABLE_FILE``
(when set) must agree with the MPI world. A rank whose script raises an uncaught
exception aborts the whole job (``MPI.COMM_WORLD.Abort``) after printing its traceback,
so the other ranks never wait forever in a collective.

Waits: a rank that never arrives (it skipped a collective in a branch on the rank, a
pipeline stage that never sends) makes the others' wait end after the limit with a
RuntimeError naming the collective, its group's world ranks (or the peer and its
pipeline stage), this rank, the op it ran for (:func:`trace.current_cause`) and the
seconds waited; uncaught, it aborts the job as above. Blocking calls every member makes
that have no non-blocking form (``Comm.Split``, ``Split_type``, shared windows) are
preceded by a timed ``Ibarrier``; ``init()``'s first one waits at least 120 s (ranks
start at different times).
"""
from __future__ import annotations

import itertools
import os
import sys
import time
from collections import Counter
from typing import Dict, List, Optional, Tuple

import numpy as np

from .._core import _comm
from . import trace
from .backend import (Backend, _gathered, _parted, _split_shape, fusion_offsets,
                      register_backend)
from .groups import GroupPlan
from .rank_table import load_rank_table

__all__ = ["MPIBackend", "load_mpi"]

_UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
          "prod": np.multiply}
_RING_DTYPES = frozenset(np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64))
_LAUNCH_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_MAX_DEVICE_NUM = 4096
_FUSION_POOL = 8       # fusion buffers kept for reuse (MPIBackend._fusion_buffer)
_POOL_ONLY = 2         # sys.getrefcount(pool[k]) of a buffer only the pool holds
#: environment variable: seconds any wait of the backend may last (see comm_timeout)
TIMEOUT_VAR = "DUALMODE_COMM_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0
#: seconds init() waits at least for every rank to start (their imports and set-up take
#: different times; as MindSpore's HCCL_CONNECT_TIMEOUT beside HCCL_EXEC_TIMEOUT)
_START_TIMEOUT = 120.0
_YIELD_FOR = 0.05      # seconds of Test + sched_yield before a wait starts to sleep
#: the tests between two yields (4 x: as fast as a blocking call on 2 and 4 ranks of 2
#: cores; a yield after every test loses the core too often, 32 keep it from the peer)
_TESTS = range(4)
_NAP_MIN, _NAP_MAX = 1e-4, 1e-3    # its sleeps then: growing from _NAP_MIN to _NAP_MAX
#: the collective a barrier of node shared memory belongs to, by the method that runs it
_SHARED_KINDS = {"_shared_all_reduce": "fused AllReduce",
                 "_shared_reduce_scatter": "fused ReduceScatter",
                 "_shared_all_gather": "fused AllGather"}


def load_mpi():
    """The ``mpi4py.MPI`` module (importing it initialises MPI); RuntimeError naming what
    to install when mpi4py or its MPI library is missing."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError("init: the 'mpi' backend needs mpi4py and an MPI library; install "
                           "them with pip install 'dualmode[mpi]' (mpi4py and the mpich "
                           f"wheel); importing mpi4py failed: {exc}") from None
    return MPI


# --------------------------------------------------------------- buffer helpers


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """A uint8 view of a C-contiguous array (any dtype, any rank, also 0-d)."""
    return a.reshape(-1).view(np.uint8)


def _mine(stack: np.ndarray) -> np.ndarray:
    """This rank's buffer (``stack[0]``, also for 0-d buffers), C-contiguous; not a copy
    when it already is: do not write into it."""
    buf = stack[0, ...]
    return buf if buf.flags.c_contiguous else buf.copy()


def _parts(buf: np.ndarray, axis: int, n: int) -> np.ndarray:
    """(*local) -> (n, *local with local[axis] // n), C-contiguous: part j along ``axis``
    at index j."""
    shape = buf.shape
    y = buf.reshape(shape[:axis] + (n, shape[axis] // n) + shape[axis + 1:])
    return np.ascontiguousarray(np.moveaxis(y, axis, 0))


def _concat(parts: np.ndarray, axis: int) -> np.ndarray:
    """(n, *part) -> (*part with part[axis] * n): the parts concatenated along ``axis``."""
    n, part = parts.shape[0], parts.shape[1:]
    y = np.moveaxis(parts, 0, axis)
    return y.reshape(part[:axis] + (n * part[axis],) + part[axis + 1:])


def _pack_parts(stacks, axes, offsets, table: np.ndarray, n: int) -> None:
    """Pack the ``n`` parts of every stack's buffer (this rank's row) part-major into
    ``table`` (n, total): part ``j`` of stack ``i`` along ``axes[i]``, flattened, at
    ``table[j, offsets[i]:offsets[i + 1]]``. Stacks split along their first axis are
    copied with one ``_comm.pack`` (GIL released: their parts are the rows of a
    contiguous ``(n, chunk)`` view); the others with one numpy copy each."""
    rows, at = [], []
    for s, a, o, hi in zip(stacks, axes, offsets, offsets[1:]):
        local = s.shape[1:]
        if a == 0:
            rows.append(np.ascontiguousarray(s[0]).reshape(n, hi - o))
            at.append(o)
            continue
        slot = np.reshape(table[:, o:hi], (n,) + _parted(local, a, n), copy=False)
        slot[...] = np.moveaxis(s[0].reshape(_split_shape(local, a, n)), a, 0)
    if rows:
        _comm.pack(rows, table, at)


def _unpack_gathered(table: np.ndarray, stacks, axes, offsets, out: np.ndarray) -> list:
    """The AllGather results from ``table`` (n, total), row ``j`` member ``j``'s packed
    bucket (stack ``i`` at ``offsets[i]``), written into ``out`` (1, n * total), one
    after the other in stack order, each concatenated along its axis; returns the views
    ``(1, *gathered shape)``. Stacks gathered along their first axis are copied with one
    ``_comm.unpack`` (their result is the ``(n, size)`` slots one after the other); the
    others with one numpy copy each."""
    n = table.shape[0]
    res, rows, at = [], [], []
    for s, a, o, hi in zip(stacks, axes, offsets, offsets[1:]):
        local = s.shape[1:]
        dst = out[0, n * o:n * hi]
        res.append(dst.reshape((1,) + _gathered(local, a, n)))
        if a == 0:
            rows.append(dst.reshape(n, hi - o))
            at.append(o)
            continue
        # member j's buffer is part j along `a` of the gathered buffer
        slot = table[:, o:hi].reshape((n,) + local)
        dst.reshape(local[:a] + (n,) + local[a:])[...] = np.moveaxis(slot, 0, a)
    if rows:
        _comm.unpack(table, rows, at)
    return res


def _place_gathered(stacks, axes, offsets, dst: np.ndarray, j: int, n: int) -> None:
    """Write member ``j``'s buffers (``stacks``, this rank's row) where they belong in
    the AllGather results laid out as :func:`_unpack_gathered` lays them out: ``dst``
    (1, n * total) holds the results one after the other in stack order, stack ``i``'s
    concatenated along ``axes[i]`` at ``n * offsets[i]``. Stacks gathered along their
    first axis are written with one ``_comm.pack`` (member ``j``'s buffer is the ``j``-th
    of ``n`` contiguous slots); the others with one numpy copy each."""
    flat, at = [], []
    for s, a, o, hi in zip(stacks, axes, offsets, offsets[1:]):
        if a == 0:
            flat.append(np.ascontiguousarray(s))
            at.append(n * o + j * (hi - o))
            continue
        local = s.shape[1:]
        whole = dst[0, n * o:n * hi].reshape(local[:a] + (n,) + local[a:])
        whole[(slice(None),) * a + (j,)] = s[0]
    if flat:
        _comm.pack(flat, dst, at)


def _env_int(name: str, low: int, high: int) -> Optional[int]:
    """The int value of environment variable ``name`` in ``[low, high]``, None if unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"init: environment variable {name}={raw!r} is not valid; expected "
                         f"an int in [{low}, {high}]")
    return value


def comm_timeout(environ=None) -> Optional[float]:
    """The seconds a wait of the backend may last, from the environment variable
    ``DUALMODE_COMM_TIMEOUT`` (a float; default 1800), or None (``0``, ``none`` or
    ``inf``: wait forever). ValueError naming the variable for a negative value or one
    that is not a number."""
    raw = (os.environ if environ is None else environ).get(TIMEOUT_VAR)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT
    text = raw.strip().lower()
    if text == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:               # negative, or not a number (nan)
        raise ValueError(f"init: environment variable {TIMEOUT_VAR}={raw!r} is not valid; "
                         f"expected the seconds an MPI collective or receive may wait, a "
                         f"number >= 0 (0 or 'none': wait forever; unset: "
                         f"{DEFAULT_TIMEOUT:g})")
    return None if value == 0 or value == float("inf") else value


def _install_abort_hook(mpi) -> None:
    """Make an uncaught exception print its traceback, then abort the whole job."""
    previous = sys.excepthook
    if getattr(previous, "_dualmode_abort", False):
        return

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
            sys.stderr.flush()
            sys.stdout.flush()
            time.sleep(0.2)     # let mpiexec forward the traceback before the abort
        finally:
            mpi.COMM_WORLD.Abort(1)

    hook._dualmode_abort = True
    sys.excepthook = hook


class _NodeWindows:
    """The node shared memory of one communicator whose ranks share a machine, for the
    fused collectives: two input windows of ``n`` rows (``MPI.Win.Allocate_shared``,
    one contiguous row per member in member order, each ``capacity`` bytes) used in
    turn, and one result row of ``capacity`` bytes.

    Every shared collective packs into its row of the next input window
    (:meth:`next_input`), passes a barrier, then reads the rows. Using the two input
    windows in turn makes a trailing barrier unnecessary: a member writes window ``k``
    in collective ``t`` only after the first barrier of collective ``t - 1``, which
    every member entered after it had finished reading window ``k`` in collective
    ``t - 2``. (The result row, written only by AllReduce after its first barrier and
    read after its second, is safe the same way with one copy.) On a machine where
    barriers are costly -- ranks oversubscribing cores wait for the scheduler -- one
    barrier less per collective is a third of a 6 MB ReduceScatter's time.

    Collective: every member makes, uses and frees it in the same order."""

    def __init__(self, mpi, comm, nbytes: int):
        n = comm.Get_size()
        cap = -(-max(nbytes, 1) // 64) * 64          # rows start on cache lines
        self.capacity = cap
        self.wins, self.rows = [], []
        for _ in range(2):
            win = mpi.Win.Allocate_shared(cap, 1, comm=comm)
            base = win.Shared_query(0)[0].address
            for r in range(n):
                if win.Shared_query(r)[0].address != base + r * cap:
                    raise RuntimeError(f"fused collectives: MPI placed the shared window's "
                                       f"rows apart (rank {r}); expected contiguous rows")
            win.Lock_all()
            self.wins.append(win)
            self.rows.append(np.frombuffer(mpi.buffer.fromaddress(base, n * cap),
                                           np.uint8).reshape(n, cap))
        self.result_win = mpi.Win.Allocate_shared(cap if comm.Get_rank() == 0 else 0, 1,
                                                  comm=comm)
        self.result_win.Lock_all()
        self.result = np.frombuffer(self.result_win.Shared_query(0)[0], np.uint8)
        self._turn = 0

    def next_input(self):
        """The input window of this collective and its rows ``(n, capacity)`` uint8."""
        k = self._turn
        self._turn = 1 - k
        return self.wins[k], self.rows[k]

    def free(self) -> None:
        """Unlock and free the windows (collective)."""
        for win in self.wins + [self.result_win]:
            win.Unlock_all()
            win.Free()
        self.wins, self.rows = [], []


class _Arrival:
    """A pickled message from ``src`` with ``tag`` on ``comm``, as a request: ``Test()``
    is True once it has arrived (a matched probe), then ``message`` receives it."""

    __slots__ = ("comm", "src", "tag", "message")

    def __init__(self, comm, src: int, tag: int):
        self.comm, self.src, self.tag, self.message = comm, src, tag, None

    def Test(self) -> bool:                                   # noqa: N802 -- mpi4py's name
        if self.message is None:
            self.message = self.comm.improbe(source=self.src, tag=self.tag)
        return self.message is not None

    def Wait(self) -> None:                                   # noqa: N802
        if self.message is None:
            self.message = self.comm.mprobe(source=self.src, tag=self.tag)


# ---------------------------------------------------------------------- backend


class MPIBackend(Backend):
    """One device per MPI rank; stacks have shape ``(1, *buffer shape)``.

    Parameters
    ----------
    device_num : int or None
        The configured device count (``set_auto_parallel_context(device_num=...)``);
        None takes the MPI world size. A value that differs from the world size is a
        ValueError naming both.
    comm : mpi4py communicator or None
        The world of the job; default ``MPI.COMM_WORLD``.

    Attributes
    ----------
    device_id : int
        ``DEVICE_ID`` when set, else this rank's index among the ranks of its node.
    node_ids : ndarray (world_size,), int64
        For each rank, the lowest world rank on the same node (ranks on one node share it).
    mpi_calls : dict
        How many times each MPI function was called by this backend (for tests and
        benchmarks: a fused bucket is one ``Allreduce``).
    timeout : float or None
        The seconds any collective, receive or barrier of this backend may wait for the
        other ranks (``DUALMODE_COMM_TIMEOUT``, read at construction; None: forever).
        Past it the wait raises a RuntimeError that names the collective, its ranks,
        this rank and the op it was run for.
    """

    name = "mpi"
    all_reduce_algorithms = ("direct", "ring")

    def __init__(self, device_num: Optional[int] = None, comm=None, _stage_of=None):
        mpi = load_mpi()
        self._mpi = mpi
        self._comm = mpi.COMM_WORLD if comm is None else comm
        size, rank = self._comm.Get_size(), self._comm.Get_rank()
        if _stage_of is None:        # a pipeline stage's view: its world was checked
            self._check_environment(device_num, size, rank)
            self.timeout = comm_timeout()
        else:
            self.timeout = _stage_of.timeout
        # the job's world (a stage's view: its world's), for the ranks an error names
        self._job_comm = self._comm if _stage_of is None else _stage_of._job_comm
        super().__init__(size, (rank,))
        self._rank = rank
        self._calls: Counter = Counter()
        self._subs: Dict[tuple, Tuple[object, int]] = {}
        self._fusion_pool: List[np.ndarray] = []
        self._node_local_comms: Dict[int, bool] = {}
        self._shared: Dict[int, _NodeWindows] = {}
        if size > 1:
            _install_abort_hook(mpi)
        self.node_ids = self._find_nodes()
        on_node = np.flatnonzero(self.node_ids == self.node_ids[rank])
        local_rank = int(np.searchsorted(on_node, rank))
        env_device = _env_int("DEVICE_ID", 0, _MAX_DEVICE_NUM - 1)
        self.device_id = local_rank if env_device is None else env_device

    # ------------------------------------------------------------ set-up

    @staticmethod
    def _check_environment(device_num, size: int, rank: int) -> None:
        for var in _LAUNCH_SIZE_VARS:
            raw = os.environ.get(var)
            if raw and raw.strip().isdigit() and int(raw) != size:
                raise RuntimeError(f"init: environment variable {var}={raw} says the job has "
                                   f"{raw} ranks, but MPI.COMM_WORLD has {size}; start the "
                                   f"script with mpiexec -n {raw} (from the same MPI as "
                                   "mpi4py) or unset it")
        if device_num is not None and device_num != size:
            raise ValueError(f"init: device_num={device_num} (set_auto_parallel_context) does "
                             f"not match the MPI world size {size} (mpiexec -n {size}); set "
                             f"device_num={size}, leave it unset, or launch {device_num} ranks")
        env_size = _env_int("RANK_SIZE", 1, _MAX_DEVICE_NUM)
        if env_size is not None and env_size != size:
            raise ValueError(f"init: environment variable RANK_SIZE={env_size} does not match "
                             f"the MPI world size {size}; expected RANK_SIZE={size} or unset")
        env_rank = _env_int("RANK_ID", 0, _MAX_DEVICE_NUM - 1)
        if env_rank is not None and env_rank != rank:
            raise ValueError(f"init: environment variable RANK_ID={env_rank} does not match "
                             f"this process's MPI rank {rank}; expected RANK_ID={rank} or unset")
        path = os.environ.get("RANK_TABLE_FILE")
        if path:
            table = load_rank_table(path, "RANK_TABLE_FILE")
            if table.world_size != size:
                raise ValueError(f"init: rank table RANK_TABLE_FILE={path!r} lists "
                                 f"{table.world_size} devices, but the MPI world size is "
                                 f"{size}; launch {table.world_size} ranks or fix the table")

    def _find_nodes(self) -> np.ndarray:
        """For each rank, the lowest world rank on its node (two small collectives)."""
        mpi = self._mpi
        if self.world_size == 1:
            return np.zeros(1, dtype=np.int64)
        self._arrive(self._comm, "init (every rank's init())", _START_TIMEOUT)
        node = self._comm.Split_type(mpi.COMM_TYPE_SHARED, key=self._rank)
        mine = np.array([self._rank], dtype=np.int64)
        leader = np.empty(1, dtype=np.int64)
        self._complete(node.Iallreduce(mine, leader, op=mpi.MIN), "init (AllReduce)", node)
        node.Free()
        ids = np.empty(self.world_size, dtype=np.int64)
        self._complete(self._comm.Iallgather(leader, ids), "init (AllGather)", self._comm)
        self._calls.update(("Comm_split_type", "Allreduce", "Allgather"))
        return ids

    def close(self) -> None:
        """Free the shared fusion windows and the cached sub-communicators (collective:
        every rank calls it) and drop the fusion-buffer pool."""
        if self.world_size > 1:
            self._arrive(self._comm, "close (freeing shared memory and communicators)")
        side = self.__dict__.pop("_side_comm", None)
        if side is not None:
            side.Free()
        for view in self.__dict__.pop("_stage_views", {}).values():
            view.wait_sends()
            view.close()
            view._comm.Free()
        for hit in self._shared.values():
            hit.free()
        self._shared.clear()
        self._node_local_comms.clear()
        for comm, _ in self._subs.values():
            if comm is not None and comm != self._comm:
                comm.Free()
        self._subs.clear()
        self._fusion_pool.clear()

    @property
    def comm(self):
        """The world communicator (``MPI.COMM_WORLD`` unless given)."""
        return self._comm

    @property
    def mpi_calls(self) -> Dict[str, int]:
        """MPI function name -> calls made so far by this backend."""
        return dict(self._calls)

    def barrier(self) -> None:
        self._calls["Barrier"] += 1
        self._complete(self._comm.Ibarrier(), "Barrier", self._comm)

    def side_all_gather(self, buf: np.ndarray, kind: str) -> np.ndarray:
        """``(world_size, *buf.shape)``: every rank's small ``buf`` (a check's values, as
        the row counts of the ranks' batches), gathered over a copy of the world
        communicator made at the first call (by every rank), apart from the program's
        collectives: ranks that call it out of step wait for each other (until the
        timeout, naming ``kind``) instead of matching another collective. Counted in
        :attr:`mpi_calls`; not a collective of the program (not in CommReport)."""
        side = self.__dict__.get("_side_comm")
        if side is None:
            self._arrive(self._comm, "making the communicator of " + kind)
            side = self.__dict__["_side_comm"] = self._comm.Dup()
            self._calls["Comm_dup"] += 1
        return self._allgather(side, np.ascontiguousarray(buf), self.world_size, kind)

    # ------------------------------------------------------------ waits

    def _complete(self, req, kind: Optional[str], comm, peer: Optional[int] = None,
                  tag: Optional[int] = None, at_least: float = 0.0) -> None:
        """Wait for ``req`` (an mpi4py request, or a list of them) to complete, at most
        :attr:`timeout` seconds; on expiry a RuntimeError (:meth:`_timeout_error`) for
        the collective ``kind`` on ``comm`` (or the point-to-point message with world
        rank ``peer``; ``kind`` None: the fused collective whose barrier of node shared
        memory this is). ``at_least``: seconds to wait at least, whatever the timeout.

        The wait tests the request (which also drives MPI's progress) in a loop,
        yielding the core after every few tests for the first ``_YIELD_FOR`` seconds (as
        MPICH's own blocking waits do: a hot collective ends about as fast as a blocking
        call, and a rank sharing a core with its peer lets it run), then sleeping between
        tests, from ``_NAP_MIN`` growing to ``_NAP_MAX`` seconds, until the deadline. Its
        lines change while it polls; the launcher's progress watch skips this frame."""
        many = isinstance(req, list)
        test = (lambda: self._mpi.Request.Testall(req)) if many else req.Test
        for _ in _TESTS:
            if test():
                return
        timeout = self.timeout
        if timeout is not None and timeout < at_least:
            timeout = at_least
        if timeout is None:
            if many:
                self._mpi.Request.Waitall(req)
            else:
                req.Wait()
            return
        pause = os.sched_yield
        now = start = time.monotonic()
        deadline = start + timeout
        until = min(start + _YIELD_FOR, deadline)
        while now < until:
            pause()
            for _ in _TESTS:
                if test():
                    return
            now = time.monotonic()
        nap = _NAP_MIN
        while now < deadline:
            time.sleep(min(nap, deadline - now))
            if test():
                return
            nap = min(nap * 1.5, _NAP_MAX)
            now = time.monotonic()
        raise self._timeout_error(kind, comm, now - start, peer, tag, at_least)

    def _timeout_error(self, kind: Optional[str], comm, waited: float, peer: Optional[int],
                       tag: Optional[int], at_least: float = 0.0) -> RuntimeError:
        """The error of a wait that outlasted :attr:`timeout` (see :meth:`_complete`)."""
        world = self._job_comm
        me = world.Get_rank()
        frame = sys._getframe(1)
        while kind is None and frame is not None:      # a barrier of a shared collective
            kind = _SHARED_KINDS.get(frame.f_code.co_name)
            frame = frame.f_back
        kind = kind or "Barrier"
        op, reason = trace.current_cause()
        cause = f" for {op} ({reason})" if op else ("" if reason == "user" else f" ({reason})")
        limit = (f"The limit is {TIMEOUT_VAR}={self.timeout:g} seconds; set that environment "
                 "variable higher, or to 0 or 'none' to wait forever.")
        if at_least > self.timeout:
            limit = (f"The limit is {at_least:g} seconds here (more than {TIMEOUT_VAR}="
                     f"{self.timeout:g}: ranks start at different times); set that "
                     "environment variable higher, or to 0 or 'none' to wait forever.")
        if peer is not None:
            what = f" (tag {tag})" if tag is not None else ""
            stage = (f" (pipeline stage {peer // self.world_size})"
                     if self.world is not None else "")
            if kind == "Send":
                gone = (f"rank {peer} has not received it (it runs another schedule, is "
                        "stuck elsewhere, or died)")
                where = f"to rank {peer}{stage}"
            else:
                gone = (f"rank {peer} has not sent it (it runs another schedule, is stuck "
                        "elsewhere, or died)")
                where = f"from rank {peer}{stage}"
            return RuntimeError(f"mpi backend: {kind}{what}{cause} {where} timed out on rank "
                                f"{me} after {waited:.1f} s: {gone}. {limit}")
        n = comm.Get_size()
        ranks = self._mpi.Group.Translate_ranks(comm.Get_group(), list(range(n)),
                                                world.Get_group())
        return RuntimeError(f"mpi backend: {kind}{cause} over ranks {list(ranks)} timed out "
                            f"on rank {me} after {waited:.1f} s: not every rank of the "
                            "group called it (a rank skipped it, e.g. in a branch that "
                            "depends on the rank, runs another collective, is stuck "
                            f"elsewhere, or died). {limit}")

    def _arrive(self, comm, kind: str, at_least: float = 0.0) -> None:
        """A barrier on ``comm`` with the timeout (at least ``at_least`` seconds), before a
        blocking MPI call every member makes (making a communicator or a shared window):
        once all have arrived, that call cannot wait for a member that never comes."""
        self._calls["Ibarrier"] += 1
        self._complete(comm.Ibarrier(), kind, comm, at_least=at_least)

    # ------------------------------------------------------------ groups

    def _group(self, plan: GroupPlan):
        """This rank's communicator for ``plan`` (None when in no group) and its position
        in its group. ``Split`` runs once per distinct spec, on every rank."""
        key = (plan.world_size, plan.members.shape, plan.members.tobytes())
        hit = self._subs.get(key)
        if hit is not None:
            return hit
        where = np.flatnonzero(plan.members.ravel() == self._rank)
        g, j = divmod(int(where[0]), plan.group_size) if where.size else (-1, 0)
        if plan.identity and plan.num_groups == 1:
            comm = self._comm
        else:
            color = g if g >= 0 else self._mpi.UNDEFINED
            self._arrive(self._comm, "Comm_split (a communicator for a device group)")
            comm = self._comm.Split(color, j)
            self._calls["Comm_split"] += 1
            if comm == self._mpi.COMM_NULL:
                comm = None
        hit = (comm, j) if g >= 0 else (None, 0)
        self._subs[key] = hit
        return hit

    def _mpi_op(self, op: str, dtype: np.dtype):
        """The MPI reduction op for ``op`` on ``dtype``, or None when MPI cannot reduce it."""
        mpi = self._mpi
        if not dtype.isnative:
            return None
        kind, size = dtype.kind, dtype.itemsize
        if kind == "b":
            return mpi.LOR if op in ("sum", "max") else mpi.LAND
        ok = (kind in "iu" or (kind == "f" and size in (4, 8))
              or (kind == "c" and size in (8, 16) and op in ("sum", "mean", "prod")))
        if not ok:
            return None
        return {"sum": mpi.SUM, "mean": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN,
                "prod": mpi.PROD}[op]

    # ------------------------------------------------------- raw transfers

    def _allgather(self, comm, buf: np.ndarray, n: int, kind: str = "AllGather") -> np.ndarray:
        """(n, *buf.shape): every member's buffer, in member order."""
        out = np.empty((n,) + buf.shape, dtype=buf.dtype)
        self._calls["Allgather"] += 1
        self._complete(comm.Iallgather([_flat_bytes(buf), self._mpi.BYTE],
                                       [_flat_bytes(out), self._mpi.BYTE]), kind, comm)
        return out

    def _alltoall(self, comm, parts: np.ndarray, kind: str = "AlltoAll") -> np.ndarray:
        """(n, *part) -> (n, *part): index j of the result is member j's part for me."""
        out = np.empty_like(parts)
        self._calls["Alltoall"] += 1
        self._complete(comm.Ialltoall([_flat_bytes(parts), self._mpi.BYTE],
                                      [_flat_bytes(out), self._mpi.BYTE]), kind, comm)
        return out

    @staticmethod
    def _finish_mean(red: np.ndarray, op: str, n: int) -> np.ndarray:
        if op == "mean":
            np.divide(red, n, out=red)
        return red

    # ---------------------------------------------------------- collectives

    def _all_reduce(self, stack, plan, op, algorithm):
        if algorithm == "ring" and stack.dtype not in _RING_DTYPES:
            raise TypeError(f"all_reduce: algorithm='ring' supports float32, float64, int32 "
                            f"and int64 buffers, got dtype {stack.dtype}; use "
                            "algorithm='direct'")
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        send = _mine(stack)
        mop = self._mpi_op(op, stack.dtype)
        if mop is None:
            red = _UFUNC[op].reduce(self._allgather(comm, send, n, "AllReduce"), axis=0,
                                    dtype=stack.dtype)
        else:
            red = np.empty_like(send)
            self._calls["Allreduce"] += 1
            self._complete(comm.Iallreduce(send.reshape(-1), red.reshape(-1), op=mop),
                           "AllReduce", comm)
        return self._finish_mean(red, op, n)[None]

    def _all_reduce_fused(self, stacks, plan, op):
        """The stacks packed (``_comm.pack``, GIL released) and reduced as one buffer; the
        results are views into a buffer of the fusion-buffer pool (:meth:`_fusion_buffer`,
        so that its pages are not faulted in anew on every call).

        When the group's ranks share one machine the reduction runs in node shared memory
        (:meth:`_shared_all_reduce`: 0.65-0.75x the time of MPI's ``Allreduce``); across
        machines each rank packs into its pooled buffer and MPI reduces it in place
        (``Allreduce(MPI.IN_PLACE, ...)``, no send-to-receive copy). Dtypes MPI cannot
        reduce go the generic way there (gathered, reduced with numpy)."""
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        offsets, total = fusion_offsets(stacks)
        dtype = stacks[0].dtype
        shared = comm is not None and total > 0 and self._node_local(comm)
        mop = self._mpi_op(op, dtype)
        if comm is not None and mop is None and not shared:
            return super()._all_reduce_fused(stacks, plan, op)
        buf = self._fusion_buffer(dtype, total)
        flat = [np.ascontiguousarray(s) for s in stacks]
        if shared:
            self._shared_all_reduce(comm, flat, offsets, buf, op)
        else:
            _comm.pack(flat, buf, offsets)
            if comm is not None:             # in no group: my own buffer
                self._calls["Allreduce"] += 1
                self._complete(comm.Iallreduce(self._mpi.IN_PLACE, buf.reshape(-1), op=mop),
                               "fused AllReduce", comm)
        if comm is not None:
            self._finish_mean(buf, op, n)
        return [buf[:, o:o + s.size].reshape(s.shape) for s, o in zip(stacks, offsets)]

    def _node_local(self, comm) -> bool:
        """Whether every rank of ``comm`` runs on this machine (one ``Split_type`` per
        communicator, cached)."""
        key = comm.py2f()
        hit = self._node_local_comms.get(key)
        if hit is None:
            self._arrive(comm, "Comm_split_type (finding the group's machines)")
            node = comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=comm.Get_rank())
            hit = node.Get_size() == comm.Get_size()
            node.Free()
            self._calls["Comm_split_type"] += 1
            self._node_local_comms[key] = hit
        return hit

    def _shared_all_reduce(self, comm, stacks, offsets, out: np.ndarray, op: str) -> None:
        """AllReduce through node shared memory, result into ``out`` (1, total).

        Every member packs its stacks into its row of a shared input window ``(n,
        total)`` (:class:`_NodeWindows`, contiguous rows in member order); after a
        barrier member ``j`` reduces column block ``j`` of the window over the rows with
        one numpy call (adding the rows in member order) into the shared result row; after a second barrier each member copies the result row
        out. Bytes touched per rank: the packing, its column block of every row, the
        copy out -- against MPI's reduce-scatter/allgather, which moves and reduces
        through private buffers; two barriers instead of 2 log2(n) pairwise exchanges."""
        n, me = comm.Get_size(), comm.Get_rank()      # the group rank is the member order
        dtype, total = out.dtype, out.shape[1]
        nbytes = total * dtype.itemsize
        node = self._node_windows(comm, nbytes)
        win, rows = node.next_input()
        table = rows[:, :nbytes].view(dtype)
        _comm.pack(stacks, table[me:me + 1], offsets)
        self._shared_sync(comm, win)
        part = -(-total // n)
        lo, hi = min(total, me * part), min(total, (me + 1) * part)
        result = node.result[:nbytes].view(dtype)
        if hi > lo:
            _UFUNC[op].reduce(table[:, lo:hi], axis=0, dtype=dtype, out=result[lo:hi])
        self._shared_sync(comm, node.result_win)
        np.copyto(out.reshape(-1), result)
        self._calls["shared_allreduce"] += 1

    def _shared_sync(self, comm, win) -> None:
        """Make the writes of every member into ``win`` visible to all (a barrier between
        two window syncs)."""
        win.Sync()
        self._calls["Barrier"] += 1
        self._complete(comm.Ibarrier(), None, comm)    # None: the fused collective calling
        win.Sync()

    def _node_windows(self, comm, nbytes: int) -> "_NodeWindows":
        """The node shared memory of ``comm`` (:class:`_NodeWindows`) with rows of at
        least ``nbytes``. Made once per communicator and remade larger when a larger
        bucket comes (collective: every member asks for the same size, as its buffers
        have the same shapes)."""
        key = comm.py2f()
        hit = self._shared.get(key)
        if hit is not None and hit.capacity >= nbytes:
            return hit
        self._arrive(comm, "Win_allocate_shared (node shared memory for fused collectives)")
        if hit is not None:
            hit.free()
        hit = _NodeWindows(self._mpi, comm, nbytes)
        self._calls["Win_allocate_shared"] += 3
        self._shared[key] = hit
        return hit

    def _fusion_buffer(self, dtype: np.dtype, total: int) -> np.ndarray:
        """A ``(1, total)`` fusion buffer of ``dtype`` that nothing else references.

        In an MPI rank a fresh multi-megabyte numpy buffer is mapped anew on every call
        and faulted in page by page (measured on 4 ranks for 6.4 MB: 1,347 minor faults
        per call, which doubled the time of the fused AllReduce). So the backend keeps
        up to ``_FUSION_POOL`` buffers and hands one out again once every view of the
        previous result taken from it is gone -- its only references are then the pool's
        own -- so a result the caller still holds (reduced gradients) is never
        overwritten. Otherwise a new buffer is made and pooled in place of a free one."""
        pool = self._fusion_pool
        free = None
        for k in range(len(pool)):
            if sys.getrefcount(pool[k]) > _POOL_ONLY:   # a result's views still use it
                continue
            if pool[k].dtype == dtype and pool[k].shape[1] == total:
                return pool[k]
            free = k if free is None else free
        buf = np.empty((1, total), dtype=dtype)
        if len(pool) < _FUSION_POOL:
            pool.append(buf)
        elif free is not None:
            pool[free] = buf
        return buf

    def _reduce_scatter_fused(self, stacks, plan, axes, op):
        """The stacks' parts packed part-major (:func:`_pack_parts`) and reduce-scattered
        as one buffer; the results are views into a pooled buffer (:meth:`_fusion_buffer`).

        Ranks on one machine reduce in node shared memory
        (:meth:`_shared_reduce_scatter`: each member reduces its own block over the rows
        in member order); across machines each rank packs into a pooled buffer and MPI
        reduce-scatters it in place (``Reduce_scatter_block(MPI.IN_PLACE, ...)``, the
        result in its first block). Dtypes MPI cannot reduce go the generic way there."""
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        dtype = stacks[0].dtype
        chunks = [s[0].size // n for s in stacks]
        offsets = list(itertools.accumulate(chunks, initial=0))
        total = offsets[-1]
        if comm is None or total == 0:       # a group of one; or nothing to move
            return super()._reduce_scatter_fused(stacks, plan, axes, op)
        shared = self._node_local(comm)
        mop = self._mpi_op(op, dtype)
        if mop is None and not shared:
            return super()._reduce_scatter_fused(stacks, plan, axes, op)
        if shared:
            red = self._fusion_buffer(dtype, total)
            self._shared_reduce_scatter(comm, stacks, axes, offsets, red, op)
        else:
            buf = self._fusion_buffer(dtype, n * total)
            _pack_parts(stacks, axes, offsets, buf.reshape(n, total), n)
            self._calls["Reduce_scatter_block"] += 1
            self._complete(comm.Ireduce_scatter_block(self._mpi.IN_PLACE, buf.reshape(-1),
                                                      op=mop), "fused ReduceScatter", comm)
            red = buf[:, :total]
        self._finish_mean(red, op, n)
        return [red[:, o:o + c].reshape((1,) + _parted(s.shape[1:], a, n))
                for s, a, o, c in zip(stacks, axes, offsets, chunks)]

    def _shared_reduce_scatter(self, comm, stacks, axes, offsets, out: np.ndarray,
                               op: str) -> None:
        """ReduceScatter through node shared memory, this member's block into ``out``
        (1, total).

        Every member packs its parts part-major into its row of the shared window
        ``(n, n * total)``; after a barrier member ``j`` reduces block ``j`` of every
        row with one numpy call straight into ``out``, adding the rows one after the
        other in member order (so the result is the same whatever the timing). One
        barrier (the input windows are used in turn, see :class:`_NodeWindows`). Bytes
        touched per rank: the packing, its block of every row."""
        n, me = comm.Get_size(), comm.Get_rank()      # the group rank is the member order
        dtype, total = out.dtype, out.shape[1]
        nbytes = n * total * dtype.itemsize
        win, rows = self._node_windows(comm, nbytes).next_input()
        table = rows[:, :nbytes].view(dtype).reshape(n, n, total)   # (row, part, total)
        _pack_parts(stacks, axes, offsets, table[me], n)
        self._shared_sync(comm, win)
        _UFUNC[op].reduce(table[:, me], axis=0, dtype=dtype, out=out[0])
        self._calls["shared_reduce_scatter"] += 1

    def _all_gather_fused(self, stacks, plan, axes):
        """The stacks gathered as one buffer; the results, each concatenated along its
        axis, are views into one pooled buffer (:meth:`_fusion_buffer`).

        Ranks on one machine gather through node shared memory
        (:meth:`_shared_all_gather`); across machines each rank packs its stacks
        (``_comm.pack``) into a pooled buffer, one ``Allgather`` fills another, and each
        stack's slots are cut out into the results (:func:`_unpack_gathered`)."""
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        dtype = stacks[0].dtype
        offsets, total = fusion_offsets(stacks)
        offsets.append(total)
        if comm is None or total == 0:
            return super()._all_gather_fused(stacks, plan, axes)
        out = self._fusion_buffer(dtype, n * total)
        flat = [np.ascontiguousarray(s) for s in stacks]
        if self._node_local(comm):
            return self._shared_all_gather(comm, flat, axes, offsets, out)
        send = self._fusion_buffer(dtype, total)
        _comm.pack(flat, send, offsets[:-1])
        got = self._fusion_buffer(dtype, n * total)
        self._calls["Allgather"] += 1
        self._complete(comm.Iallgather([_flat_bytes(send), self._mpi.BYTE],
                                       [_flat_bytes(got), self._mpi.BYTE]),
                       "fused AllGather", comm)
        return _unpack_gathered(got.reshape(n, total), stacks, axes, offsets, out)

    def _shared_all_gather(self, comm, flat, axes, offsets, out: np.ndarray) -> list:
        """AllGather through node shared memory into ``out`` (1, n * total).

        The input window, read as one flat array, holds the results laid out as
        :func:`_unpack_gathered` lays them out (each stack's gathered buffer after the
        other); every member writes its buffers into their places there
        (:func:`_place_gathered`), and after a barrier each copies the whole of it out
        with one contiguous copy -- against packing rows and cutting every stack's
        slots out of each row afterwards, which copies the same bytes in pieces (3x the
        time for 100 x 64 KiB on 4 ranks). One barrier (the input windows are used in
        turn, see :class:`_NodeWindows`)."""
        n, me = comm.Get_size(), comm.Get_rank()     # the group rank is the member order
        dtype, total = out.dtype, offsets[-1]
        nbytes = total * dtype.itemsize                # n rows: room for n * total items
        win, rows = self._node_windows(comm, nbytes).next_input()
        whole = rows.reshape(-1)[:n * total * dtype.itemsize].view(dtype)[None]
        _place_gathered(flat, axes, offsets, whole, me, n)
        self._shared_sync(comm, win)
        np.copyto(out, whole)
        self._calls["shared_all_gather"] += 1
        return [out[:, n * o:n * hi].reshape((1,) + _gathered(s.shape[1:], a, n))
                for s, a, o, hi in zip(flat, axes, offsets, offsets[1:])]

    def _all_gather(self, stack, plan, axis):
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        got = self._allgather(comm, _mine(stack), n)
        return _concat(got, axis)[None]

    def _reduce_scatter(self, stack, plan, axis, op):
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        parts = _parts(_mine(stack), axis, n)
        mop = self._mpi_op(op, stack.dtype)
        if mop is None:
            red = _UFUNC[op].reduce(self._alltoall(comm, parts, "ReduceScatter"), axis=0,
                                    dtype=stack.dtype)
        else:
            red = np.empty(parts.shape[1:], dtype=stack.dtype)
            self._calls["Reduce_scatter_block"] += 1
            self._complete(comm.Ireduce_scatter_block(parts.reshape(-1), red.reshape(-1),
                                                      op=mop), "ReduceScatter", comm)
        return self._finish_mean(red, op, n)[None]

    def _all_to_all(self, stack, plan, split_axis, concat_axis):
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        got = self._alltoall(comm, _parts(_mine(stack), split_axis, n))
        return _concat(got, concat_axis)[None]

    def _broadcast(self, stack, plan, root):
        n = plan.group_size
        comm, _ = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        buf = _mine(stack).copy()
        self._calls["Bcast"] += 1
        self._complete(comm.Ibcast([_flat_bytes(buf), self._mpi.BYTE], root=root),
                       "Broadcast", comm)
        return buf[None]

    def _reduce(self, stack, plan, root, op):
        n = plan.group_size
        comm, me = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        send = _mine(stack)
        mop = self._mpi_op(op, stack.dtype)
        if mop is None:
            got = np.empty((n,) + send.shape, dtype=send.dtype) if me == root else None
            self._calls["Gather"] += 1
            self._complete(comm.Igather([_flat_bytes(send), self._mpi.BYTE],
                                        None if got is None else [_flat_bytes(got),
                                                                  self._mpi.BYTE],
                                        root=root), "Reduce", comm)
            if me != root:
                return stack.copy()
            red = _UFUNC[op].reduce(got, axis=0, dtype=stack.dtype)
        else:
            red = np.empty_like(send) if me == root else None
            self._calls["Reduce"] += 1
            self._complete(comm.Ireduce(send.reshape(-1),
                                        None if red is None else red.reshape(-1), op=mop,
                                        root=root), "Reduce", comm)
            if me != root:
                return stack.copy()
        return self._finish_mean(red, op, n)[None]

    def _scatter(self, stack, plan, root, axis):
        n = plan.group_size
        comm, me = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        local = stack.shape[1:]
        part = local[:axis] + (local[axis] // n,) + local[axis + 1:]
        out = np.empty(part, dtype=stack.dtype)
        send = _parts(_mine(stack), axis, n) if me == root else None
        self._calls["Scatter"] += 1
        self._complete(comm.Iscatter(None if send is None else [_flat_bytes(send),
                                                                self._mpi.BYTE],
                                     [_flat_bytes(out), self._mpi.BYTE], root=root),
                       "Scatter", comm)
        return out[None]

    def _gather(self, stack, plan, root, axis):
        n = plan.group_size
        comm, me = self._group(plan) if n > 1 else (None, 0)
        if comm is None:
            return stack.copy()
        send = _mine(stack)
        got = np.empty((n,) + send.shape, dtype=send.dtype) if me == root else None
        self._calls["Gather"] += 1
        self._complete(comm.Igather([_flat_bytes(send), self._mpi.BYTE],
                                    None if got is None else [_flat_bytes(got), self._mpi.BYTE],
                                    root=root), "Gather", comm)
        if me == root:
            return _concat(got, axis)[None]
        local = send.shape
        shape = local[:axis] + (n * local[axis],) + local[axis + 1:]
        return np.zeros((1,) + shape, dtype=stack.dtype)

    # ------------------------------------------------------------ pipeline stages
    # A stage's view runs its collectives on the stage's sub-communicator; its Send /
    # Receive go over the world communicator to the rank of the same position in the
    # other stage: a pickled (shape, dtype) header, then the raw buffer (Isend, waited
    # for by wait_sends before the buffer is reused or the job ends).

    def _stage_view(self, stages: int) -> "MPIBackend":
        n = self.world_size // stages
        stage = self._rank // n
        self._calls["Comm_split"] += 1
        self._arrive(self._comm, "Comm_split (a communicator for a pipeline stage)")
        view = MPIBackend(comm=self._comm.Split(stage, self._rank), _stage_of=self)
        view.stage = stage
        view._pending = []
        return view

    def _peer(self, stage: int) -> int:
        return stage * self.world_size + self._rank

    def _send(self, stack, stage: int, tag: int, meta) -> None:
        comm = self.world._comm
        # (a 0-d buffer stays 0-d: ascontiguousarray would make it 1-d)
        buf = np.ascontiguousarray(stack[0]) if stack.ndim > 1 else np.array(stack[0])
        dst = self._peer(stage)
        head = (buf.shape, buf.dtype.str, meta)
        self._pending.append((comm.isend(head, dest=dst, tag=2 * tag), None, dst, tag))
        self._pending.append((comm.Isend(buf, dest=dst, tag=2 * tag + 1), buf, dst, tag))
        self._calls["Isend"] += 1

    def _recv(self, stage: int, tag: int):
        comm = self.world._comm
        src = self._peer(stage)
        head = _Arrival(comm, src, 2 * tag)           # the pickled header, once it is there
        self._complete(head, "Receive", comm, peer=src, tag=tag)
        shape, dtype, meta = head.message.recv()
        out = np.empty((1,) + tuple(shape), dtype=np.dtype(dtype))
        # (1, *shape): the same bytes
        self._complete(comm.Irecv(out, source=src, tag=2 * tag + 1), "Receive", comm,
                       peer=src, tag=tag)
        self._calls["Recv"] += 1
        return out, meta

    def wait_sends(self) -> None:
        """Wait until every message this stage sent has left its buffer (each at most
        :attr:`timeout` seconds)."""
        pending = getattr(self, "_pending", None)
        if pending:
            comm = self.world._comm
            for req, _, dst, tag in pending:
                self._complete(req, "Send", comm, peer=dst, tag=tag)
            pending.clear()

    def _send_recv(self, stack, src, dst):
        if not len(src):
            return stack.copy()
        mpi = self._mpi
        send = _mine(stack)
        nbytes = send.nbytes
        targets = np.sort(dst[src == self._rank])
        sources = src[dst == self._rank]
        scounts = np.zeros(self.world_size, dtype=np.int64)
        sdispls = np.zeros(self.world_size, dtype=np.int64)
        scounts[targets] = nbytes
        sdispls[targets] = np.arange(targets.size, dtype=np.int64) * nbytes
        rcounts = np.zeros(self.world_size, dtype=np.int64)
        rcounts[sources] = nbytes
        sendbuf = np.ascontiguousarray(
            np.broadcast_to(_flat_bytes(send), (targets.size, nbytes))).reshape(-1)
        out = send.copy()
        recvbuf = _flat_bytes(out) if sources.size else np.empty(0, dtype=np.uint8)
        self._calls["Alltoallv"] += 1
        self._complete(self._comm.Ialltoallv(
            [sendbuf, (scounts.tolist(), sdispls.tolist()), mpi.BYTE],
            [recvbuf, (rcounts.tolist(), [0] * self.world_size), mpi.BYTE]),
            "Send/Recv", self._comm)
        return out[None]


def _factory(device_num: Optional[int] = None) -> MPIBackend:
    return MPIBackend(device_num)


register_backend("mpi", _factory)
