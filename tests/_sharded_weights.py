"""A network whose weights the fusion tests store sharded (``parameter_plan``) and read
whole: each weight's gradient moves into its layout (a ReduceScatter) and each read
gathers it (an AllGather)."""
import contextlib

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

from _devices import devices


class ShardedWeights(nn.Cell):
    """Data-parallel MatMuls with tanh between them, one per weight of `weights`
    (name -> array, in order), each weight read whole (``n`` devices; stand-alone when
    ``n`` is None)."""

    def __init__(self, weights, n):
        super().__init__()
        self.names = list(weights)
        self.mms = []
        for name in self.names:
            setattr(self, name, Parameter(Tensor(weights[name].copy()), name=name))
            mm = ops.MatMul()
            if n:
                mm.shard(((n, 1), (1, 1)))          # every weight read whole
            self.mms.append(mm)

    def construct(self, x):
        for mm, name in zip(self.mms, self.names):
            x = ops.tanh(mm(x, getattr(self, name)))
        return x


@contextlib.contextmanager
def sharded_weights_on(n, weights, fusion=None, backend=None):
    """`n` simulated devices (None: stand-alone) with ``gradients_mean``, the `backend`
    and ``comm_fusion`` `fusion` when given: ``(ShardedWeights of `weights`, its Momentum
    optimizer)``."""
    with devices(n, gradients_mean=True):
        if backend is not None:
            communication.init(backend)
        if fusion is not None:
            dm.set_auto_parallel_context(comm_fusion=fusion)
        net = ShardedWeights(weights, n)
        yield net, nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
