"""Per-rank data sets whose batches have unequal row counts, under MPI (one device per
process). Each rank reads its shard (``DistributedSampler(ranks, rank)``) of the same 48
rows; ``num_samples`` caps some ranks' shards, so their batches of 4 are shorter:

    case "equal"  every rank 8 rows            batches [4, ...], [4, ...]
    case "last"   2 ranks: 8 and 7 rows        batches [4, 4], [4, 3]
                  3 ranks: 8, 8 and 7 rows     batches [4, 4, 4], [4, 4, 3]
    case "each"   2 ranks: 8 and 6 rows, rank 1 batches of 3: [4, 3], [4, 3]; the data
                  set repeated twice (its batch sizes are not known up front: each
                  batch's row counts are gathered once per new count)
    case "bad"    2 ranks: 5 and 9 rows, batches of 16: [5, 9], refused
    case "steps"  2 ranks: 8 and 4 rows, batches of 4: 2 steps and 1, refused
    case "tensor" no data set: Tensors the script makes from its rank's own rows (8, 7),
                  refused (a Tensor is the whole global batch, the same on every rank)

A small MLP (Dense 6-8, ReLU, Dense 8-1) trained with SGD, ``gradients_mean=True``, in
``mode`` ("data_parallel" with a hand-written loop, "model" Model.train under data
parallel, "semi_auto" a hand-written loop under semi_auto_parallel with
full_batch=False, "late" a hand-written loop under data parallel set after the data
set's iterator was made: its batches are plain Tensors of this rank's rows, which the
network call takes as this rank's piece of the global batch).

    mpiexec -n N python unequal_rows_train.py OUT.npz CASE MODE
    python unequal_rows_train.py OUT.npz CASE MODE N      # one device, the global
                                                          # batches built by hand

Each writes the losses, the global batch sizes, the trained weights and the MPI Allgathers
the data set's first and second epochs made to OUT.npz. Cases "bad", "steps" and
"tensor" write the error's message to ``refused_R.txt`` in the working directory on
every rank R, then fail."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, nn
from dualmode.dataset import DistributedSampler, NumpySlicesDataset
from dualmode.train import Callback, Model

ROWS = 48


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 6)).astype(np.float32)
    y = (np.tanh(x @ rng.standard_normal((6, 1))) + 0.1).astype(np.float32)
    return x, y


def _shard(case, n, rank):
    """(rows this rank reads, its batch size, drop_remainder, repeat)."""
    if case == "equal":
        return 8, 4, False, 1
    if case == "last":
        return (7 if rank == n - 1 else 8), 4, False, 1
    if case == "each":
        return (8, 4, False, 2) if rank == 0 else (6, 3, False, 2)
    if case == "bad":
        return (5 if rank == 0 else 9), 16, False, 1
    if case == "steps":
        return (8 if rank == 0 else 4), 4, False, 1
    raise ValueError(case)


def _dataset(case, n, rank):
    x, y = _data()
    samples, batch, drop, repeat = _shard(case, n, rank)
    ds = NumpySlicesDataset({"x": x, "y": y},
                            sampler=DistributedSampler(n, rank, shuffle=False,
                                                       num_samples=samples))
    ds = ds.batch(batch, drop_remainder=drop)
    return ds.repeat(repeat) if repeat > 1 else ds


def _reference_batches(case, n):
    """The global batches: every rank's batch b concatenated in rank order."""
    x, y = _data()
    per_rank = []
    for r in range(n):
        samples, batch, drop, repeat = _shard(case, n, r)
        idx = (np.arange(samples) * n + r) % ROWS
        per_rank.append([idx[s:s + batch] for s in range(0, samples, batch)] * repeat)
    for parts in zip(*per_rank):
        idx = np.concatenate(parts)
        yield x[idx], y[idx]


class _Losses(Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs))


def _calls():
    b = communication.get_backend()
    return getattr(b, "mpi_calls", {}).get("Allgather", 0)


def _parallel(mode):
    parallel = "semi_auto_parallel" if mode == "semi_auto" else "data_parallel"
    dm.set_auto_parallel_context(parallel_mode=parallel, gradients_mean=True,
                                 full_batch=False)


def main(out, case, mode, ref_devices=None):
    if ref_devices:
        communication.init("sim")
        n, rank = ref_devices, 0
    else:
        communication.init()
        if mode != "late":
            _parallel(mode)
        n, rank = communication.get_group_size(), communication.get_rank()
    dm.set_seed(1)
    net = nn.SequentialCell([nn.Dense(6, 8), nn.ReLU(), nn.Dense(8, 1)])
    rng = np.random.default_rng(3)
    for p in net.trainable_params():
        p.set_data(Tensor((rng.standard_normal(p.shape) * 0.3).astype(np.float32)))
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    loss_fn = nn.MSELoss()
    epochs = []                   # MPI calls the data set's epochs made (no training)
    if case == "tensor":         # Tensors of this rank's own rows: 8 on rank 0, 7 after
        x, y = _data()
        mine = slice(8 * rank, 8 * rank + (8 if rank == 0 else 7))
        grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None,
                                    net.trainable_params())
        try:
            grad_fn(Tensor(x[mine]), Tensor(y[mine]))
        except ValueError as e:
            with open(f"refused_{rank}.txt", "w") as f:
                f.write(str(e))
            communication.get_backend().barrier()      # every rank has written it
            raise
    if ref_devices:
        batches = [(Tensor(x), Tensor(y)) for x, y in _reference_batches(case, n)]
    else:
        ds = _dataset(case, n, rank)
        try:
            for _ in range(2):
                before = _calls()
                sizes = [int(x.shape[0]) for x, _ in ds.create_tuple_iterator(num_epochs=1)]
                epochs.append(_calls() - before)
        except ValueError as e:
            with open(f"refused_{rank}.txt", "w") as f:
                f.write(str(e))
            communication.get_backend().barrier()      # every rank has written it
            raise
        batches = ds.create_tuple_iterator(num_epochs=1)
        if mode == "late":          # the batches are this rank's rows, as plain Tensors:
            _parallel(mode)         # the network call takes them as its piece
    sizes, losses = [], []
    if mode == "model" and not ref_devices:
        rec = _Losses()
        Model(net, loss_fn=loss_fn, optimizer=opt).train(1, ds, callbacks=[rec])
        losses = rec.losses
        sizes = [int(x.shape[0]) for x, _ in ds.create_tuple_iterator(num_epochs=1)]
    else:
        grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None,
                                    net.trainable_params())
        for x, y in batches:
            loss, grads = grad_fn(x, y)
            opt(grads)
            losses.append(float(loss.asnumpy()))
            sizes.append(int(x.shape[0]))
    weights = [p.asnumpy() for p in net.trainable_params()]
    if rank == 0:
        np.savez(out, losses=np.array(losses), sizes=np.array(sizes),
                 epochs=np.array(epochs), **{f"w{i}": w for i, w in enumerate(weights)})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3],
         int(sys.argv[4]) if len(sys.argv) > 4 else None)
