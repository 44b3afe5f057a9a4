"""The three strategy searches of ``set_auto_parallel_context(search_mode=...)``.

All three solve the problem of :mod:`.propagate`: node ``i`` (an op) has ``c_i``
candidate strategies with their own costs, edge ``e`` a ``(c_src, c_dst)`` matrix of
redistribution costs, fixed (configured) nodes keep their candidate; the objective is
:func:`~.propagate.total_cost`. They differ in how hard they look:

``"sharding_propagation"``
    :func:`~.propagate.propagate`: greedy outward from the configured ops, then local
    refinement (MindSpore's sharding propagation).

``"dynamic_programming"``
    :func:`dynamic_programming`: the **exact minimum** of the total cost, by graph
    elimination as MindSpore's DP search does, run as min-sum variable elimination:

    1. Fixed nodes and nodes with one candidate are conditioned away: each of their edge
       matrices becomes a row (column) added to the other end's own costs.
    2. Parallel edges between two nodes are merged (their matrices added: *edge
       elimination*).
    3. A node with one neighbour is folded into it (*merge / contract elimination*): the
       neighbour's cost per candidate gains the node's best own-plus-edge cost for it.
       A node with two neighbours is replaced by one edge between them (*op elimination*,
       a series reduction): ``M'[a, b] = min_v (M1[a, v] + own[v] + M2[v, b])``, merged
       with any edge already there. A node with no neighbour takes its cheapest candidate.
       These run first, by node index, whenever a node of degree <= 2 exists.
    4. What is left is a core where every node has >= 3 neighbours (cycles of a
       non-series-parallel graph). It is solved exactly by the same elimination: the core
       node whose elimination builds the smallest table (its candidates times those of
       its neighbours) is eliminated into a factor over all its neighbours, and steps 2-3
       resume as soon as a node's degree drops to 2. When a table would exceed
       ``max_table`` entries the search stops with :class:`SearchError` naming the core
       size (never a silently inexact answer).

    Each elimination records, per assignment of the eliminated node's neighbours, its best
    candidate (ties: the lower index); replaying the records backwards gives an optimal
    choice.

``"recursive_programming"``
    :func:`recursive_programming`: a fast heuristic in the spirit of MindSpore's
    recursive programming. Ops are ordered by weight (the spread of their own costs plus
    that of the redistribution matrices around them, heaviest first, fixed ops before
    all) and, in a second pass, in graph order; each in turn takes the candidate minimising its own cost plus, per neighbour,
    the edge cost to its decided candidate or, for an undecided neighbour, its cheapest
    edge-plus-own cost (one step of lookahead; ties: lower index). Then up to ``rounds``
    refinement rounds: a sweep in the same order re-choosing each node given all its
    neighbours, and a sweep over the edges re-choosing both ends of each together; a
    change is taken only when strictly cheaper, so refinement never raises the total.
    The cheaper pass's choice is kept (the weight order's on a tie). MindSpore builds
    each op's strategy by cutting the device count recursively in factors of 2, each
    cut on the dim its symbolic cost favours; here every split of the device count into
    factors (powers of two for the usual device counts) is already an enumerated
    candidate with its exact cost (candidates.py), so an op's recursive choice of cuts
    given its decided neighbours is the choice of its cheapest candidate. The Cython kernel
    (:mod:`dualmode._core._search`, GIL released) and the Python reference
    (``impl="python"``) choose identically. Linear in the graph size.

:func:`search` dispatches on ``search_mode`` (read from the parallel context when not
given) and returns a :class:`SearchResult` with the choice and its total cost.
``fully_use_devices`` acts before any search: it filters each op's candidates
(:func:`~.candidates.op_candidates`), so all three modes search the same filtered set.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ... import context
from ..._core import _search
from .propagate import (DEFAULT_ROUNDS, PropagationError, flat_total_cost, prepare_problem,
                        propagate_flat, unflatten)

__all__ = ["search", "SearchResult", "PlanTable", "SearchError", "dynamic_programming",
           "recursive_programming", "SEARCH_MODES", "MAX_TABLE", "RP_ROUNDS"]

#: The values of ``search_mode``.
SEARCH_MODES = ("sharding_propagation", "dynamic_programming", "recursive_programming")
#: The largest table (entries) exact elimination builds before giving up.
MAX_TABLE = 1 << 22
#: Refinement sweeps of recursive programming.
RP_ROUNDS = 8


class SearchError(PropagationError):
    """Invalid input to a search, or a problem dynamic programming cannot solve exactly."""


@dataclass(frozen=True)
class SearchResult:
    """A search's plan.

    choice       int64 array (N,): the chosen candidate per node
    cost         its total cost (own costs plus redistributions, seconds)
    search_mode  the search that chose it
    """

    choice: np.ndarray
    cost: float
    search_mode: str

    def __repr__(self):
        return (f"SearchResult(search_mode={self.search_mode!r}, cost={self.cost:g}, "
                f"{self.choice.shape[0]} nodes)")


class PlanTable(dict):
    """``CompiledGraph.strategies()``: node name -> its entry, plus the plan's totals.

    total_cost   the sum of the entries' ``"cost"`` (seconds)
    plan_cost    the total cost the search minimised (own communication, gradient
                 AllReduces and redistributions between ops), or None when no search ran
                 (semi-auto mode, or a graph that is not sharded)
    search_mode  the search that planned the graph, or None
    """

    def __init__(self, entries, plan_cost=None, search_mode=None):
        super().__init__(entries)
        self.total_cost = float(sum(v["cost"] for v in self.values()))
        self.plan_cost = plan_cost
        self.search_mode = search_mode

    def __repr__(self):
        plan = "" if self.plan_cost is None else \
            f", plan_cost={self.plan_cost:g} ({self.search_mode})"
        return f"PlanTable(total_cost={self.total_cost:g}{plan}, {dict.__repr__(self)})"


# ============================================================================ validation

def _prepared(owner, node_costs, edges, edge_costs, fixed):
    try:
        return prepare_problem(node_costs, edges, edge_costs, fixed)
    except PropagationError as exc:
        msg = str(exc)
        if msg.startswith("propagate:"):
            msg = f"{owner}:" + msg[len("propagate:"):]
        raise SearchError(msg) from None


def _check_impl(owner, impl):
    if impl not in ("cython", "python"):
        raise SearchError(f"{owner}: impl={impl!r} is not valid; expected 'cython' or "
                          f"'python'")


def _check_int(owner, name, value, low):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise SearchError(f"{owner}: {name}={value!r} is not valid; expected an int >= {low}")
    return int(value)


def _check_mode(mode):
    if mode is None:
        mode = context._STATE.auto_parallel.search_mode
    if not isinstance(mode, str) or mode not in SEARCH_MODES:
        raise SearchError(f"search: search_mode={mode!r} is not valid; expected one of "
                          f"{list(SEARCH_MODES)}")
    return mode


# ============================================================================ dispatch

def search(node_costs: Sequence[np.ndarray], edges, edge_costs: Sequence[np.ndarray], fixed,
           *, search_mode: Optional[str] = None, impl: str = "cython") -> SearchResult:
    """Choose one candidate per node with the given search (see the module docstring).

    Parameters are those of :func:`~.propagate.propagate`; ``search_mode`` is one of
    :data:`SEARCH_MODES` (None: the parallel context's ``search_mode``); ``impl``
    selects the Cython kernel or the Python reference of the heuristics (dynamic
    programming is numpy either way).

    Returns
    -------
    SearchResult
        The choice (``choice[i] == fixed[i]`` wherever ``fixed[i] >= 0``), its total cost
        and the search mode used.
    """
    mode = _check_mode(search_mode)
    _check_impl("search", impl)
    flat = _prepared(mode, node_costs, edges, edge_costs, fixed)
    if mode == "dynamic_programming":
        choice = _dp(*flat, MAX_TABLE)
    elif mode == "recursive_programming":
        choice = _rp(*flat, RP_ROUNDS, impl)
    else:
        choice = propagate_flat(*flat, impl=impl, rounds=DEFAULT_ROUNDS)
    return SearchResult(choice, flat_total_cost(choice, *flat[:5]), mode)


def dynamic_programming(node_costs: Sequence[np.ndarray], edges,
                        edge_costs: Sequence[np.ndarray], fixed, *,
                        max_table: int = MAX_TABLE) -> np.ndarray:
    """The choice of least total cost (exact), by graph elimination.

    Parameters are those of :func:`~.propagate.propagate`; ``max_table`` bounds the
    entries of any table the elimination builds.

    Returns
    -------
    np.ndarray of int64, shape (N,)

    Raises
    ------
    SearchError (a ValueError)
        On bad input, naming the parameter; or when the graph's irreducible core needs a
        table larger than ``max_table`` (the message names the core size and the other
        search modes).
    """
    max_table = _check_int("dynamic_programming", "max_table", max_table, 1)
    return _dp(*_prepared("dynamic_programming", node_costs, edges, edge_costs, fixed),
               max_table)


def recursive_programming(node_costs: Sequence[np.ndarray], edges,
                          edge_costs: Sequence[np.ndarray], fixed, *, impl: str = "cython",
                          rounds: int = RP_ROUNDS) -> np.ndarray:
    """A fast heuristic choice: heaviest ops first (and, in a second pass, in graph
    order), each given its decided neighbours, then ``rounds`` refinement rounds; the
    cheaper pass wins (see the module docstring).

    Returns
    -------
    np.ndarray of int64, shape (N,)
    """
    _check_impl("recursive_programming", impl)
    rounds = _check_int("recursive_programming", "rounds", rounds, 0)
    return _rp(*_prepared("recursive_programming", node_costs, edges, edge_costs, fixed),
               rounds, impl)


# ============================================================================ dynamic programming

def _dp(node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed, max_table):
    n = node_ptr.shape[0] - 1
    counts = np.diff(node_ptr)
    # conditioned nodes: fixed, or a single candidate
    known = np.where(fixed >= 0, fixed, np.where(counts == 1, 0, -1))
    unary = [node_flat[node_ptr[i]:node_ptr[i + 1]].copy() if known[i] < 0 else None
             for i in range(n)]
    size = [int(c) for c in counts]
    factors = {}                                  # sorted scope tuple -> table
    scopes = [set() for _ in range(n)]            # node -> scopes holding it
    nbrs = [set() for _ in range(n)]

    def add(scope, table):
        old = factors.get(scope)
        if old is None:
            factors[scope] = table
            for x in scope:
                scopes[x].add(scope)
                nbrs[x].update(y for y in scope if y != x)
        else:
            old += table                          # parallel edges merge

    kl = known.tolist()
    for e in range(edges.shape[0]):
        s, d = int(edges[e, 0]), int(edges[e, 1])
        m = edge_flat[edge_ptr[e]:edge_ptr[e + 1]].reshape(size[s], size[d])
        ks, kd = kl[s], kl[d]
        if ks >= 0 and kd >= 0:
            continue
        if ks >= 0:
            unary[d] += m[ks]
        elif kd >= 0:
            unary[s] += m[:, kd]
        elif s < d:
            add((s, d), m.copy())
        else:
            add((d, s), m.T.copy())

    records = []
    alive = [kl[i] < 0 for i in range(n)]
    remaining = sum(alive)

    def key(i):          # degree <= 2 first, by index; then the smallest table
        if len(nbrs[i]) <= 2:
            return (0, i)
        return (1, math.prod(size[x] for x in nbrs[i]) * size[i], i)

    heap = [key(i) for i in range(n) if alive[i]]
    heapq.heapify(heap)
    while remaining:
        k = heapq.heappop(heap)
        v = k[-1]
        if not alive[v] or key(v) != k:           # stale: a fresher key is queued
            continue
        scope = sorted(nbrs[v])
        entries = math.prod(size[x] for x in scope) * size[v]
        if entries > max_table:
            core = [i for i in range(n) if alive[i]]
            raise SearchError(
                f"dynamic_programming: the graph does not reduce to a core small enough "
                f"to solve exactly: with {len(core)} ops left, the cheapest elimination "
                f"(op {v}: {size[v]} candidates, {len(scope)} neighbours) needs a table "
                f"of {entries} entries, more than max_table={max_table}; use "
                f"search_mode='recursive_programming' or 'sharding_propagation' for this "
                f"graph")
        full = scope + [v]
        where = {x: j for j, x in enumerate(full)}
        shape = [1] * len(full)
        shape[-1] = size[v]
        total = unary[v].reshape(shape)
        for sc in list(scopes[v]):
            table = factors.pop(sc)
            for x in sc:
                scopes[x].discard(sc)
            pos = [where[x] for x in sc]
            shp = [1] * len(full)
            for x in sc:
                shp[where[x]] = size[x]
            if pos != sorted(pos):
                table = table.transpose(sorted(range(len(pos)), key=pos.__getitem__))
            total = total + table.reshape(shp)
        if total.ndim != len(full) or total.shape[-1] != size[v] or 1 in total.shape[:-1]:
            total = np.broadcast_to(total, [size[x] for x in full])
        best = total.argmin(axis=-1)
        low = total.min(axis=-1)
        records.append((v, scope, best))
        alive[v] = False
        remaining -= 1
        for x in scope:
            nbrs[x].discard(v)
        if len(scope) == 1:
            unary[scope[0]] += low
        elif len(scope) > 1:
            add(tuple(scope), np.ascontiguousarray(low))
        for x in scope:
            heapq.heappush(heap, key(x))
        nbrs[v].clear()

    choice = known.copy()
    for v, scope, best in reversed(records):
        choice[v] = best[tuple(int(choice[x]) for x in scope)] if scope else int(best)
    return choice


# ============================================================================ recursive programming

def _rp_orders(node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed):
    """The two visit orders, each with the fixed nodes first (by index): free nodes by
    decreasing weight (ties by index), and free nodes by index (the graph's order)."""
    n = node_ptr.shape[0] - 1
    if n == 0:
        return [np.zeros(0, np.int64)]
    starts = node_ptr[:-1]
    with np.errstate(invalid="ignore"):            # inf - inf: an op as heavy as it gets
        weight = np.maximum.reduceat(node_flat, starts) - np.minimum.reduceat(node_flat,
                                                                              starts)
        if edges.shape[0]:
            spread = (np.maximum.reduceat(edge_flat, edge_ptr[:-1])
                      - np.minimum.reduceat(edge_flat, edge_ptr[:-1]))
            weight = weight + np.bincount(edges[:, 0], spread, n) + \
                np.bincount(edges[:, 1], spread, n)
    weight = np.where(np.isfinite(weight), weight, np.finfo(np.float64).max)
    by_weight = np.argsort(-np.where(fixed >= 0, np.inf, weight), kind="stable")
    by_index = np.argsort(fixed < 0, kind="stable")
    return [by_weight.astype(np.int64), by_index.astype(np.int64)]


def _rp(node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed, rounds, impl):
    """The cheaper of the two orders' choices (the weight order on a tie)."""
    flat = (node_ptr, node_flat, edges, edge_ptr, edge_flat)
    best, best_cost = None, np.inf
    for order in _rp_orders(*flat, fixed):
        if impl == "python":
            choice = _rp_reference(*flat, fixed, order, rounds)
        else:
            choice = _search.ordered_greedy(node_ptr, node_flat,
                                            np.ascontiguousarray(edges[:, 0]),
                                            np.ascontiguousarray(edges[:, 1]), edge_ptr,
                                            edge_flat, fixed, order, rounds)
        cost = flat_total_cost(choice, *flat)
        if best is None or cost < best_cost:
            best, best_cost = choice, cost
    return best


def _rp_reference(node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed, order, rounds):
    """The kernel's rules written plainly (one node, one edge at a time)."""
    n, own, src, dst, mats, incident = unflatten(node_ptr, node_flat, edges, edge_ptr,
                                                 edge_flat)
    choice = fixed.tolist()

    def oriented(v, e):                          # rows: v's candidates
        return mats[e] if src[e] == v else mats[e].T

    def field(v, skip, look):
        tot = own[v].copy()
        for e in incident[v]:
            u = dst[e] if src[e] == v else src[e]
            if u == skip:
                continue
            if choice[u] >= 0:
                tot += oriented(v, e)[:, choice[u]]
            elif look:
                tot += (oriented(v, e) + own[u][None, :]).min(axis=1)
        return tot

    def argmin(tot, current):
        b = int(np.argmin(tot))                  # first minimum: the lower index
        if current >= 0 and not tot[b] < tot[current]:
            return current
        return b

    def pair(s, d):
        table = field(s, d, False)[:, None] + field(d, s, False)[None, :]
        for e in incident[s]:
            if src[e] == d or dst[e] == d:
                table = table + oriented(s, e)
        a, b = np.unravel_index(int(np.argmin(table)), table.shape)
        if table[a, b] < table[choice[s], choice[d]]:
            choice[s], choice[d] = int(a), int(b)
            return 1
        return 0

    order = order.tolist()
    for v in order:
        if fixed[v] < 0:
            choice[v] = argmin(field(v, -1, True), -1)
    for _ in range(rounds):
        changed = 0
        for v in order:
            if fixed[v] < 0:
                b = argmin(field(v, -1, False), choice[v])
                if b != choice[v]:
                    choice[v] = b
                    changed += 1
        for e in range(len(src)):
            if fixed[src[e]] < 0 and fixed[dst[e]] < 0:
                changed += pair(src[e], dst[e])
        if not changed:
            break
    return np.asarray(choice, dtype=np.int64).reshape(n)
