"""Parameter server mode with real processes (scheduler + 2 servers + 2 workers): sync
training equals one device on the concatenated batch, async lowers the loss, the
embedding cache equals the uncached run, the seed's MS_* shell scripts work, and the
faults: a killed worker, a killed and restarted server, a dead scheduler."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from _ps import Cluster, base_env, program

zmq = pytest.importorskip("zmq", reason="parameter server mode needs pyzmq")

FLOATS = 16 * 8 + 16 + 4 * 16 + 4          # the weights of the test network


def _assert_weights(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_ps_sync_equals_single_device(opt, tmp_path):
    cfg = {"opt": opt, "steps": 5}
    with Cluster(tmp_path, cfg) as c:
        c.start_all()
        codes = c.wait()
        assert set(codes.values()) == {0}, c.all_logs()
        ref_losses, ref_weights = program().reference(cfg, workers=2)
        for rank in (0, 1):
            losses, moved, weights = c.result(rank)
            _assert_weights(weights, ref_weights)
            # CommReport: every step pushes every gradient and pulls every weight
            assert moved.tolist() == [5 * FLOATS * 4, 5 * FLOATS * 4]
        # each worker's loss is the mean over its half of the batch
        mean = (c.result(0)[0] + c.result(1)[0]) / 2
        np.testing.assert_allclose(mean, ref_losses, rtol=1e-5)
        assert "Start the scheduler node is successful!" in c.log("scheduler")


@pytest.mark.parametrize("mode,opt", [("sync", "momentum"), ("async", "momentum"),
                                      ("async", "adam")])
def test_ps_large_frames_equal_single_device(mode, opt, tmp_path):
    """fc1's weights are 128 KiB: sent without copies both ways, the pulled frames kept
    as the workers' weights. Momentum runs fused on the servers (the new weights
    written into the first worker's received gradient frame, which is sent back as
    it is); Adam updates in place (its replies tracked). sync equals one device;
    async, with one worker, too (its pushes apply in order; Adam runs there, where the
    gradients are the single device's own: the mean of two workers' halves rounds
    differently, and Adam's normalisation makes that visible)."""
    workers = 2 if mode == "sync" else 1
    cfg = {"opt": opt, "steps": 4, "hidden": 4096, "mode": mode}
    with Cluster(tmp_path, cfg, workers=workers) as c:
        c.start_all()
        codes = c.wait()
        assert set(codes.values()) == {0}, c.all_logs()
        _, ref_weights = program().reference(cfg, workers=workers)
        for rank in range(workers):
            _assert_weights(c.result(rank)[2], ref_weights)


def test_ps_ms_shell_scripts(tmp_path):
    """The seed's Scheduler.sh / Server.sh / Worker.sh (MS_* variables, one background
    process per role, logs scheduler.log, server_<i>.log, worker_<i>.log) unchanged."""
    env = base_env("MS", 2, 2)
    script = os.path.join(os.path.dirname(__file__), "ps_scripts", "train_ps.py")
    cfg = '\'{"opt": "momentum", "steps": 3}\''
    common = "".join(f"export {k}={env[k]}\n" for k in
                     ("MS_SERVER_NUM", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT"))
    run = f"{sys.executable} {script} {cfg} {tmp_path}"
    scripts = {
        "Scheduler.sh": f"export MS_ROLE=MS_SCHED\n{run} > scheduler.log 2>&1 &\n",
        "Server.sh": "export MS_ROLE=MS_PSERVER\nfor((server_id=0;server_id<${MS_SERVER_NUM};"
                     f"server_id++))\ndo\n{run} > server_${{server_id}}.log 2>&1 &\ndone\n",
        "Worker.sh": "export MS_ROLE=MS_WORKER\nfor((worker_id=0;worker_id<${MS_WORKER_NUM};"
                     f"worker_id++))\ndo\n{run} > worker_${{worker_id}}.log 2>&1 &\ndone\n",
    }
    groups = []
    try:
        for name, body in scripts.items():
            (tmp_path / name).write_text("#!/bin/bash\n" + common + body)
            proc = subprocess.Popen(["bash", name], cwd=tmp_path, env=env,
                                    start_new_session=True)
            proc.wait(timeout=10)
            groups.append(proc.pid)
        end = time.monotonic() + 60
        while time.monotonic() < end and any(_group_alive(g) for g in groups):
            time.sleep(0.1)
        assert not any(_group_alive(g) for g in groups), "the roles did not finish in 60 s"
    finally:
        for g in groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert sorted(logs) == ["scheduler.log", "server_0.log", "server_1.log", "worker_0.log",
                            "worker_1.log"]
    assert "exiting with status 0" in logs["scheduler.log"], logs
    _, ref_weights = program().reference({"opt": "momentum", "steps": 3}, workers=2)
    for rank in (0, 1):
        data = np.load(tmp_path / f"worker_{rank}.npz")
        _assert_weights([data[f"arr_{i}"] for i in range(2, len(data.files))], ref_weights)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_ps_async_decreases_loss(tmp_path):
    cfg = {"opt": "sgd", "steps": 30, "mode": "async", "batch": 16}
    with Cluster(tmp_path, cfg) as c:
        c.start_all()
        assert set(c.wait().values()) == {0}, c.all_logs()
        for rank in (0, 1):
            losses = c.result(rank)[0]
            assert losses[-5:].mean() < losses[:5].mean() - 0.05, losses


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("cache", [0, 8])
def test_ps_embedding_sparse_equals_single_device(cache, opt, tmp_path):
    """Sparse rows over 2 servers, without and with a worker cache (smaller than the
    rows a step uses), give the single-device numbers. Only the used rows are pushed;
    the servers' step is the dense one (Momentum and Adam also move rows a step did
    not use, through their state), and a worker's cached rows are refreshed with
    every row that changed since its last answer."""
    cfg = {"opt": opt, "steps": 4, "embed": True, "cache": cache}
    with Cluster(tmp_path, cfg) as c:
        c.start_all()
        assert set(c.wait().values()) == {0}, c.all_logs()
        _, ref_weights = program().reference(cfg, workers=2)
        for rank in (0, 1):
            _assert_weights(c.result(rank)[2], ref_weights)
        # the table is split by rows over both servers
        assert "embedding_table(20, 6)" in c.log("server_0") + c.log("server_1")


@pytest.mark.parametrize("cache", [0, 8])
def test_ps_embedding_initialised_on_the_servers(cache, tmp_path):
    """set_param_ps(init_in_server=True) on the table: each server makes its rows from
    the table's initializer; the workers make only the rows they look up before the
    first step and then pull them. The losses (the first one included) and the
    weights equal the single device, which makes the whole table; each worker's own
    table holds only rows it used."""
    cfg = {"opt": "adam", "steps": 4, "embed": True, "cache": cache, "init_in_server": True}
    with Cluster(tmp_path, cfg) as c:
        c.start_all()
        assert set(c.wait().values()) == {0}, c.all_logs()
        mod = program()
        ref_losses, ref_weights = mod.reference(cfg, workers=2)
        for rank in (0, 1):
            _assert_weights(c.result(rank)[2], ref_weights)
            used = np.concatenate([mod.batch(s, rank, 2, 4)[1].asnumpy().ravel()
                                   for s in range(cfg["steps"])])
            held = np.load(os.path.join(tmp_path, f"worker_{rank}_held_rows.npy"))
            assert 0 < len(held) < mod.VOCAB and set(held.tolist()) <= set(used.tolist())
        mean = (c.result(0)[0] + c.result(1)[0]) / 2
        np.testing.assert_allclose(mean, ref_losses, rtol=1e-5)
        logs = c.log("server_0") + c.log("server_1")
        assert logs.count("embedding_table(20, 6) (initialised here)") == 2, logs


def test_ps_killed_worker_job_goes_on(tmp_path):
    """Worker 1 dies at step 3: after the heartbeat timeout the servers apply the steps
    with worker 0 alone, and say so."""
    cfg = {"opt": "momentum", "steps": 6, "stop_after": 3, "stop_rank": 1}
    with Cluster(tmp_path, cfg) as c:
        c.start_all()
        codes = c.wait()
        assert codes["worker_0"] == 0 and codes["scheduler"] == 0, c.all_logs()
        _, ref_weights = program().reference(cfg, workers=2, alive_until={1: 3})
        _assert_weights(c.result(0)[2], ref_weights)
        assert "worker 1 (pid" in c.log("scheduler") and "lost" in c.log("scheduler")
        assert "sync steps go on with the live workers [0]" in c.log("server_0")


@pytest.mark.parametrize("interval", [1, 3])
def test_ps_server_restart_recovers(interval, tmp_path):
    """Server 0 killed mid-run and started again with DM_RECOVERY_PATH resumes from its
    checkpoint (every step, or every 3 with the workers pushing the missed steps
    again): the final weights equal the uninterrupted run."""
    cfg = {"opt": "adam", "steps": 8, "sleep": 0.15, "recovery_interval": interval}
    rec = {"DM_RECOVERY_PATH": str(tmp_path / "recovery")}
    with Cluster(tmp_path, cfg) as c:
        c.start_all(rec)
        c.wait_for_log("server_0", "opt0:")
        checkpoint = tmp_path / "recovery" / "server_0.safetensors"
        end = time.monotonic() + 30          # its first checkpoint (fsync may be slow)
        while not checkpoint.exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert checkpoint.exists(), c.all_logs()
        time.sleep(0.7)
        c.kill("server_0")
        c.start("DM_PSERVER", "server_0b", rec)
        codes = c.wait(["scheduler", "server_1", "server_0b", "worker_0", "worker_1"])
        assert set(codes.values()) == {0}, c.all_logs()
        assert "resumed from" in c.log("server_0b")
        _, ref_weights = program().reference(cfg, workers=2)
        for rank in (0, 1):
            _assert_weights(c.result(rank)[2], ref_weights)


def test_ps_dead_scheduler_ends_job(tmp_path):
    cfg = {"opt": "sgd", "steps": 200, "sleep": 0.05}
    with Cluster(tmp_path, cfg) as c:
        c.start_all()
        c.wait_for_log("server_0", "opt0:")
        c.kill("scheduler")
        codes = c.wait(["server_0", "server_1", "worker_0", "worker_1"], timeout=20)
        assert all(code != 0 for code in codes.values()), c.all_logs()
        for name in ("server_0", "worker_0"):
            assert "the scheduler at 127.0.0.1:" in c.log(name), c.all_logs()
            assert "is lost" in c.log(name)


# ------------------------------------------------------------------ transport


@pytest.fixture
def zmq_pair():
    """A DEALER connected to a ROUTER over TCP loopback (closed afterwards)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield dealer, router
    dealer.close(linger=0)
    router.close(linger=0)
    ctx.term()


def test_ps_transport_round_trip(zmq_pair):
    """Every dtype and shape (0-d, empty, non-contiguous, above ZeroMQ's copy threshold)
    arrives equal and writable; the header comes back as sent; a tracker per array
    (None for the ones copied into the message) reports when the frame was sent."""
    from dualmode.ps import transport
    dealer, router = zmq_pair
    big = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    arrays = [big, np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2], np.array(2.5),
              np.zeros((0, 5), np.float16), np.array([True, False]), np.arange(3, dtype=np.uint8)]
    n = transport.send(dealer, {"op": "push", "step": 3}, arrays)
    assert n == sum(a.nbytes for a in arrays)
    ident, head, got = transport.recv(router, "test", router=True)
    assert head == {"op": "push", "step": 3}
    for a, b in zip(arrays, got):
        assert (b.dtype, b.shape) == (a.dtype, a.shape)
        np.testing.assert_array_equal(a, b)
        assert b.flags.writeable
    n, trackers = transport.send_tracked(router, {"op": "pulled"}, [big, arrays[1]], ident)
    assert [t is None for t in trackers] == [False, True]      # copied: small, strided
    head, (back, small) = transport.recv(dealer, "test")
    np.testing.assert_array_equal(back, big)
    trackers[0].wait(timeout=10)
    assert trackers[0].done


def test_ps_transport_sends_a_received_frame_on(zmq_pair):
    """A received array sent on whole goes as its frame (no tracker: ZeroMQ shares the
    message) and arrives equal, also after the receiver wrote into it; a reshaped view
    of the whole goes as the frame too, a part of it like any other array."""
    from dualmode.ps import transport
    dealer, router = zmq_pair
    big = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    transport.send(dealer, {"op": "push"}, [big])
    ident, _, (got,) = transport.recv(router, "test", router=True)
    got += 1                                       # the receiver's own buffer
    frames, _, _ = transport._frames({}, [got, got.reshape(-1), got[:128]], True)
    assert isinstance(frames[1], zmq.Frame) and frames[1] is frames[2]
    assert frames[3] is not frames[1] and len(frames[3]) == got[:128].nbytes   # a part
    n, trackers = transport.send_tracked(router, {"op": "pulled"}, [got, got[:128]], ident)
    assert trackers[0] is None and trackers[1] is not None
    assert n == got.nbytes + got[:128].nbytes
    _, (back, part) = transport.recv(dealer, "test")
    np.testing.assert_array_equal(back, big + 1)
    np.testing.assert_array_equal(part, big[:128] + 1)


def test_ps_transport_template_is_read_back_exactly(zmq_pair):
    """A push sent with its header encoded once arrives as the same header and arrays
    through decode and through the template's match (which reads nothing else: a
    different field value, an extra field, another array count or size is None); the
    worker's and the server's templates of the same shards are the same bytes."""
    from dualmode.ps import transport
    dealer, router = zmq_pair
    specs = [("float32", [256, 256]), ("int64", [3]), ("float64", [])]
    arrays = [np.arange(64 * 1024, dtype=np.float32).reshape(256, 256),
              np.array([7, -1, 2**40]), np.array(2.5)]
    push = transport.push_template("opt3", 1, specs)
    assert push.nbytes == sum(a.nbytes for a in arrays)
    transport.send_encoded(dealer, push(12, 11, 2**33), arrays)
    frames = transport.recv_frames(router)
    head, got = transport.decode(frames[1:], "test")
    assert head == {"op": "push", "group": "opt3", "worker": 1, "step": 12, "base": 11,
                    "req": 2**33}
    values, matched = push.match(frames[1:])
    assert values == (12, 11, 2**33)
    for a, b, c in zip(arrays, got, matched):
        assert (c.dtype, c.shape) == (a.dtype, a.shape) and c.flags.writeable
        np.testing.assert_array_equal(b, a)
        np.testing.assert_array_equal(c, a)
    raw = push(12, 11, 5)
    assert push.match([raw] + frames[2:]) is not None
    assert transport.push_template("opt3", 0, specs).match([raw] + frames[2:]) is None
    assert transport.push_template("opt3", 1, specs[:2]).match([raw] + frames[2:4]) is None
    assert push.match([raw[:-1] + b',"x":1}'] + frames[2:]) is None        # extra field
    assert push.match([raw.replace(b'"req":5', b'"req":5.5')] + frames[2:]) is None
    assert push.match([raw] + frames[2:4]) is None                          # an array short
    assert push.match([raw, frames[2], frames[3], frames[3]]) is None       # wrong size
    answer = transport.answer_template(specs)
    assert answer.match([raw] + frames[2:]) is None
    assert transport.decode([answer(4, 9)] + frames[2:], "test")[0] == \
        {"op": "pulled", "version": 4, "req": 9}
    # the same shards described again (as the server does from the init specs)
    assert transport.push_template("opt3", 1, [(d, list(s)) for d, s in specs])(1, 2, 3) \
        == push(1, 2, 3)


def test_ps_make_writable_copies_a_shard_still_being_sent():
    """The optimizer never writes a buffer ZeroMQ may still be reading: a shard with an
    unfinished send is replaced by a copy (the buffer in flight keeps the old values);
    a finished one is updated in place."""
    from types import SimpleNamespace

    from dualmode.ps.server import make_writable
    from dualmode.tensor import Parameter, Tensor
    value = np.arange(6, dtype=np.float32)
    key = SimpleNamespace(param=Parameter(Tensor._from_array(value), name="w"),
                          sending=[SimpleNamespace(done=True), SimpleNamespace(done=False)])
    make_writable(key)
    assert key.param._data is not value and key.sending == []
    np.testing.assert_array_equal(key.param._data, value)
    key.param._data += 1
    np.testing.assert_array_equal(value, np.arange(6))            # the frame in flight
    kept = key.param._data
    key.sending = [SimpleNamespace(done=True)]
    make_writable(key)
    assert key.param._data is kept


def test_ps_sparse_answers_carry_the_cached_rows_that_changed():
    """A server's step of a sparse table is the dense one, and each answer carries the
    pusher's cached rows changed since that worker's last answer: with Adam every row
    moves (zero gradients still move rows through the moments), with plain SGD only the
    used ones. Values against the single-device optimizer on dense gradients; no
    processes (the server's handlers with its reply captured)."""
    from types import SimpleNamespace

    import dualmode as dm
    from dualmode.ps.server import _Group, _make_keys, _Server
    from dualmode.tensor import Parameter, Tensor

    specs = []
    for name, opt in (("adam_table", {"cls": "Adam", "hyper": {"beta1": 0.9, "beta2": 0.999,
                                                                 "eps": 1e-8,
                                                                 "use_nesterov": False}}),
                      ("sgd_table", {"cls": "SGD", "hyper": {"momentum": 0.0, "dampening": 0.0,
                                                               "nesterov": False}})):
        opt.update(loss_scale=1.0, lr=0.1, weight_decay=0.0)
        specs.append({"name": name, "shape": [10, 2], "dtype": "float32", "rows": [0, 10],
                      "sparse": True, "opt": opt})
    rng = np.random.default_rng(3)
    init = [rng.standard_normal((10, 2)).astype(np.float32) for _ in specs]
    keys, opts = _make_keys(specs, [v.copy() for v in init])
    assert [k.row_local for k in keys] == [False, True]
    server = _Server.__new__(_Server)
    server.groups = {"opt0": _Group("opt0", keys, opts)}
    server.cfg = SimpleNamespace(mode="sync", staleness=None, recovery_interval=1)
    server.env = SimpleNamespace(recovery_path=None)
    server.live, server.pushes, server.push_bytes = {0, 1}, {}, 0
    answers = {}
    server.reply = lambda ident, req, head, arrays=(), sent=None: \
        answers.__setitem__(req["worker"], [np.array(a) for a in arrays])

    refs = [Parameter(Tensor(v.copy()), name=f"ref{i}") for i, v in enumerate(init)]
    ref_opts = [dm.nn.Adam([refs[0]], learning_rate=0.1), dm.nn.SGD([refs[1]], learning_rate=0.1)]
    cached = {0: np.array([1, 3, 7]), 1: np.array([9])}
    steps = [{0: [1, 3], 1: [3, 5]}, {0: [1], 1: [9]}]
    for step, used in enumerate(steps):
        dense = np.zeros((10, 2), np.float32)
        for w in (0, 1):
            ids = np.array(used[w])
            rows = rng.standard_normal((len(ids), 2)).astype(np.float32)
            dense_w = np.zeros((10, 2), np.float32)
            dense_w[ids] = rows
            dense = dense + dense_w
            head = {"op": "push", "group": "opt0", "worker": w, "step": step, "base": step,
                    "req": step}
            server.on_push(bytes([w]), head, [ids, rows, cached[w]] * 2)
        for ref, opt in zip(refs, ref_opts):
            opt((Tensor(dense / 2),))
        for w in (0, 1):
            adam_ids, adam_rows, sgd_ids, sgd_rows = answers[w]
            # Adam: every cached row moved; SGD: the cached rows some worker used this
            # step (the first answer carries every cached row)
            want_sgd = cached[w] if step == 0 else \
                np.intersect1d(cached[w], np.concatenate([used[0], used[1]]))
            np.testing.assert_array_equal(adam_ids, cached[w])
            np.testing.assert_array_equal(sgd_ids, want_sgd)
            np.testing.assert_allclose(adam_rows, refs[0].asnumpy()[adam_ids], rtol=1e-6)
            np.testing.assert_allclose(sgd_rows, refs[1].asnumpy()[sgd_ids], rtol=1e-6)
        if step == 0:
            after_first = [k.param._data.copy() for k in keys]
    for key, ref in zip(keys, refs):
        np.testing.assert_allclose(key.param._data, ref.asnumpy(), rtol=1e-6, atol=1e-7)
    # row 5, used in the first step only, moved in the second under Adam, not under SGD
    assert not np.array_equal(keys[0].param._data[5], after_first[0][5])
    np.testing.assert_array_equal(keys[1].param._data[5], after_first[1][5])
