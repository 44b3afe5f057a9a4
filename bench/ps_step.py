"""One timed program for bench/test_bench_ps.py (prints a JSON line from worker 0).

    ps_step.py allreduce STEPS   # under mpiexec -n W: data parallel, AllReduce
    ps_step.py ps STEPS          # under dualmode.run --ps: every weight on the servers
    ps_step.py pushpull STEPS    # under dualmode.run --ps (1 server, 1 worker): only the
                                 # optimizer call (push the gradients, pull the weights),
                                 # alternating with raw ZeroMQ round trips of the same
                                 # frames to an echo process (the baseline, timed in the
                                 # same process and the same seconds), and with round
                                 # trips to an echo that also applies the same SGD step
                                 # (the floor of any server: transfer + update)

The JSON line has ``times`` (each timed step after two warm-up steps) and ``median_s``;
pushpull adds ``raw_times`` / ``raw_median_s`` and ``update_times`` /
``update_median_s``.
"""
import json
import socket
import subprocess
import sys
import time

import numpy as np
import zmq

import dualmode as dm
from dualmode import Tensor, communication, nn

IN, HID, OUT, BATCH = 256, 512, 10, 64          # BATCH rows per worker
WARMUP = 2

#: the raw baseline's peer: a ROUTER that sends every message straight back (what a
#: server does, minus the optimizer), zero-copy both ways, in its own process
ECHO = ("import zmq,sys\nctx=zmq.Context();s=ctx.socket(zmq.ROUTER);s.bind(sys.argv[1])\n"
        "print('ready',flush=True)\n"
        "while True:\n    f=s.recv_multipart(copy=False);s.send_multipart(f,copy=False)\n")
#: the same, applying plain SGD to weights it keeps (``w = w - lr * g`` with the
#: servers' kernel, written into the received frame, which is sent back): what a server
#: must at least do, with none of the parameter server's bookkeeping
ECHO_UPDATE = (
    "import zmq,sys,numpy as np\nfrom dualmode._core._ps_kernels import sgd_update\n"
    "ctx=zmq.Context();s=ctx.socket(zmq.ROUTER);s.bind(sys.argv[1])\n"
    "print('ready',flush=True)\nw={}\n"
    "while True:\n    f=s.recv_multipart(copy=False)\n"
    "    for i,fr in enumerate(f[2:]):\n        g=np.frombuffer(fr,np.float32)\n"
    "        if i not in w:\n            w[i]=np.zeros_like(g)\n"
    "        sgd_update(g,w[i],[g],0.01,False);w[i]=g\n"
    "    s.send_multipart(f,copy=False)\n")


class RawEcho:
    """A DEALER talking to an echo process: ``round_trip(frames)`` sends a message of
    numpy frames and waits for it to come back (as a push and its pull would)."""

    def __init__(self, program=ECHO):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.proc = subprocess.Popen([sys.executable, "-c", program, addr],
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise RuntimeError(f"the raw echo process could not listen on {addr}")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30000)        # an error, not a hang
        self.sock.connect(addr)
        self.header = json.dumps({"op": "push"}).encode()

    def round_trip(self, arrays):
        self.sock.send_multipart([self.header, *arrays], copy=False)
        frames = self.sock.recv_multipart(copy=False)
        return [np.frombuffer(f, a.dtype) for f, a in zip(frames[1:], arrays)]

    def close(self):
        self.sock.close()
        self.ctx.term()
        self.proc.kill()
        self.proc.wait(timeout=10)


def main():
    mode, steps = sys.argv[1], int(sys.argv[2])
    if mode == "allreduce":
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    else:
        dm.set_ps_context(enable_ps=True)
    communication.init()
    rank, n = communication.get_rank(), communication.get_group_size()
    dm.set_seed(1)
    if mode == "pushpull":
        net = nn.Dense(1024, 1024)
    else:
        net = nn.SequentialCell([nn.Dense(IN, HID), nn.ReLU(), nn.Dense(HID, OUT)])
    if mode != "allreduce":
        net.set_param_ps()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    rows = BATCH * n if mode == "allreduce" else BATCH      # MPI data parallel splits it
    x = Tensor(rng.standard_normal((rows, IN)).astype(np.float32))
    y = Tensor(rng.integers(0, OUT, rows).astype(np.int32))
    grads = tuple(Tensor(np.zeros(p.shape, np.float32)) for p in opt.parameters)
    raw = RawEcho() if mode == "pushpull" and rank == 0 else None
    upd = RawEcho(ECHO_UPDATE) if raw is not None else None
    payload = [np.zeros(p.shape, np.float32) for p in opt.parameters]
    times, raw_times, update_times = [], [], []
    try:
        for _ in range(steps + WARMUP):
            if raw is not None:
                t = time.perf_counter()
                raw.round_trip(payload)
                raw_times.append(time.perf_counter() - t)
                t = time.perf_counter()
                upd.round_trip(payload)
                update_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            if mode == "pushpull":
                opt(grads)
            else:
                _, g = grad_fn(x, y)
                opt(g)
            times.append(time.perf_counter() - t)
    finally:
        for echo in (raw, upd):
            if echo is not None:
                echo.close()
    nbytes = sum(p.asnumpy().nbytes for p in opt.parameters)
    if rank == 0:
        out = {"median_s": float(np.median(times[WARMUP:])), "times": times[WARMUP:],
               "bytes": nbytes}
        if raw is not None:
            out.update(raw_median_s=float(np.median(raw_times[WARMUP:])),
                       raw_times=raw_times[WARMUP:],
                       update_median_s=float(np.median(update_times[WARMUP:])),
                       update_times=update_times[WARMUP:])
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
