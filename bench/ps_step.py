"""One timed program for bench/test_bench_ps.py (prints a JSON line from worker 0).

    ps_step.py allreduce STEPS   # under mpiexec -n W: data parallel, AllReduce
    ps_step.py ps STEPS          # under dualmode.run --ps: every weight on the servers
    ps_step.py floor STEPS ADDR.. # under mpiexec -n W, beside one FLOOR_SERVER process per
                                 # address: the PS step with none of the parameter
                                 # server: the same network, gradients and placement,
                                 # each worker sends its shards' gradients to the
                                 # servers as one raw ZeroMQ message each, a server
                                 # waits for every worker's, applies the mean with the
                                 # servers' SGD kernel and sends the new weights back
                                 # (the floor of any sync PS step on this machine)
    ps_step.py pushpull STEPS    # under dualmode.run --ps (1 server, 1 worker): only the
                                 # optimizer call (push the gradients, pull the weights),
                                 # alternating with raw ZeroMQ round trips of the same
                                 # frames to an echo process (the baseline, timed in the
                                 # same process and the same seconds), and with round
                                 # trips to an echo that also applies the same SGD step
                                 # (the floor of any server: transfer + update),
                                 # and with that echo pipelined by row blocks

The JSON line has ``times`` (each timed step after two warm-up steps) and ``median_s``;
pushpull adds ``raw_times`` / ``raw_median_s``, ``update_times`` /
``update_median_s`` and ``pipelined_times`` / ``pipelined_median_s``.
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
from dualmode.ps.placement import place

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
#: the same update, pipelined: the client sends a step as PIPE_CHUNKS messages (row blocks
#: of the weight, the bias with the last), the echo updates each block as it comes
#: (weights kept per block, keyed by the message's first frame) and sends it straight
#: back, so the update of one block overlaps the transfers of the others
ECHO_PIPELINED = ECHO_UPDATE.replace("enumerate(f[2:]):\n", "enumerate(f[2:]):\n"
                                     "        i=(f[1].bytes,i)\n")
PIPE_CHUNKS = 4

#: the floor's server (``python -c FLOOR_SERVER WORKERS``; prints its port): per step,
#: one message from each worker (DEALER identity: its rank, one byte), the mean of the
#: gradients applied to the weights it keeps with the servers' fused SGD kernel, written
#: into worker 0's received frames, which are sent back to every worker
FLOOR_SERVER = (
    "import zmq,sys,numpy as np\nfrom dualmode._core._ps_kernels import sgd_update\n"
    "ctx=zmq.Context();s=ctx.socket(zmq.ROUTER)\n"
    "print(s.bind_to_random_port('tcp://127.0.0.1'),flush=True)\n"
    "n=int(sys.argv[1]);w={}\n"
    "while True:\n"
    "    got=sorted((s.recv_multipart(copy=False) for _ in range(n)),key=lambda f:f[0].bytes)\n"
    "    out=[]\n"
    "    for i in range(2,len(got[0])):\n"
    "        gs=[np.frombuffer(f[i],np.float32) for f in got]\n"
    "        if i not in w:\n            w[i]=np.zeros_like(gs[0])\n"
    "        sgd_update(gs[0],w[i],gs,0.01,True);w[i]=gs[0];out.append(got[0][i])\n"
    "    for f in got:\n        s.send_multipart([f[0],b'w',*out],copy=False)\n")


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

    def pipelined_round_trip(self, arrays, out):
        """The round trip as PIPE_CHUNKS messages each way (``arrays[0]`` split by rows,
        the other arrays with the last block), each answer copied into `out` (one
        contiguous array per array, as a worker's weights must be) as it comes."""
        bounds = np.linspace(0, len(arrays[0]), PIPE_CHUNKS + 1).astype(int)
        for c in range(PIPE_CHUNKS):
            rest = arrays[1:] if c == PIPE_CHUNKS - 1 else []
            self.sock.send_multipart([b"%d" % c, arrays[0][bounds[c]:bounds[c + 1]], *rest],
                                     copy=False)
        for _ in range(PIPE_CHUNKS):
            frames = self.sock.recv_multipart(copy=False)
            c = int(frames[0].bytes)
            parts = [out[0][bounds[c]:bounds[c + 1]]] + (out[1:] if len(frames) > 2 else [])
            for part, fr in zip(parts, frames[1:]):
                part[...] = np.frombuffer(fr, part.dtype).reshape(part.shape)

    def close(self):
        self.sock.close()
        self.ctx.term()
        self.proc.kill()
        self.proc.wait(timeout=10)


def floor_step(socks, shards, grad_fn, x, y, params):
    """One step of the floor: the gradients, each server's shards' gradients sent as
    one message, its answer's frames made the weights' storage (as a PS worker does)."""
    _, g = grad_fn(x, y)
    for k, sock in socks.items():
        sock.send_multipart([b"g"] + [np.ascontiguousarray(g[sh.index]) for sh in shards[k]],
                           copy=False)
    for k, sock in socks.items():
        frames = sock.recv_multipart(copy=False)
        for sh, fr in zip(shards[k], frames[1:]):
            params[sh.index]._data = np.frombuffer(fr, np.float32).reshape(
                params[sh.index].shape)


def main():
    mode, steps = sys.argv[1], int(sys.argv[2])
    if mode == "allreduce":
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    elif mode != "floor":
        dm.set_ps_context(enable_ps=True)
    communication.init()
    rank, n = communication.get_rank(), communication.get_group_size()
    dm.set_seed(1)
    if mode == "pushpull":
        net = nn.Dense(1024, 1024)
    else:
        net = nn.SequentialCell([nn.Dense(IN, HID), nn.ReLU(), nn.Dense(HID, OUT)])
    if mode in ("ps", "pushpull"):
        net.set_param_ps()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    rows = BATCH * n if mode == "allreduce" else BATCH      # MPI data parallel splits it
    socks, shards = {}, {}
    if mode == "floor":
        shards = place(list(enumerate(opt.parameters)), len(sys.argv) - 3)
        zctx = zmq.Context()
        for k, addr in enumerate(sys.argv[3:]):
            socks[k] = zctx.socket(zmq.DEALER)
            socks[k].setsockopt(zmq.IDENTITY, bytes([rank]))
            socks[k].setsockopt(zmq.LINGER, 0)
            socks[k].setsockopt(zmq.RCVTIMEO, 30000)      # an error, not a hang
            socks[k].connect(addr)
    x = Tensor(rng.standard_normal((rows, IN)).astype(np.float32))
    y = Tensor(rng.integers(0, OUT, rows).astype(np.int32))
    grads = tuple(Tensor(np.zeros(p.shape, np.float32)) for p in opt.parameters)
    raw = RawEcho() if mode == "pushpull" and rank == 0 else None
    upd = RawEcho(ECHO_UPDATE) if raw is not None else None
    pipe = RawEcho(ECHO_PIPELINED) if raw is not None else None
    payload = [np.zeros(p.shape, np.float32) for p in opt.parameters]
    pulled = [np.zeros(p.shape, np.float32) for p in opt.parameters]
    times, raw_times, update_times, pipelined_times = [], [], [], []
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
                pipe.pipelined_round_trip(payload, pulled)
                pipelined_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            if mode == "pushpull":
                opt(grads)
            elif mode == "floor":
                floor_step(socks, shards, grad_fn, x, y, opt.parameters)
            else:
                _, g = grad_fn(x, y)
                opt(g)
            times.append(time.perf_counter() - t)
    finally:
        for echo in (raw, upd, pipe):
            if echo is not None:
                echo.close()
        for sock in socks.values():
            sock.close()
    nbytes = sum(p.asnumpy().nbytes for p in opt.parameters)
    if rank == 0:
        out = {"median_s": float(np.median(times[WARMUP:])), "times": times[WARMUP:],
               "bytes": nbytes}
        if raw is not None:
            out.update(raw_median_s=float(np.median(raw_times[WARMUP:])),
                       raw_times=raw_times[WARMUP:],
                       update_median_s=float(np.median(update_times[WARMUP:])),
                       update_times=update_times[WARMUP:],
                       pipelined_median_s=float(np.median(pipelined_times[WARMUP:])),
                       pipelined_times=pipelined_times[WARMUP:])
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
