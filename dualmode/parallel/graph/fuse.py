"""Fusion: the gradient AllReduces of a train step packed into buckets.

Lowering (lower.py) puts the gradient communication of an optimizer update into the IR
as MOVE nodes right before the update (``attrs["reason"] == "gradient"``). Many of them
resolve a pending sum: an AllReduce over the devices of the sum's axes. This pass
replaces each bucket of those with one :data:`~.ir.FUSED` node: one collective for the
bucket (:meth:`Backend.all_reduce_fused`; on simulated devices it costs no packing
copy). Buckets follow ``comm_fusion`` / ``all_reduce_fusion_config``
(:func:`~dualmode.parallel.grad_reduce.fusion_buckets`):

* the data-parallel gradients (pending over every device) exactly as the eager
  optimizer buckets them, in parameter order, so a compiled data-parallel step makes
  the same collectives as the same step run eagerly;
* the others (a sharded network's gradients pending over some device axes; the eager
  optimizer resolves those one by one) per group of devices, in parameter order.

The gradient moves before one update read values computed before them, so they may be
reordered freely: the fused nodes come first, the other moves (e.g. a ReduceScatter into
a sharded weight's layout) after.
"""
from __future__ import annotations

import math

from ..grad_reduce import bucket_name, fusion_buckets, is_dp_partial
from .ir import FUSED, MOVE, Graph, Node, verify

__all__ = ["fuse_gradients"]


def _gradient_move(node) -> bool:
    return node.op == MOVE and node.attrs.get("reason") == "gradient"


def _resolve(node) -> bool:
    return node.attrs["kind"] == "resolve"


def _data_parallel(node) -> bool:
    return _resolve(node) and is_dp_partial(node.attrs["src"])


def fuse_gradients(graph: Graph, buckets=fusion_buckets) -> Graph:
    """`graph` with each bucket of gradient AllReduces one FUSED node.
    `buckets(sizes)` splits the gradient positions by their bytes per device."""
    nodes, out, k, fused = list(graph.nodes), [], 0, 0
    while k < len(nodes):
        if not _gradient_move(nodes[k]):
            out.append(nodes[k])
            k += 1
            continue
        run = []
        while k < len(nodes) and _gradient_move(nodes[k]):
            run.append(nodes[k])
            k += 1
        dp = [n for n in run if _data_parallel(n)]
        groups = {}                              # the other resolves, per device group
        for n in run:
            if _resolve(n) and not _data_parallel(n):
                src = n.attrs["src"]
                groups.setdefault((src.device_matrix, src.partial), []).append(n)
        fusible = {id(n) for n in dp}
        for members in [dp] + list(groups.values()):
            fusible.update(id(n) for n in members)
            for bucket in buckets([_device_bytes(n) for n in members]):
                chosen = [members[i] for i in bucket]
                if len(chosen) == 1 or len({n.outputs[0].dtype for n in chosen}) > 1:
                    out.extend(chosen)           # one AllReduce each, as unfused
                    continue
                out.append(_fused_node(chosen, f"FusedAllReduce-{fused}"))
                fused += 1
        out.extend(n for n in run if id(n) not in fusible)
    return verify(graph.replace(nodes=tuple(out)))


def _device_bytes(node) -> int:
    return math.prod(node.attrs["src"].local_shape) * node.outputs[0].dtype.itemsize


def _fused_node(members, name) -> Node:
    first = members[0].attrs
    attrs = {"src": first["src"], "for": first["for"],
             "cause": bucket_name([n.attrs["cause"] for n in members]),
             "dsts": tuple(n.attrs["dst"] for n in members),
             "scales": tuple(n.attrs.get("scale") for n in members),
             "srcs": tuple(n.attrs["src"] for n in members)}
    return Node(FUSED, attrs, tuple(n.inputs[0] for n in members),
                tuple(n.outputs[0] for n in members), name, backward=True)
