"""The interpreter a primitive call goes to.

``ops`` declares primitives; the layers above decide how a call that carries a sharding
strategy runs (eagerly on shards, or recorded into a graph being traced), how the
user-facing collectives run, and what ``ops.shard`` compiles to. They install
themselves here, so ``ops`` never imports them:

* the **base** interpreter is the one the parallel layer installs when it is imported
  (:class:`dualmode.parallel.eager.ShardedEager`); before that (or for a bare ``ops``)
  it is :class:`Interpreter`: strategies are checked and the op runs on one device;
* a graph trace pushes itself with :func:`interpreting` for the length of the trace,
  so strategy-carrying calls inside it are recorded, not run.
"""
from __future__ import annotations

import contextlib

from ._registry import const, wrap

__all__ = ["Interpreter", "install", "current", "base", "interpreting"]


class Interpreter:
    """One device, no parallel layer: strategies are checked against the inputs (by
    the primitive) and change nothing; collectives are the identity."""

    def ignores_strategies(self) -> bool:
        """Are strategies ignored now (not even checked against the inputs)? One device
        without a parallel layer checks them; the parallel layer ignores them outside
        the parallel modes that run them, as MindSpore does."""
        return False

    def call_primitive(self, prim, args, kwargs):
        """Run the strategy-carrying primitive `prim` on `args`."""
        return prim.construct(*args, **kwargs)

    def run_collective(self, prim, x):
        """Run the collective primitive `prim` (``ops.AllReduce()`` & co.) on `x`."""
        return wrap(const(x, prim.name))        # one device: every collective is identity

    def shard(self, fn, in_strategy, out_strategy, parameter_plan, device, level):
        """``ops.shard``: compile `fn` to a sharded graph."""
        raise RuntimeError("ops.shard: graph mode is provided by dualmode.parallel, which "
                           "is not loaded; import dualmode (not only dualmode.ops)")


_STACK = [Interpreter()]


def install(interp: Interpreter) -> None:
    """Make `interp` the base interpreter (the parallel layer does, once, at import)."""
    _STACK[0] = interp


def current():
    """The interpreter strategy-carrying calls go to now (a trace, or the base one)."""
    return _STACK[-1]


def base() -> Interpreter:
    """The base interpreter (collectives and ``ops.shard`` always go to it)."""
    return _STACK[0]


@contextlib.contextmanager
def interpreting(interp):
    """Send strategy-carrying primitive calls to `interp` inside the block."""
    _STACK.append(interp)
    try:
        yield interp
    finally:
        _STACK.pop()
