"""Fusion: collectives of one kind packed into buckets, one collective per bucket.

Three kinds of communication are fused, each per its ``comm_fusion`` entry (buckets by
:func:`~dualmode.parallel.grad_reduce.fusion_buckets`; without an entry every collective
stays on its own, as unfused):

* **Gradient AllReduces** (``"allreduce"``, or ``all_reduce_fusion_config``). Lowering
  (lower.py) puts the gradient communication of an optimizer update into the IR as MOVE
  nodes right before the update (``attrs["reason"] == "gradient"``). Many of them resolve
  a pending sum: an AllReduce over the devices of the sum's axes. Each bucket becomes one
  :data:`~.ir.FUSED` node (:meth:`Backend.all_reduce_fused`; on simulated devices it
  costs no packing copy): the data-parallel gradients (pending over every device)
  exactly as the eager optimizer buckets them, in parameter order, so a compiled
  data-parallel step makes the same collectives as the same step run eagerly; the
  others (a sharded network's gradients pending over some device axes) per group of
  devices, in parameter order, as the eager optimizer buckets them too.
* **Gradient ReduceScatters** (``"reducescatter"``): a gradient pending over some
  devices that moves into its weight's layout split over the same devices is one
  ReduceScatter (a plan of that one step). Per group of devices and dtype, each bucket
  becomes one :data:`~.ir.FUSED_RS` node (:meth:`Backend.reduce_scatter_fused`). A
  bucket's size is the members' input (unreduced) bytes per device. The eager optimizer
  makes the same buckets with the same helpers
  (:func:`~dualmode.parallel.grad_reduce.fuse_gradient_moves`).

  The gradient moves before one update read values computed before them, so they may
  be reordered freely: the fused AllReduces come first, then the fused ReduceScatters,
  then the other moves.
* **Parameter AllGathers** (``"allgather"``): a parameter stored sharded (its first
  sharded consumer's layout, or ``parameter_plan``) and read whole, or less split, by
  another op is moved by one AllGather before that op (forward, or again in the
  backward pass). Per group of devices and dtype, and between two optimizer updates
  (which change the parameters), each bucket becomes one :data:`~.ir.FUSED_AG` node
  (:meth:`Backend.all_gather_fused`) placed where its first member was: every member's
  input is a parameter, available from the start. With ``"allgather"`` configured, the
  same parameter gathered into the same layout twice between two updates (by two
  consumers, or again in the backward pass) is gathered once; its later uses read that
  result. A bucket's size is the members' gathered bytes per device.
"""
from __future__ import annotations

import math

from ... import context
from ..grad_reduce import (bucket_name, fused_bucket, fusion_buckets, grouped_buckets,
                           is_dp_partial, resolve_key, single_step, step_group)
from .ir import (CALL, FUSED, FUSED_AG, FUSED_RS, MOVE, Graph, Node, Ref, map_leaves,
                 verify)

__all__ = ["fuse_communication", "fuse_gradients", "fuse_parameter_gathers"]


def fuse_communication(graph: Graph, buckets=fusion_buckets) -> Graph:
    """`graph` with its gradient AllReduces, gradient ReduceScatters and parameter
    AllGathers fused per the ``comm_fusion`` settings. `buckets(sizes, op)` splits
    positions by their bytes per device for ``op`` ("allreduce", "reducescatter",
    "allgather")."""
    return fuse_parameter_gathers(fuse_gradients(graph, buckets), buckets)


def _gradient_move(node) -> bool:
    return node.op == MOVE and node.attrs.get("reason") == "gradient"


def _resolve(node) -> bool:
    return node.attrs["kind"] == "resolve"


def _data_parallel(node) -> bool:
    return _resolve(node) and is_dp_partial(node.attrs["src"])


def _one_step(node, kind):
    """The step of a MOVE whose plan is exactly one `kind` collective, else None."""
    if node.op != MOVE or node.attrs["kind"] != "move":
        return None
    return single_step(node.attrs["plan"], kind)


def _group(node, step):
    """(key, members): the device groups `step` runs over, with the dtype, as a
    hashable key (grad_reduce.step_group, shared with the eager optimizer)."""
    return step_group(node.attrs["plan"], step, node.outputs[0].dtype)


def fuse_gradients(graph: Graph, buckets=fusion_buckets) -> Graph:
    """`graph` with each bucket of gradient AllReduces one FUSED node and each bucket of
    gradient ReduceScatters one FUSED_RS node (buckets made by the helpers of
    grad_reduce.py the eager optimizer uses too)."""
    nodes, out, k = list(graph.nodes), [], 0
    count = {FUSED: 0, FUSED_RS: 0}
    while k < len(nodes):
        if not _gradient_move(nodes[k]):
            out.append(nodes[k])
            k += 1
            continue
        run = []
        while k < len(nodes) and _gradient_move(nodes[k]):
            run.append(nodes[k])
            k += 1
        sizes = [_device_bytes(n) for n in run]
        dp = [0 if _data_parallel(n) else None for n in run]
        # the other resolves, per device group; the ReduceScatters, per group and dtype
        others = [resolve_key(n.attrs["src"]) if _resolve(n) and not _data_parallel(n)
                  else None for n in run]
        groups = [_group(n, step) if (step := _one_step(n, "ReduceScatter")) is not None
                  else None for n in run]
        fusible = set()
        for bucket in grouped_buckets(dp, sizes, "allreduce", buckets) + \
                grouped_buckets(others, sizes, "allreduce", buckets):
            chosen = [run[i] for i in bucket]
            fusible.update(id(n) for n in chosen)
            if not fused_bucket([n.outputs[0].dtype for n in chosen]):
                out.extend(chosen)               # one AllReduce each, as unfused
                continue
            out.append(_fused_node(chosen, f"{FUSED}-{count[FUSED]}"))
            count[FUSED] += 1
        keys = [g[0] if g is not None else None for g in groups]
        for bucket in grouped_buckets(keys, sizes, "reducescatter", buckets):
            chosen = [run[i] for i in bucket]
            fusible.update(id(n) for n in chosen)
            if len(chosen) == 1:
                out.extend(chosen)
                continue
            out.append(_fused_collective(FUSED_RS, chosen, groups[bucket[0]][1], "gradients",
                                         f"{FUSED_RS}-{count[FUSED_RS]}"))
            count[FUSED_RS] += 1
        out.extend(n for n in run if id(n) not in fusible)
    return verify(graph.replace(nodes=tuple(out)))


def _device_bytes(node) -> int:
    """A member's bytes per device in its fusion buffer: the input of an AllReduce or a
    ReduceScatter, the gathered result of an AllGather."""
    lay = node.attrs["dst" if node.op == MOVE and _one_step(node, "AllGather") is not None
                     else "src"]
    return math.prod(lay.local_shape) * node.outputs[0].dtype.itemsize


def _fused_node(members, name) -> Node:
    first = members[0].attrs
    attrs = {"src": first["src"], "for": first["for"],
             "cause": bucket_name([n.attrs["cause"] for n in members]),
             "dsts": tuple(n.attrs["dst"] for n in members),
             "scales": tuple(n.attrs.get("scale") for n in members),
             "srcs": tuple(n.attrs["src"] for n in members)}
    return Node(FUSED, attrs, tuple(n.inputs[0] for n in members),
                tuple(n.outputs[0] for n in members), name, backward=True)


def _fused_collective(op, members, group, what, name, causes=None) -> Node:
    """One FUSED_RS / FUSED_AG node for the MOVE nodes `members` (one-step plans over
    the device groups `group`): input i -> output i, each along its step's dim."""
    first = members[0].attrs
    attrs = {"members": group, "for": first["for"], "reason": first["reason"],
             "cause": bucket_name(causes or [n.attrs["cause"] for n in members], what),
             "axes": tuple(n.attrs["plan"][0].dim for n in members),
             "srcs": tuple(n.attrs["src"] for n in members),
             "dsts": tuple(n.attrs["dst"] for n in members),
             "plans": tuple(n.attrs["plan"] for n in members),
             "fors": tuple(n.attrs["for"] for n in members)}
    return Node(op, attrs, tuple(n.inputs[0] for n in members),
                tuple(n.outputs[0] for n in members), name,
                backward=all(n.backward for n in members))


def fuse_parameter_gathers(graph: Graph, buckets=fusion_buckets) -> Graph:
    """`graph` with each bucket of parameter AllGathers one FUSED_AG node (see the
    module docstring); unchanged when every bucket holds one gather."""
    names = {v.id: p.name for p, v in graph.params}
    configured = "allgather" in (context.get_auto_parallel_context("comm_fusion") or {})
    nodes = graph.nodes
    segments, cur = [], {}
    for node in nodes:                           # candidates per segment, group, dtype
        if node.op == CALL:
            segments.append(cur)
            cur = {}
            continue
        step = _one_step(node, "AllGather")
        x = node.inputs[0] if node.inputs else None
        if step is not None and isinstance(x, Ref) and x.id in names:
            key, members = _group(node, step)
            cur.setdefault(key, (members, []))[1].append(node)
    segments.append(cur)
    place, drop, rename, made = {}, set(), {}, 0
    for seg in segments:
        for group, cands in seg.values():
            first_of, unique = {}, []
            for n in cands:                      # one gather per (parameter, layout)
                key = (n.inputs[0].id, n.attrs["dst"])
                if key in first_of:
                    continue
                first_of[key] = n
                unique.append(n)
            for bucket in buckets([_device_bytes(n) for n in unique], "allgather"):
                chosen = [unique[i] for i in bucket]
                if len(chosen) > 1:
                    fused = _fused_collective(FUSED_AG, chosen, group, "parameters",
                                              f"{FUSED_AG}-{made}",
                                              [names[n.inputs[0].id] for n in chosen])
                    made += 1
                    place[id(chosen[0])] = fused
                    drop.update(id(n) for n in chosen)
                elif not configured:
                    continue                     # as unfused
                keep = {(n.inputs[0].id, n.attrs["dst"]): n.outputs[0].id for n in chosen}
                for n in cands:
                    key = (n.inputs[0].id, n.attrs["dst"])
                    if key in keep and n.outputs[0].id != keep[key]:
                        drop.add(id(n))          # a repeated gather: read the first's
                        rename[n.outputs[0].id] = keep[key]
    if not place and not rename:
        return graph
    out = []
    for node in nodes:
        if id(node) in place:
            out.append(place[id(node)])
        elif id(node) not in drop:
            out.append(_renamed(node, rename))
    outputs = map_leaves(graph.outputs, lambda r: Ref(rename[r.id])
                         if isinstance(r, Ref) and r.id in rename else r)
    return verify(graph.replace(nodes=tuple(out), outputs=outputs))


def _renamed(node, rename) -> Node:
    if not any(isinstance(x, Ref) and x.id in rename for x in node.inputs):
        return node
    return node.replace(inputs=tuple(Ref(rename[x.id]) if isinstance(x, Ref) and
                                     x.id in rename else x for x in node.inputs))
