"""``dm.parallel.auto_parallel.AutoParallel``: compile a network or a whole training
step to one sharded graph (see :mod:`dualmode.parallel.graph`)."""
from .graph.api import AutoParallel

__all__ = ["AutoParallel"]
