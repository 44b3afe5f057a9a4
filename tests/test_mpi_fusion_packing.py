"""The packing helpers of the "mpi" backend's fused ReduceScatter and AllGather, without
MPI: ``_pack_parts`` lays each stack's ``n`` parts part-major into one table,
``_unpack_gathered`` cuts every member's packed bucket back into each stack's gathered
buffer, and ``_place_gathered`` writes one member's buffers straight into that layout
-- checked against ``np.split`` / ``np.concatenate`` of each stack alone, for mixed
split axes, non-contiguous, replicated (stride-0) and empty stacks."""
import numpy as np
import pytest

from dualmode.communication.backend import fusion_offsets
from dualmode.communication.mpi import _pack_parts, _place_gathered, _unpack_gathered


def _stacks(rng, shapes, n):
    out = [rng.standard_normal((1,) + s).astype(np.float32) for s in shapes]
    wide = rng.standard_normal((1, 2 * n, 6)).astype(np.float32)
    out.append(wide[:, ::2, ::2])                                  # non-contiguous (n, 3)
    out.append(np.broadcast_to(rng.standard_normal(2 * n).astype(np.float32), (1, 2 * n)))
    out.append(np.zeros((1, 0, n), np.float32))                    # empty
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pack_parts_puts_part_j_of_every_stack_in_row_j(n):
    rng = np.random.default_rng(n)
    stacks = _stacks(rng, [(n, 3), (2, 2 * n), (3 * n,), (2, 3, n)], n)
    axes = [0, 1, 0, 2, 0, 0, 1]
    chunks = [s[0].size // n for s in stacks]
    offsets = list(np.cumsum([0] + chunks))
    table = np.full((n, offsets[-1]), np.nan, np.float32)
    _pack_parts(stacks, axes, offsets, table, n)
    for s, a, o, c in zip(stacks, axes, offsets, chunks):
        for j, part in enumerate(np.split(s[0], n, axis=a)):
            np.testing.assert_array_equal(table[j, o:o + c], part.ravel())
    assert not np.isnan(table).any()                               # every element written


@pytest.mark.parametrize("n", [1, 2, 4])
def test_unpack_gathered_concatenates_each_stack_along_its_axis(n):
    rng = np.random.default_rng(10 + n)
    stacks = _stacks(rng, [(2, 3), (3, 5), (7,), (2, 2, 3)], n)
    axes = [0, 1, 0, 2, 1, 0, 0]
    offsets, total = fusion_offsets(stacks)
    offsets.append(total)
    members = [rng.standard_normal((1,) + s.shape[1:]).astype(np.float32) for s in stacks]
    bufs = [[members[i] + j for i in range(len(stacks))] for j in range(n)]   # member j's
    table = np.empty((n, total), np.float32)
    for j in range(n):
        for b, o, hi in zip(bufs[j], offsets, offsets[1:]):
            table[j, o:hi] = b.ravel()
    out = np.full((1, n * total), np.nan, np.float32)
    res = _unpack_gathered(table, stacks, axes, offsets, out)
    for i, (r, a) in enumerate(zip(res, axes)):
        want = np.concatenate([bufs[j][i][0] for j in range(n)], axis=a)
        assert r.shape == (1,) + want.shape
        np.testing.assert_array_equal(r[0], want)
        assert r.size == 0 or np.shares_memory(r, out)             # a view of the buffer
    assert not np.isnan(out).any()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_place_gathered_writes_member_j_where_unpack_gathered_puts_it(n):
    rng = np.random.default_rng(20 + n)
    stacks = _stacks(rng, [(2, 3), (3, 5), (7,), (2, 2, 3)], n)
    axes = [0, 1, 0, 2, 1, 0, 0]
    offsets, total = fusion_offsets(stacks)
    offsets.append(total)
    bufs = [[rng.standard_normal(s.shape).astype(np.float32) for s in stacks]
            for _ in range(n)]                                     # member j's buffers
    dst = np.full((1, n * total), np.nan, np.float32)
    for j in range(n):
        _place_gathered(bufs[j], axes, offsets, dst, j, n)
    assert not np.isnan(dst).any()                                 # every element written
    table = np.stack([np.concatenate([b.ravel() for b in bufs[j]]) for j in range(n)])
    want = np.empty_like(dst)
    _unpack_gathered(table, stacks, axes, offsets, want)
    np.testing.assert_array_equal(dst, want)
    for i, a in enumerate(axes):
        o, hi = offsets[i], offsets[i + 1]
        got = dst[0, n * o:n * hi].reshape(np.concatenate([bufs[j][i][0] for j in range(n)],
                                                          axis=a).shape)
        np.testing.assert_array_equal(got, np.concatenate([bufs[j][i][0] for j in range(n)],
                                                          axis=a))
