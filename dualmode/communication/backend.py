"""The backend interface: the devices this process holds and collectives on stacks.

A **stack** is a numpy array whose leading axis indexes the devices this process holds
(all ``N`` under "sim", one under "mpi"): ``stack[i]`` is the buffer of device
``local_ranks[i]``. A **group spec** ``members`` is an int array ``(G, n)`` of disjoint
groups of ranks (see :mod:`dualmode.communication.groups`); ``None`` is the whole world
as one group. Every collective takes a stack and returns a **new** stack, which may be a
read-only view (e.g. ``np.broadcast_to`` of one replicated result): copy it before
writing into it.

:class:`Backend` implements the public collectives once: it validates the arguments
(errors name the collective, the parameter, the value and what is valid), calls the
backend's ``_impl`` method with a validated :class:`~.groups.GroupPlan`, and records the
collective for :class:`dualmode.parallel.CommReport`. A backend only writes the
``_impl`` methods. Collectives that change the buffer shape (AllGather, ReduceScatter,
Scatter, Gather, and AlltoAll with ``split_axis != concat_axis``) need every rank in
exactly one group, since a stack holds buffers of one shape; the others leave ranks
outside ``members`` unchanged.
"""
from __future__ import annotations

import abc
import itertools
import math
import numbers
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import _comm
from .._core._fusion import check_stacks, fusion_offsets
from . import trace
from .groups import GroupPlan, resolve

__all__ = ["Backend", "OPS", "fusion_offsets", "register_backend", "backend_factory", "registered_backends"]

OPS = ("sum", "mean", "max", "min", "prod")


def _is_int(v) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and
                              not isinstance(v, (bool, np.bool_)))


# ------------------------------------------------------------------ validation


def _check_op(func: str, op, dtype: np.dtype) -> str:
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"{func}: op={op!r} is not valid; expected one of "
                         + ", ".join(repr(o) for o in OPS))
    if dtype.kind not in "biufc":
        raise TypeError(f"{func}: op={op!r} needs a numeric or bool stack, got dtype {dtype}")
    if op == "mean" and dtype.kind not in "fc":
        raise TypeError(f"{func}: op='mean' needs a floating-point stack, got dtype {dtype}; "
                        "use op='sum' for integer buffers")
    return op


def _check_axis(func: str, name: str, axis, local: Tuple[int, ...]) -> int:
    r = len(local)
    if r == 0:
        raise ValueError(f"{func}: {name}={axis!r} needs device buffers with at least one "
                         "dimension; the buffers are scalars (local shape ())")
    if not _is_int(axis) or not -r <= axis < r:
        raise ValueError(f"{func}: {name}={axis!r} is out of range for device buffers of "
                         f"shape {local}; expected an int in [{-r}, {r})")
    return int(axis) % r


def _check_divisible(func: str, name: str, axis: int, local: Tuple[int, ...], n: int) -> None:
    if local[axis] % n:
        raise ValueError(f"{func}: dim {axis} of the device buffers (size {local[axis]}, "
                         f"local shape {local}, {name}={axis}) is not divisible by the group "
                         f"size {n}")


def _check_root(func: str, root, n: int) -> int:
    if not _is_int(root) or not 0 <= root < n:
        raise ValueError(f"{func}: root={root!r} is out of range for groups of {n} ranks; "
                         f"root is an index within each group, expected an int in [0, {n})")
    return int(root)


def _check_full(func: str, plan: GroupPlan, why: str) -> None:
    if not plan.full:
        missing = np.setdiff1d(np.arange(plan.world_size), plan.members.ravel())
        raise ValueError(f"{func}: members cover {plan.members.size} of {plan.world_size} "
                         f"ranks (rank {int(missing[0])} is in no group); {why}, so every "
                         "rank must be in exactly one group")


# ------------------------------------------------------------------- registry


_FACTORIES: Dict[str, Callable[[int], "Backend"]] = {}


def register_backend(name: str, factory: Callable[[int], "Backend"]) -> None:
    """Register a backend under ``name``; ``factory(device_num)`` returns a :class:`Backend`.

    Registering a name again replaces the earlier factory.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_backend: name={name!r} is not valid; expected a non-empty "
                        "str")
    if not callable(factory):
        raise TypeError(f"register_backend: factory for {name!r} is {factory!r}; expected a "
                        "callable factory(device_num) -> Backend")
    _FACTORIES[name] = factory


def backend_factory(name: str) -> Optional[Callable[[int], "Backend"]]:
    """The factory registered under ``name``, or None."""
    return _FACTORIES.get(name)


def registered_backends() -> Tuple[str, ...]:
    """Names of the registered backends, in registration order."""
    return tuple(_FACTORIES)


# -------------------------------------------------------------------- Backend


def _split_shape(local, axis: int, n: int) -> tuple:
    """`local` with dim `axis` cut in (n, local[axis] // n)."""
    return tuple(local[:axis]) + (n, local[axis] // n) + tuple(local[axis + 1:])


def _parted(local, axis: int, n: int) -> tuple:
    """The shape of one of the `n` parts of a buffer `local` along `axis`, dims kept."""
    return tuple(local[:axis]) + (local[axis] // n,) + tuple(local[axis + 1:])


def _gathered(local, axis: int, n: int) -> tuple:
    """`local` with dim `axis` n times longer (an AllGather's result)."""
    return tuple(local[:axis]) + (local[axis] * n,) + tuple(local[axis + 1:])


class Backend(abc.ABC):
    """The devices this process holds and the collectives among all devices.

    Parameters
    ----------
    world_size : int
        Devices in the job.
    local_ranks : sequence of int
        The ranks of the devices this process holds, in stack order.

    Subclasses set ``name`` and implement the ``_all_reduce`` ... ``_send_recv`` methods;
    they receive validated arguments and a :class:`~.groups.GroupPlan`.
    """

    name: str = "abstract"
    #: values accepted by ``all_reduce(..., algorithm=)``
    all_reduce_algorithms: Tuple[str, ...] = ("direct",)
    #: does ``_all_reduce_fused`` take deferred stacks as they are (see
    #: :meth:`all_reduce_fused`)?
    reads_deferred: bool = False

    def __init__(self, world_size: int, local_ranks: Sequence[int]):
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"{type(self).__name__}: world_size={world_size!r} is not valid; "
                             "expected an int >= 1")
        self._world_size = int(world_size)
        self._local_ranks = tuple(int(r) for r in local_ranks)

    @property
    def world_size(self) -> int:
        """Number of devices in the job."""
        return self._world_size

    @property
    def local_ranks(self) -> Tuple[int, ...]:
        """Ranks of the devices this process holds (the stack's leading axis)."""
        return self._local_ranks

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, world_size={self.world_size}, "
                f"local devices={len(self.local_ranks)})")

    # ------------------------------------------------------------ helpers

    def plan(self, func: str, members) -> GroupPlan:
        """Validate ``members`` for collective ``func``; the cached :class:`GroupPlan`."""
        return resolve(func, members, self._world_size)

    def _check_stack(self, func: str, stack) -> np.ndarray:
        n = len(self._local_ranks)
        if not isinstance(stack, np.ndarray):
            raise TypeError(f"{func}: stack must be a numpy array (local devices, *buffer "
                            f"shape), got {type(stack).__name__}")
        if stack.ndim < 1 or stack.shape[0] != n:
            raise ValueError(f"{func}: stack has shape {stack.shape}, but this process holds "
                             f"{n} device(s) ({self.name} backend); expected a leading dim "
                             f"of {n}")
        return stack

    @staticmethod
    def _note(stack: np.ndarray, out: np.ndarray) -> None:
        per = stack.shape[0] or 1
        trace.note_memory((stack.nbytes + math.prod(out.shape) * out.itemsize) // per)

    @staticmethod
    def _device_bytes(stack: np.ndarray) -> int:
        return math.prod(stack.shape[1:]) * stack.itemsize

    def _record(self, kind: str, plan: GroupPlan, stack: np.ndarray, out: np.ndarray,
                total_bytes: Optional[int] = None) -> None:
        if trace.GROUP_SINKS:
            trace.note_groups(plan.members)
        if trace._STATE.reports:
            trace.record(kind, plan.group_size, plan.num_groups, self._device_bytes(stack),
                         total_bytes)
            self._note(stack, out)

    # -------------------------------------------------------- collectives

    def all_reduce(self, stack: np.ndarray, members=None, op: str = "sum",
                   algorithm: str = "direct") -> np.ndarray:
        """Reduce the buffers of each group; every member gets the result.

        Parameters
        ----------
        stack : ndarray (local devices, *buffer shape)
        members : (G, n) int array or None (the whole world)
        op : "sum", "mean", "max", "min" or "prod" ("mean" needs a float dtype)
        algorithm : one of ``all_reduce_algorithms`` ("direct"; "sim" adds "ring")
        """
        f = "all_reduce"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        op = _check_op(f, op, stack.dtype)
        if algorithm not in self.all_reduce_algorithms:
            raise ValueError(f"{f}: algorithm={algorithm!r} is not valid for the {self.name} "
                             "backend; expected one of "
                             + ", ".join(repr(a) for a in self.all_reduce_algorithms))
        out = self._all_reduce(stack, plan, op, algorithm)
        self._record("AllReduce", plan, stack, out)
        return out

    def _check_fused(self, func: str, stacks, deferred: bool = False) -> list:
        """`stacks` as a list of stacks of one dtype, each with the device leading dim.
        A deferred stack (:class:`~dualmode._core._tensor.Deferred`, a Tensor's stack
        not written yet) is kept as it is when `deferred`, else written. The loop over
        the stacks runs in C (``_core._fusion.check_stacks``; its reference is
        ``_core.fusion_reference.check_stacks``)."""
        return check_stacks(func, stacks, len(self._local_ranks), deferred)

    def _check_fused_axes(self, func: str, stacks, axis) -> List[int]:
        """One validated buffer axis per stack (`axis`: an int for all, or one each)."""
        if _is_int(axis):
            axes = [axis] * len(stacks)
        else:
            try:
                axes = list(axis)
            except TypeError:
                raise TypeError(f"{func}: axis={axis!r} is not valid; expected an int or a "
                                f"sequence of ints, one per stack") from None
            if len(axes) != len(stacks):
                raise ValueError(f"{func}: axis has {len(axes)} entries for {len(stacks)} "
                                 f"stacks; give one axis per stack (or one int for all)")
        return [_check_axis(func, f"axis[{i}]", a, s.shape[1:])
                for i, (a, s) in enumerate(zip(axes, stacks))]

    def _record_fused(self, kind: str, plan: GroupPlan, stacks, outs) -> None:
        """One record of `kind` for a fused collective: the summed input bytes."""
        if trace.GROUP_SINKS:
            trace.note_groups(plan.members)
        if trace._STATE.reports:
            nbytes = sum(self._device_bytes(s) for s in stacks)
            trace.record(kind, plan.group_size, plan.num_groups, nbytes, None)
            trace.note_memory(nbytes + sum(self._device_bytes(o) for o in outs))

    def all_reduce_fused(self, stacks: Sequence[np.ndarray], members=None,
                         op: str = "sum") -> list:
        """AllReduce many stacks of one dtype as ONE collective (a fusion buffer).

        Returns the reduced stacks, read-only views (do not write into them).
        Recorded as one AllReduce of the summed bytes. The base implementation packs the
        stacks into a buffer and runs one ``_all_reduce``; a backend may override
        ``_all_reduce_fused`` to reach the same result without the packing copy. A stack
        may be deferred (a Tensor's stack not written yet, ``Tensor._lazy``): a backend
        whose ``reads_deferred`` is True gets it as it is (it may know its totals), the
        others get it written."""
        f = "fused_all_reduce"
        stacks = self._check_fused(f, stacks, self.reads_deferred)
        if not stacks:
            return []
        plan = self.plan(f, members)
        op = _check_op(f, op, stacks[0].dtype)
        outs = self._all_reduce_fused(stacks, plan, op)
        self._record_fused("AllReduce", plan, stacks, outs)
        return outs

    def _all_reduce_fused(self, stacks, plan: GroupPlan, op: str) -> list:
        offsets, total = fusion_offsets(stacks)
        buf = np.empty((stacks[0].shape[0], total), dtype=stacks[0].dtype)
        _comm.pack([np.ascontiguousarray(s) for s in stacks], buf, offsets)
        red = self._all_reduce(buf, plan, op, "direct")
        return [red[:, o:o + math.prod(s.shape[1:])].reshape(s.shape)
                for s, o in zip(stacks, offsets)]

    def reduce_scatter_fused(self, stacks: Sequence[np.ndarray], members=None, axis=0,
                             op: str = "sum") -> list:
        """ReduceScatter many stacks of one dtype as ONE collective: for each stack
        ``i``, the result of ``reduce_scatter(stacks[i], members, axis[i], op)``.

        ``axis`` is an int for every stack or one per stack. Recorded as one
        ReduceScatter of the summed input bytes. The base implementation packs each
        device's ``n`` parts of every stack part-major into one buffer ``(n, total)``
        and runs one ``_reduce_scatter`` on it (so it works for any backend); a
        backend may override ``_reduce_scatter_fused`` to skip the packing copy."""
        f = "fused_reduce_scatter"
        stacks = self._check_fused(f, stacks)
        if not stacks:
            return []
        plan = self.plan(f, members)
        op = _check_op(f, op, stacks[0].dtype)
        axes = self._check_fused_axes(f, stacks, axis)
        for i, (s, a) in enumerate(zip(stacks, axes)):
            _check_divisible(f, f"axis[{i}]", a, s.shape[1:], plan.group_size)
        if plan.group_size > 1:
            _check_full(f, plan, "ReduceScatter changes the buffer shape")
        outs = self._reduce_scatter_fused(stacks, plan, axes, op)
        self._record_fused("ReduceScatter", plan, stacks, outs)
        return outs

    def _reduce_scatter_fused(self, stacks, plan: GroupPlan, axes, op: str) -> list:
        n = plan.group_size
        rows = stacks[0].shape[0]
        chunks = [math.prod(s.shape[1:]) // n for s in stacks]
        offsets = list(itertools.accumulate(chunks, initial=0))
        buf = np.empty((rows, n, offsets[-1]), dtype=stacks[0].dtype)
        for s, a, o, c in zip(stacks, axes, offsets, chunks):
            # part j of every device's buffer along `a` -> row j of its slot in buf
            slot = np.reshape(buf[:, :, o:o + c], (rows, n) + _parted(s.shape[1:], a, n),
                              copy=False)                   # a view: written in place
            parts = s.reshape((rows,) + _split_shape(s.shape[1:], a, n))
            slot[...] = np.moveaxis(parts, 1 + a, 1)
        red = self._reduce_scatter(buf, plan, 0, op)          # (rows, 1, total)
        return [red[:, 0, o:o + c].reshape((rows,) + _parted(s.shape[1:], a, n))
                for s, a, o, c in zip(stacks, axes, offsets, chunks)]

    def all_gather_fused(self, stacks: Sequence[np.ndarray], members=None, axis=0) -> list:
        """AllGather many stacks of one dtype as ONE collective: for each stack ``i``,
        the result of ``all_gather(stacks[i], members, axis[i])``.

        ``axis`` is an int for every stack or one per stack. Recorded as one AllGather
        of the summed input bytes. The base implementation packs the stacks into one
        buffer, runs one ``_all_gather`` and cuts each result from the members' slots;
        a backend may override ``_all_gather_fused`` to skip the packing copy."""
        f = "fused_all_gather"
        stacks = self._check_fused(f, stacks)
        if not stacks:
            return []
        plan = self.plan(f, members)
        axes = self._check_fused_axes(f, stacks, axis)
        if plan.group_size > 1:
            _check_full(f, plan, "AllGather changes the buffer shape")
        outs = self._all_gather_fused(stacks, plan, axes)
        self._record_fused("AllGather", plan, stacks, outs)
        return outs

    def _all_gather_fused(self, stacks, plan: GroupPlan, axes) -> list:
        n = plan.group_size
        rows = stacks[0].shape[0]
        offsets, total = fusion_offsets(stacks)
        buf = np.empty((rows, total), dtype=stacks[0].dtype)
        _comm.pack([np.ascontiguousarray(s) for s in stacks], buf, offsets)
        got = self._all_gather(buf[:, None], plan, 0)          # (rows, n, total)
        outs = []
        for s, a, o in zip(stacks, axes, offsets):
            local = s.shape[1:]
            slots = got[:, :, o:o + math.prod(local)].reshape((rows, n) + local)
            # member j's buffer is part j along `a` of the gathered buffer
            outs.append(np.moveaxis(slots, 1, 1 + a).reshape((rows,) + _gathered(local, a, n)))
        return outs

    def all_gather(self, stack: np.ndarray, members=None, axis: int = 0) -> np.ndarray:
        """Every member gets the members' buffers concatenated (member order) along ``axis``
        of the buffer."""
        f = "all_gather"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        axis = _check_axis(f, "axis", axis, stack.shape[1:])
        if plan.group_size > 1:
            _check_full(f, plan, "AllGather changes the buffer shape")
        out = self._all_gather(stack, plan, axis)
        self._record("AllGather", plan, stack, out)
        return out

    def world_stack(self, stack: np.ndarray) -> np.ndarray:
        """The stack ``(world_size, *buffer)`` of every device's buffer, in rank order, for
        *observing* a global value (``Tensor.asnumpy()``, ``print``): an AllGather over the
        world when this process holds only some devices (every process must call it, in
        the same order, as for any collective), the stack itself when it holds them all.
        Not recorded in CommReport: reading a value is not a collective of the program."""
        stack = self._check_stack("world_stack", stack)
        if len(self._local_ranks) == self._world_size:
            return stack
        plan = self.plan("all_gather", None)
        out = self._all_gather(np.ascontiguousarray(stack)[:, None], plan, 0)
        return out[0]

    def reduce_scatter(self, stack: np.ndarray, members=None, axis: int = 0,
                       op: str = "sum") -> np.ndarray:
        """Reduce each group's buffers, then member j gets part j of ``n`` along ``axis``."""
        f = "reduce_scatter"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        op = _check_op(f, op, stack.dtype)
        local = stack.shape[1:]
        axis = _check_axis(f, "axis", axis, local)
        _check_divisible(f, "axis", axis, local, plan.group_size)
        if plan.group_size > 1:
            _check_full(f, plan, "ReduceScatter changes the buffer shape")
        out = self._reduce_scatter(stack, plan, axis, op)
        self._record("ReduceScatter", plan, stack, out)
        return out

    def all_to_all(self, stack: np.ndarray, members=None, split_axis: int = 0,
                   concat_axis: int = 0) -> np.ndarray:
        """Each member splits its buffer in ``n`` parts along ``split_axis``; member j gets
        part j of every member, concatenated in member order along ``concat_axis``."""
        f = "all_to_all"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        local = stack.shape[1:]
        split_axis = _check_axis(f, "split_axis", split_axis, local)
        concat_axis = _check_axis(f, "concat_axis", concat_axis, local)
        _check_divisible(f, "split_axis", split_axis, local, plan.group_size)
        if split_axis != concat_axis and plan.group_size > 1:
            _check_full(f, plan, "AlltoAll with split_axis != concat_axis changes the buffer "
                        "shape")
        out = self._all_to_all(stack, plan, split_axis, concat_axis)
        self._record("AlltoAll", plan, stack, out)
        return out

    def broadcast(self, stack: np.ndarray, members=None, root: int = 0) -> np.ndarray:
        """Every member gets the buffer of member ``root`` (an index within the group)."""
        f = "broadcast"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        root = _check_root(f, root, plan.group_size)
        out = self._broadcast(stack, plan, root)
        self._record("Broadcast", plan, stack, out)
        return out

    def reduce(self, stack: np.ndarray, members=None, root: int = 0,
               op: str = "sum") -> np.ndarray:
        """Member ``root`` of each group gets the reduction; the others keep their input."""
        f = "reduce"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        root = _check_root(f, root, plan.group_size)
        op = _check_op(f, op, stack.dtype)
        out = self._reduce(stack, plan, root, op)
        self._record("Reduce", plan, stack, out)
        return out

    def scatter(self, stack: np.ndarray, members=None, root: int = 0,
                axis: int = 0) -> np.ndarray:
        """Member ``root``'s buffer is split in ``n`` parts along ``axis``; member j gets
        part j."""
        f = "scatter"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        root = _check_root(f, root, plan.group_size)
        local = stack.shape[1:]
        axis = _check_axis(f, "axis", axis, local)
        _check_divisible(f, "axis", axis, local, plan.group_size)
        if plan.group_size > 1:
            _check_full(f, plan, "Scatter changes the buffer shape")
        out = self._scatter(stack, plan, root, axis)
        self._record("Scatter", plan, stack, out, self._device_bytes(stack))
        return out

    def gather(self, stack: np.ndarray, members=None, root: int = 0,
               axis: int = 0) -> np.ndarray:
        """Member ``root`` gets the members' buffers concatenated along ``axis``.

        The receive buffer is meaningful at the root only (as ``MPI_Gather``); since a
        stack holds buffers of one shape, the non-root devices' buffers are zero-filled
        in the gathered shape.
        """
        f = "gather"
        stack = self._check_stack(f, stack)
        plan = self.plan(f, members)
        root = _check_root(f, root, plan.group_size)
        axis = _check_axis(f, "axis", axis, stack.shape[1:])
        if plan.group_size > 1:
            _check_full(f, plan, "Gather changes the buffer shape")
        out = self._gather(stack, plan, root, axis)
        self._record("Gather", plan, stack, out, plan.group_size * self._device_bytes(stack))
        return out

    def send_recv(self, stack: np.ndarray, pairs) -> np.ndarray:
        """For each ``(src_rank, dst_rank)`` in ``pairs``, ``dst`` receives ``src``'s buffer
        (all transfers at once: a swap works); other devices keep theirs."""
        f = "send_recv"
        stack = self._check_stack(f, stack)
        src, dst = self._check_pairs(f, pairs)
        out = self._send_recv(stack, src, dst)
        if trace._STATE.reports:
            trace.record("Send/Recv", 2, len(src),
                         self._device_bytes(stack) if len(src) else 0)
            self._note(stack, out)
        return out

    def barrier(self) -> None:
        """Wait until every device reaches this point."""

    # ------------------------------------------------- pipeline stages

    #: a pipeline stage's backend (see :meth:`stage_view`): the whole job's backend,
    #: the number of stages and this process's stage (None: every stage runs here)
    world: Optional["Backend"] = None
    stages: int = 1
    stage: Optional[int] = None

    def stage_view(self, stages: int) -> "Backend":
        """The backend one pipeline stage runs on: ``world_size // stages`` devices, the
        stage's own (stage ``s`` holds world ranks ``s * n .. s * n + n - 1``), with
        ``world`` this backend. Made once per stage count."""
        views = self.__dict__.setdefault("_stage_views", {})
        view = views.get(stages)
        if view is None:
            if not _is_int(stages) or stages < 1 or self._world_size % stages:
                raise ValueError(f"stage_view: stages={stages!r} is not valid for "
                                 f"world_size={self._world_size}; expected a divisor of "
                                 f"{self._world_size}")
            view = self._stage_view(int(stages))
            view.world, view.stages = self, int(stages)
            views[stages] = view
        return view

    def _stage_view(self, stages: int) -> "Backend":
        raise ValueError(f"pipeline parallelism: the {self.name!r} backend cannot run "
                         f"pipeline stages; use backend 'sim' or 'mpi'")

    def _check_peer(self, func: str, stage) -> int:
        if self.world is None:
            raise RuntimeError(f"{func}: this backend is not a pipeline stage's (make one "
                               f"with world.stage_view(stages))")
        if not _is_int(stage) or not 0 <= stage < self.stages:
            raise ValueError(f"{func}: stage={stage!r} is out of range for {self.stages} "
                             f"pipeline stages; expected an int in [0, {self.stages})")
        return int(stage)

    def send(self, stack: np.ndarray, stage: int, tag: int, meta=None,
             record: bool = True) -> None:
        """Send each device's buffer to the same device (same rank within the stage) of
        pipeline stage `stage`; `tag` (an int >= 0) names the message, which
        :meth:`recv` on that stage takes, with `meta` (a small picklable object that
        describes it, e.g. its layout). Recorded as "Send" (the buffer's bytes per
        device) unless not `record` (an observation, not the program's traffic). Only
        on a stage's backend (:meth:`stage_view`)."""
        f = "send"
        stage = self._check_peer(f, stage)
        stack = self._check_stack(f, stack)
        self._send(stack, stage, int(tag), meta)
        if record and trace._STATE.reports:
            trace.record("Send", 2, self._world_size, self._device_bytes(stack))

    def recv(self, stage: int, tag: int, record: bool = True):
        """``(stack, meta)``: the buffers that the same devices of pipeline stage `stage`
        sent with `tag`, and the `meta` sent with them (see :meth:`send`). Recorded as
        "Receive" unless not `record`."""
        f = "recv"
        stage = self._check_peer(f, stage)
        out, meta = self._recv(stage, int(tag))
        if record and trace._STATE.reports:
            trace.record("Receive", 2, self._world_size, self._device_bytes(out))
        return out, meta

    def wait_sends(self) -> None:
        """Wait until every buffer :meth:`send` handed over has left (a backend that
        sends asynchronously waits here; the others have nothing to wait for)."""

    def _send(self, stack, stage: int, tag: int, meta) -> None:
        raise RuntimeError(f"send: the {self.name!r} backend has no point-to-point "
                           f"transfers between pipeline stages")

    def _recv(self, stage: int, tag: int) -> np.ndarray:
        raise RuntimeError(f"recv: the {self.name!r} backend has no point-to-point "
                           f"transfers between pipeline stages")

    def _check_pairs(self, func: str, pairs) -> Tuple[np.ndarray, np.ndarray]:
        expected = "a sequence of (src_rank, dst_rank) int pairs"
        try:
            items = list(pairs)
        except TypeError:
            raise TypeError(f"{func}: pairs={pairs!r} is not valid; expected {expected}") \
                from None
        src, dst = [], []
        for i, p in enumerate(items):
            if (not isinstance(p, (tuple, list, np.ndarray)) or len(p) != 2
                    or not all(_is_int(r) for r in p)):
                raise TypeError(f"{func}: pairs[{i}]={p!r} is not valid; expected {expected}")
            for r in p:
                if not 0 <= r < self._world_size:
                    raise ValueError(f"{func}: pairs[{i}]={tuple(int(x) for x in p)!r} names "
                                     f"rank {int(r)}, out of range for world_size="
                                     f"{self._world_size}; expected ranks in "
                                     f"[0, {self._world_size})")
            if int(p[1]) in dst:
                raise ValueError(f"{func}: rank {int(p[1])} receives twice (pairs[{i}]="
                                 f"{tuple(int(x) for x in p)!r}); expected each dst_rank at "
                                 "most once")
            src.append(int(p[0]))
            dst.append(int(p[1]))
        return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)

    # ------------------------------------------------------ implementations

    @abc.abstractmethod
    def _all_reduce(self, stack, plan: GroupPlan, op: str, algorithm: str) -> np.ndarray: ...

    @abc.abstractmethod
    def _all_gather(self, stack, plan: GroupPlan, axis: int) -> np.ndarray: ...

    @abc.abstractmethod
    def _reduce_scatter(self, stack, plan: GroupPlan, axis: int, op: str) -> np.ndarray: ...

    @abc.abstractmethod
    def _all_to_all(self, stack, plan: GroupPlan, split_axis: int,
                    concat_axis: int) -> np.ndarray: ...

    @abc.abstractmethod
    def _broadcast(self, stack, plan: GroupPlan, root: int) -> np.ndarray: ...

    @abc.abstractmethod
    def _reduce(self, stack, plan: GroupPlan, root: int, op: str) -> np.ndarray: ...

    @abc.abstractmethod
    def _scatter(self, stack, plan: GroupPlan, root: int, axis: int) -> np.ndarray: ...

    @abc.abstractmethod
    def _gather(self, stack, plan: GroupPlan, root: int, axis: int) -> np.ndarray: ...

    @abc.abstractmethod
    def _send_recv(self, stack, src: np.ndarray, dst: np.ndarray) -> np.ndarray: ...
