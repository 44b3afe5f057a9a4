"""Run under ``mpiexec -n N``: check_equivalence of MindSpore's hybrid-parallel layer
(a weight cut on dim 1, ``layerwise_parallel=True``, MatMul, ReduceSum(-1), then
``ops.AllReduce()``, ``full_batch=True``) with and without its AllReduce, the slices given
by ``set_layerwise_slices(weight, full, dim=1)`` (each rank keeps its own) or as each
rank's own slice given to ``Parameter`` (checked with ``layerwise={"weight": 1}``). Rank 0 prints one JSON line per case:
``{"case", "ok", "first", "ops", "grad_shape"}``.
"""
import json

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import check_equivalence, set_layerwise_slices


class HybridParallelNet(nn.Cell):
    def __init__(self, value, allreduce):
        super().__init__()
        self.weight = Parameter(Tensor(value), name="weight", layerwise_parallel=True)
        self.allreduce = ops.AllReduce() if allreduce else None

    def construct(self, x):
        y = ops.reduce_sum(ops.matmul(x, self.weight), -1)
        return self.allreduce(y) if self.allreduce is not None else y


def main():
    communication.init("mpi")
    n, rank = communication.get_group_size(), communication.get_rank()
    dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=n,
                                 dataset_strategy="full_batch")
    full = np.random.default_rng(2).random((64, 32), dtype=np.float32)
    x = Tensor(np.random.default_rng(3).random((4, 64), dtype=np.float32))
    cols = 32 // n
    for case in ("full+allreduce", "full", "own+allreduce"):
        allreduce = case.endswith("allreduce")
        if case.startswith("full"):
            net = HybridParallelNet(np.zeros((64, cols), np.float32), allreduce)
            set_layerwise_slices(net.weight, full, dim=1)
            rep = check_equivalence(net, x)
        else:                         # every rank passes its own slice to Parameter
            net = HybridParallelNet(full[:, rank * cols:(rank + 1) * cols], allreduce)
            rep = check_equivalence(net, x, layerwise={"weight": 1})
        if rank == 0:
            print(json.dumps({"case": case, "ok": rep.ok, "first": rep.first_divergent_op,
                              "ops": [op.name for op in rep.ops],
                              "grad_shape": list(rep.values[-1].shape)}), flush=True)


if __name__ == "__main__":
    main()
