"""The parallel layer's eager interpreter (PyNative mode on shards).

Installed as the base interpreter of :mod:`dualmode.ops.interpreter` when
:mod:`dualmode.parallel` is imported: a primitive carrying a strategy has its inputs
moved into the strategy's layouts (DTensor-style) and its outputs into the
out_strategy's, when strategies are active (semi_auto or auto parallel on more than one
device); the user-facing collectives run over the devices; ``ops.shard`` compiles to a
graph (:mod:`dualmode.parallel.graph.api`).
"""
from __future__ import annotations

from .. import context
from ..ops.interpreter import Interpreter
from . import collectives
from .graph.api import shard as _compile_shard
from .strategy import (STRATEGY_MODES, apply_in_strategy, apply_out_strategy,
                       check_device_count, strategies_active)

__all__ = ["ShardedEager"]


class ShardedEager(Interpreter):
    """Strategies run sharded when active; otherwise as on one device."""

    def ignores_strategies(self) -> bool:
        """Strategies run only in semi_auto and auto parallel; in the other modes
        (stand-alone, data or hybrid parallel) a network written for N devices runs
        unchanged, its strategies ignored, as in MindSpore."""
        return context._STATE.auto_parallel.parallel_mode not in STRATEGY_MODES

    def call_primitive(self, prim, args, kwargs):
        active = strategies_active()
        if prim.in_strategy is not None and active:
            args = apply_in_strategy(prim, args)
        elif prim.in_strategy is not None:
            check_device_count(prim)
        out = prim.construct(*args, **kwargs)
        if prim.out_strategy is not None and active:
            out = apply_out_strategy(prim, out)
        return out

    def run_collective(self, prim, x):
        return collectives.run(prim, x)

    def shard(self, fn, in_strategy, out_strategy, parameter_plan, device, level):
        return _compile_shard(fn, in_strategy, out_strategy, parameter_plan, device, level)
