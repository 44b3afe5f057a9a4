"""The backend of a worker started without MPI: it knows its worker id and the worker
count (``get_rank()`` / ``get_group_size()``) but has no link to the other workers, so
any collective among workers is refused with the way to get one."""
from __future__ import annotations

from ..communication.backend import Backend

__all__ = ["PSWorkerBackend"]


class PSWorkerBackend(Backend):
    """One device: worker ``rank`` of ``worker_num``; collectives raise RuntimeError."""

    name = "ps_worker"

    def __init__(self, worker_num: int, rank: int):
        super().__init__(worker_num, (rank,))

    def _refuse(self, what: str):
        raise RuntimeError(
            f"{what}: this parameter server worker (worker {self.local_ranks[0]} of "
            f"{self.world_size}) was started without MPI, so it has no collective link to "
            "the other workers; keep every trainable weight on the servers "
            "(net.set_param_ps()) and parallel_mode='stand_alone', or start the job with "
            "python -m dualmode.run --ps --server_num S --worker_num W script.py, which runs "
            "the workers under MPI")

    def _all_reduce(self, stack, plan, op, algorithm):
        self._refuse("AllReduce")

    def _all_gather(self, stack, plan, axis):
        self._refuse("AllGather")

    def _reduce_scatter(self, stack, plan, axis, op):
        self._refuse("ReduceScatter")

    def _all_to_all(self, stack, plan, split_axis, concat_axis):
        self._refuse("AlltoAll")

    def _broadcast(self, stack, plan, root):
        self._refuse("Broadcast")

    def _reduce(self, stack, plan, root, op):
        self._refuse("Reduce")

    def _scatter(self, stack, plan, root, axis):
        self._refuse("Scatter")

    def _gather(self, stack, plan, root, axis):
        self._refuse("Gather")

    def _send_recv(self, stack, src, dst):
        self._refuse("Send/Recv")
