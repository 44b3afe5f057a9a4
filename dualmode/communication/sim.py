"""Backend "sim": all ``device_num`` devices in this process, one stack for all of them.

Every collective is one numpy computation over the stack (no Python loop over devices):

* When the groups are the axis groups of a device matrix (:func:`axis_groups`, or any
  ``members`` equal to them), the stack is viewed as ``device_matrix + local_shape`` and
  reduced / transposed over the group axes; otherwise the groups are fancy-indexed as
  ``stack[members]``.
* A result replicated on every device of the world (AllReduce, AllGather and Broadcast
  over one group holding every rank) is returned as a read-only ``np.broadcast_to``
  view of one buffer instead of ``N`` copies. A result replicated within several groups
  cannot be a strided view of shape ``(N, ...)``, so it is written once per device.
* The whole-world direct AllReduce of float32/float64/int32/int64 buffers runs the
  Cython kernel ``_comm.reduce_rows`` (one pass over the stack, output kept in cache).
  A stride-0 stack is read once: the mean of equal buffers is one of them, and the sum
  of the equal shares of a pending sum made by :func:`equal_shares` (a data-parallel
  gradient computed once over every device's rows) is the total they were made from,
  returned without a pass.

``all_reduce(..., algorithm="ring")`` runs the textbook ring instead: the flattened
buffer of each group is cut in ``n`` chunks; ``n - 1`` reduce-scatter steps, then
``n - 1`` all-gather steps, each step being every device's transfer at once
(``_comm.ring_reduce_scatter_step`` / ``ring_all_gather_step``, all groups per call).
Integer results, max and min equal the direct algorithm's exactly; float sums and
products are added in another order (chunk ``c`` starts at device ``c``), so they agree
within rounding: ``|ring - direct| <= 2 (n - 1) eps sum_i |x_i|`` elementwise (eps of the
dtype; the tests use ``rtol=1e-5`` for float32 and ``1e-12`` for float64, with ``atol``
scaled by ``n``).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .._core import _comm, _fusion
from .._core._dp import broadcast_view, equal_shares
from .._core._tensor import Deferred
from .._core.fusion_reference import fusion_offsets as fusion_offsets_reference
from .backend import Backend, register_backend
from .groups import GroupPlan
from .totals import group_totals, known_totals, share_of

__all__ = ["SimBackend", "replicated_view", "broadcast_view", "share_of", "equal_shares",
           "shares_total"]


def replicated_view(value: np.ndarray, n: int) -> np.ndarray:
    """A read-only ``(n, *value.shape)`` view of one buffer (stride 0 on the device
    axis): every device holding the same value, stored once."""
    return broadcast_view(value[None], (n,) + value.shape)


def shares_total(stack: np.ndarray):
    """The total of `stack` when it is remembered as pending sums over the whole world
    (:func:`equal_shares`, or a deferred stack of such shares), read-only, else None."""
    found = known_totals(stack, stack.shape[:1], (0,))
    return None if found is None else found[0]


_UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
          "prod": np.multiply}
#: stacks of at most this many bytes per device are "small" in a fused AllReduce: the
#: pure-Python form packs runs of them (the copy is cheaper than a reduction call each)
#: and reduces larger ones in place; the C form reduces every stack in place and, as
#: the Python form, reads remembered totals (or goes through numpy for strided rows)
#: only for the larger ones
_PACK_BYTES = 64 * 1024
_KERNEL_DTYPES = frozenset(np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64))


def _split(x: np.ndarray, lead: int, axis: int, n: int) -> np.ndarray:
    """(*lead_dims, *local) -> (*lead_dims, n, *local with local[axis] // n): part j of
    every buffer along ``axis`` moved to a new axis right after the leading dims."""
    shape = x.shape
    a = lead + axis
    y = x.reshape(shape[:a] + (n, shape[a] // n) + shape[a + 1:])
    if a == lead:
        return y
    # np.moveaxis(y, a, lead), without its argument handling
    return y.transpose(tuple(range(lead)) + (a,) + tuple(range(lead, a))
                       + tuple(range(a + 1, y.ndim)))


def _concat_members(x: np.ndarray, axis: int) -> np.ndarray:
    """(G, n, *local) -> (G, *local with local[axis] * n): the n buffers of each group
    concatenated in member order along ``axis``."""
    g, n = x.shape[:2]
    local = x.shape[2:]
    y = np.moveaxis(x, 1, 1 + axis)
    return y.reshape((g,) + local[:axis] + (n * local[axis],) + local[axis + 1:])


class SimBackend(Backend):
    """Simulated devices: ``local_ranks`` is ``0 .. device_num - 1`` and a stack holds
    every device's buffer.

    Parameters
    ----------
    device_num : int
        Number of devices, >= 1.
    """

    name = "sim"
    all_reduce_algorithms = ("direct", "ring")
    reads_deferred = True

    def __init__(self, device_num: int):
        if (not isinstance(device_num, numbers.Integral) or isinstance(device_num, bool)
                or device_num < 1):
            raise ValueError(f"SimBackend: device_num={device_num!r} is not valid; expected "
                             "an int >= 1")
        super().__init__(int(device_num), range(int(device_num)))

    # ----------------------------------------------------- group plumbing

    @staticmethod
    def _dm_view(x: np.ndarray, plan: GroupPlan) -> np.ndarray:
        """x (N, *local) viewed as (*other axes, *group axes, *local)."""
        k = len(plan.device_matrix)
        local = x.shape[1:]
        perm = plan.perm + tuple(range(k, k + len(local)))
        return x.reshape(plan.device_matrix + local).transpose(perm)

    def _grouped(self, stack: np.ndarray, plan: GroupPlan) -> np.ndarray:
        """(G, n, *local): the buffers of each group in member order (a view if it can be)."""
        local = stack.shape[1:]
        if plan.identity:
            return stack.reshape((plan.num_groups, plan.group_size) + local)
        if plan.device_matrix is not None:
            return self._dm_view(stack, plan).reshape(
                (plan.num_groups, plan.group_size) + local)
        return stack[plan.members]

    def _write(self, out: np.ndarray, plan: GroupPlan, per_member: np.ndarray) -> None:
        """out[members[g, j]] = per_member[g, j]."""
        local = out.shape[1:]
        if plan.identity:
            out.reshape(per_member.shape)[...] = per_member
        elif plan.device_matrix is not None:
            self._dm_view(out, plan)[...] = per_member.reshape(
                plan.other_sizes + plan.group_sizes + local)
        else:
            out[plan.members] = per_member

    def _fill(self, out: np.ndarray, plan: GroupPlan, per_group: np.ndarray) -> None:
        """out[members[g, j]] = per_group[g] for every member j."""
        local = out.shape[1:]
        if plan.device_matrix is not None:
            ones = (1,) * len(plan.group_axes)
            self._dm_view(out, plan)[...] = per_group.reshape(plan.other_sizes + ones + local)
        else:
            out[plan.members] = per_group[:, None]

    @staticmethod
    def _new_out(stack: np.ndarray, plan: GroupPlan, local=None) -> np.ndarray:
        """The output stack: uninitialised when every rank is written, else a copy of the
        input (ranks outside the groups keep their buffers)."""
        if plan.full:
            shape = stack.shape if local is None else (stack.shape[0],) + tuple(local)
            return np.empty(shape, dtype=stack.dtype)
        return stack.copy()

    def _reduce_groups(self, stack: np.ndarray, plan: GroupPlan, op: str) -> np.ndarray:
        """(G, *local): the reduction of each group's buffers (a fresh array, or a
        read-only view of the totals recorded for pending sums over exactly these groups
        by :func:`dualmode.communication.totals.remember_totals`)."""
        local = stack.shape[1:]
        ufunc = _UFUNC[op]
        red = None
        if op in ("sum", "mean") and plan.full:
            red = group_totals(stack, plan.members, plan.device_matrix, plan.group_axes)
        if red is not None:                     # each group's sum, without reading shares
            if op == "mean":
                red = np.true_divide(red, plan.group_size, dtype=stack.dtype)
            return red
        if plan.group_size == 1:
            red = stack[plan.members[:, 0]]
        elif plan.num_groups == 1 and plan.full and op == "mean" and stack.strides[0] == 0:
            return np.array(stack[:1])          # the mean of identical buffers is one of them
        elif plan.num_groups == 1 and plan.full:
            red = self._reduce_all(stack, op)[None]
        elif plan.device_matrix is not None:
            red = ufunc.reduce(stack.reshape(plan.device_matrix + local),
                               axis=plan.group_axes, dtype=stack.dtype)
            red = red.reshape((plan.num_groups,) + local)
        else:
            red = ufunc.reduce(stack[plan.members], axis=1, dtype=stack.dtype)
        if op == "mean" and plan.group_size > 1:
            np.divide(red, plan.group_size, out=red)
        return red

    @staticmethod
    def _reduce_all(stack: np.ndarray, op: str, out=None) -> np.ndarray:
        """(*local): the reduction over the whole stack (Cython kernel when it applies),
        written into `out` (a C-contiguous (*local) buffer) when given."""
        n = stack.shape[0]
        total = shares_total(stack) if op in ("sum", "mean") else None
        if total is not None:                  # equal shares: the sum is their total
            if out is None and op == "sum":
                return total                   # read-only, as every result
            if out is None:
                out = np.empty(stack.shape[1:], dtype=stack.dtype)
            np.copyto(out, total)              # the caller divides a mean's sum by n
            return out
        if out is None:
            out = np.empty(stack.shape[1:], dtype=stack.dtype)
        if n > 1 and stack.strides[0] == 0:
            # every device holds the same buffer (a stride-0 view): no need to read it n times
            one = stack[0]
            if op in ("sum", "mean"):          # the caller divides a mean's sum by n
                return np.multiply(one, n, out=out, dtype=stack.dtype)
            if op == "prod":
                return np.power(one, n, out=out, dtype=stack.dtype)
            np.copyto(out, one)                # max, min of identical values
            return out
        if stack.dtype in _KERNEL_DTYPES and stack.flags.c_contiguous:
            m = math.prod(stack.shape[1:])
            _comm.reduce_rows(stack.reshape(n, m), out.reshape(m),
                              "sum" if op == "mean" else op)
            return out
        return _UFUNC[op].reduce(stack, axis=0, dtype=stack.dtype, out=out)

    def _all_reduce_fused(self, stacks, plan, op):
        """Over the whole world, every result is one buffer every device sees as a
        stride-0 view. A stack whose devices all hold one buffer (a stride-0 view: a
        replicated value, equal shares) has a result of its own, read without a pass
        when it can be (the mean of equal buffers is one of them, the sum of
        :func:`equal_shares` their total; a deferred stack of such shares, a
        data-parallel gradient, is never written). The others share one row: each is
        reduced straight into its slice of it (no packing copy: the bytes touched are
        those of unfused AllReduces). For float32/float64/int32/int64 stacks the loop
        over the stacks runs in C (``_core._fusion.whole_world_all_reduce``: one
        GIL-free pass of the row kernel over every stack, the results' views made with
        the numpy C API); its pure-Python reference, which also serves the other
        dtypes, is :meth:`_all_reduce_fused_reference`. Over other groups the stacks
        are packed into one buffer and reduced at once, the packing and the results'
        views in C (``_core._fusion.grouped_all_reduce``; its reference is
        :meth:`Backend._all_reduce_fused`)."""
        if not (plan.num_groups == 1 and plan.full and plan.group_size > 1):
            return _fusion.grouped_all_reduce(stacks, plan, op, self)
        dtype = stacks[0].dtype
        if dtype not in _KERNEL_DTYPES:
            return self._all_reduce_fused_reference(stacks, plan, op)
        return _fusion.whole_world_all_reduce(stacks, stacks[0].shape[0], op,
                                              _PACK_BYTES // dtype.itemsize, self)

    def _deferred_result(self, s, op):
        """The sum or mean over the whole world of a deferred stack `s` known as equal
        shares (the sum is their total, the mean one share: no pass, nothing written),
        a read-only stride-0 view; None when its total is not known."""
        total = shares_total(s)
        if total is None:
            return None
        n = s.shape[0]
        return replicated_view(total if op == "sum" else share_of(total, n), n)

    def _replicated_result(self, s, op):
        """The reduction over the whole world of a stack `s` stored once for every
        device (stride 0), a read-only stride-0 view: the mean of equal buffers is one
        of them; the other ops read one buffer (:meth:`_reduce_all`)."""
        n = s.shape[0]
        return replicated_view(s[0] if op == "mean" else self._reduce_all(s, op), n)

    def _all_reduce_fused_reference(self, stacks, plan, op):
        """The pure-Python form of :meth:`_all_reduce_fused` (its reference in the
        tests, and its path for dtypes the row kernel does not take): over the whole
        world, a large stack is reduced straight into its slice of the row; runs of
        small stacks are packed first, so they cost one reduction call per run."""
        whole = plan.num_groups == 1 and plan.full and plan.group_size > 1
        n = stacks[0].shape[0]
        outs = [None] * len(stacks)
        stacks = list(stacks)
        for i, s in enumerate(stacks):
            if isinstance(s, Deferred):
                # a stack not written yet: equal shares whose total is known need no
                # pass (the sum is the total, the mean one share); others are written
                if whole and op in ("sum", "mean"):
                    outs[i] = self._deferred_result(s, op)
                if outs[i] is None:
                    stacks[i] = s.materialize()
        if not whole:
            return super()._all_reduce_fused(stacks, plan, op)
        rowed = []                                 # positions of the stacks in the row
        for i, s in enumerate(stacks):
            if outs[i] is not None:
                continue
            if s.strides[0] == 0:
                outs[i] = self._replicated_result(s, op)
            else:
                rowed.append(i)
        if not rowed:
            return outs
        offsets, total = fusion_offsets_reference([stacks[i] for i in rowed])
        ends = offsets[1:] + [total]               # member k: row[offsets[k]:ends[k]]
        row = np.empty(total, dtype=stacks[0].dtype)
        pack_elems = _PACK_BYTES // row.itemsize
        run = []                                   # (position, offset) of small stacks

        def flush(hi):                             # hi: where the run's last member ends
            if run:
                lo = run[0][1]
                buf = np.empty((n, hi - lo), dtype=row.dtype)
                _comm.pack([np.ascontiguousarray(stacks[i]) for i, _ in run], buf,
                           [o - lo for _, o in run])
                self._reduce_all(buf, op, row[lo:hi])
                if op == "mean":
                    np.divide(row[lo:hi], n, out=row[lo:hi])
                run.clear()

        for i, o, e in zip(rowed, offsets, ends):
            if e - o <= pack_elems:
                run.append((i, o))
                continue
            flush(o)
            s = stacks[i]
            piece = row[o:e].reshape(s.shape[1:])
            self._reduce_all(s, op, piece)
            if op == "mean":
                np.divide(piece, n, out=piece)
        flush(total)
        full = replicated_view(row, n)
        for i, o, e in zip(rowed, offsets, ends):
            outs[i] = full[:, o:e].reshape(stacks[i].shape)
        return outs

    def _reduce_scatter_fused(self, stacks, plan, axes, op):
        """Each stack reduce-scattered on its own (one numpy pass each, no packing copy:
        every device's buffers are in this process); recorded as one collective. Over
        the whole world, each result is a view of its stack's reduction (as the unfused
        direct moves: the global value, then device j's part of it), when the members
        are in rank order (device j is member j)."""
        if not (plan.num_groups == 1 and plan.identity) or plan.group_size == 1:
            return [self._reduce_scatter(s, plan, a, op) for s, a in zip(stacks, axes)]
        n = plan.group_size
        outs = []
        for s, a in zip(stacks, axes):
            if op == "mean" and s.strides[0] == 0:
                red = s[0]                     # the mean of identical buffers
            else:
                red = self._reduce_all(s, op)  # equal shares: their total, no pass
                if op == "mean":
                    np.divide(red, n, out=red)
            outs.append(_split(red, 0, a, n))
        return outs

    def _all_gather_fused(self, stacks, plan, axes):
        """Each stack gathered on its own (a stride-0 view of one gathered buffer over
        one group of every device, no packing copy); recorded as one collective."""
        return [self._all_gather(s, plan, a) for s, a in zip(stacks, axes)]

    # ---------------------------------------------------------- collectives

    def _all_reduce(self, stack, plan, op, algorithm):
        if algorithm == "ring" and plan.group_size > 1:
            return self._ring_all_reduce(stack, plan, op)
        red = self._reduce_groups(stack, plan, op)
        if plan.num_groups == 1 and plan.full:
            return replicated_view(red[0], stack.shape[0])
        out = self._new_out(stack, plan)
        self._fill(out, plan, red)
        return out

    def _ring_all_reduce(self, stack, plan, op):
        if stack.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"all_reduce: algorithm='ring' supports float32, float64, int32 "
                            f"and int64 buffers, got dtype {stack.dtype}; use "
                            "algorithm='direct'")
        g, n = plan.num_groups, plan.group_size
        local = stack.shape[1:]
        m = math.prod(local)
        work = np.array(self._grouped(stack, plan).reshape(g, n, m), order="C", copy=True)
        bounds = (np.arange(n + 1, dtype=np.int64) * m) // n
        kop = "sum" if op == "mean" else op
        for step in range(n - 1):
            _comm.ring_reduce_scatter_step(work, bounds, step, kop)
        for step in range(n - 1):
            _comm.ring_all_gather_step(work, bounds, step)
        if op == "mean":
            np.divide(work, n, out=work)
        out = self._new_out(stack, plan)
        self._write(out, plan, work.reshape((g, n) + local))
        return out

    def _all_gather(self, stack, plan, axis):
        if plan.group_size == 1:
            return stack.copy()
        gathered = _concat_members(self._grouped(stack, plan), axis)
        shape = (stack.shape[0],) + gathered.shape[1:]
        if plan.num_groups == 1:
            return replicated_view(gathered[0], shape[0])
        out = np.empty(shape, dtype=stack.dtype)
        self._fill(out, plan, gathered)
        return out

    def _reduce_scatter(self, stack, plan, axis, op):
        red = self._reduce_groups(stack, plan, op)
        parts = _split(red, 1, axis, plan.group_size)      # (G, n, *local_out)
        if plan.identity:
            # a view of the reduced buffers when their strides allow (one group: always)
            return parts.reshape((stack.shape[0],) + parts.shape[2:])
        out = np.empty((stack.shape[0],) + parts.shape[2:], dtype=stack.dtype)
        self._write(out, plan, parts)
        return out

    def _all_to_all(self, stack, plan, split_axis, concat_axis):
        n = plan.group_size
        if n == 1:
            return stack.copy()
        x = _split(self._grouped(stack, plan), 2, split_axis, n)  # (G, src, dst, *part)
        x = np.moveaxis(x, 1, 2)                                  # (G, dst, src, *part)
        x = np.moveaxis(x, 2, 2 + concat_axis)                    # src next to concat dim
        part = x.shape[2:]
        local = part[:concat_axis] + (n * part[concat_axis + 1],) + part[concat_axis + 2:]
        res = x.reshape((plan.num_groups, n) + local)
        out = self._new_out(stack, plan, local)
        self._write(out, plan, res)
        return out

    def _broadcast(self, stack, plan, root):
        src = stack[plan.members[:, root]]                      # (G, *local), a copy
        if plan.num_groups == 1 and plan.full:
            return replicated_view(src[0], stack.shape[0])
        out = self._new_out(stack, plan)
        self._fill(out, plan, src)
        return out

    def _reduce(self, stack, plan, root, op):
        red = self._reduce_groups(stack, plan, op)
        out = stack.copy()
        out[plan.members[:, root]] = red
        return out

    def _scatter(self, stack, plan, root, axis):
        if plan.group_size == 1:
            return stack.copy()
        src = stack[plan.members[:, root]]
        parts = _split(src, 1, axis, plan.group_size)
        out = np.empty((stack.shape[0],) + parts.shape[2:], dtype=stack.dtype)
        self._write(out, plan, parts)
        return out

    def _gather(self, stack, plan, root, axis):
        if plan.group_size == 1:
            return stack.copy()
        gathered = _concat_members(self._grouped(stack, plan), axis)
        out = np.zeros((stack.shape[0],) + gathered.shape[1:], dtype=stack.dtype)
        out[plan.members[:, root]] = gathered
        return out

    def _send_recv(self, stack, src, dst):
        out = stack.copy()
        if len(src):
            out[dst] = stack[src]
        return out

    # ------------------------------------------------- pipeline stages
    # Every stage runs in this process, on one stage view of world_size // stages
    # devices: a Send leaves the stack in a mailbox (no copy) until the Receive of the
    # other stage takes it.

    def _stage_view(self, stages: int) -> "SimBackend":
        view = SimBackend(self.world_size // stages)
        view._mail = {}
        return view

    def _send(self, stack, stage: int, tag: int, meta) -> None:
        self._mail[tag] = (stack, meta)

    def _recv(self, stage: int, tag: int):
        out = self._mail.pop(tag, None)
        if out is None:
            raise RuntimeError(f"recv: no message with tag {tag} was sent from stage "
                               f"{stage}")
        return out


register_backend("sim", SimBackend)
