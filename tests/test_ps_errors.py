"""Bad input in parameter server mode: every error names the variable (or address,
key, parameter), the bad value and what is valid; nothing hangs."""
import os
import re
import socket

import numpy as np
import pytest

import dualmode as dm
from dualmode import communication, nn
from dualmode.ps.optim import optimizer_spec

from _ps import Cluster, free_port

pytest.importorskip("zmq", reason="parameter server mode needs pyzmq")


@pytest.fixture
def ps_env(monkeypatch):
    """A clean DM_*/MS_* environment and PS mode on (a short connect timeout);
    communication is back on "sim" afterwards."""
    for k in list(os.environ):
        if k.startswith(("DM_", "MS_", "PMI_", "OMPI_")):
            monkeypatch.delenv(k)
    port = free_port()
    for k, v in {"DM_SERVER_NUM": "1", "DM_WORKER_NUM": "1", "DM_SCHED_HOST": "127.0.0.1",
                 "DM_SCHED_PORT": str(port), "DM_ROLE": "DM_WORKER"}.items():
        monkeypatch.setenv(k, v)
    dm.set_ps_context(enable_ps=True, connect_timeout=0.5, heartbeat_interval=0.1,
                      heartbeat_timeout=0.5)
    yield port
    dm.reset_ps_context()
    communication.init("sim")


# ------------------------------------------------------------- set_ps_context


def test_ps_context_values_checked():
    with pytest.raises(ValueError, match=r"set_ps_context: mode='semi' is not valid; "
                                         r"expected one of 'sync', 'async'"):
        dm.set_ps_context(mode="semi")
    with pytest.raises(TypeError, match=r"enable_ps=1 has type int; expected a bool"):
        dm.set_ps_context(enable_ps=1)
    with pytest.raises(ValueError, match=r"unknown key 'server_num'; valid keys are"):
        dm.set_ps_context(server_num=2)
    with pytest.raises(ValueError, match=r"staleness=2 needs mode='async'"):
        dm.set_ps_context(staleness=2)
    with pytest.raises(ValueError, match=r"heartbeat_timeout=1.0 must exceed "
                                         r"heartbeat_interval=2.0"):
        dm.set_ps_context(heartbeat_interval=2.0, heartbeat_timeout=1.0)
    with pytest.raises(ValueError, match=r"connect_timeout=0 is not valid; expected a finite "
                                         r"number of seconds > 0"):
        dm.set_ps_context(connect_timeout=0)
    assert dm.get_ps_context("enable_ps") is False          # nothing was applied
    dm.set_ps_context(mode="async", staleness=3)
    assert (dm.get_ps_context("mode"), dm.get_ps_context("staleness")) == ("async", 3)
    dm.reset_ps_context()
    assert dm.get_ps_context("mode") == "sync"
    with pytest.raises(ValueError, match=r"get_ps_context: unknown key 'role'"):
        dm.get_ps_context("role")


# ------------------------------------------------------------------ roles


@pytest.mark.parametrize("var, value, message", [
    ("DM_ROLE", "DM_BOSS", r"init: DM_ROLE='DM_BOSS' is not a parameter server role; "
                           r"expected one of 'DM_SCHED', 'MS_SCHED', 'DM_PSERVER'"),
    ("DM_WORKER_NUM", "0", r"init: DM_WORKER_NUM='0' is not valid; expected an int in "
                           r"\[1, 4096\]"),
    ("DM_SERVER_NUM", "two", r"init: DM_SERVER_NUM='two' is not valid"),
    ("DM_SCHED_PORT", "70000", r"init: DM_SCHED_PORT='70000' is not a valid port; expected "
                               r"an int in \[1, 65535\]"),
    ("DM_SCHED_HOST", "no-such-host.invalid", r"init: DM_SCHED_HOST='no-such-host.invalid' "
                                              r"is not a host name or IPv4 address"),
])
def test_ps_bad_environment_named(ps_env, monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        communication.init()


def test_ps_missing_and_disagreeing_variables(ps_env, monkeypatch):
    monkeypatch.delenv("DM_SERVER_NUM")
    with pytest.raises(ValueError, match=r"needs the environment variable DM_SERVER_NUM "
                                         r"\(or MS_SERVER_NUM\)"):
        communication.init()
    monkeypatch.setenv("DM_SERVER_NUM", "1")
    monkeypatch.setenv("MS_ROLE", "MS_SCHED")
    with pytest.raises(ValueError, match=r"DM_ROLE='DM_WORKER' and MS_ROLE='MS_SCHED' "
                                         r"disagree"):
        communication.init()


def test_ps_scheduler_unreachable_within_timeout(ps_env):
    with pytest.raises(RuntimeError, match=rf"no answer from the scheduler at DM_SCHED_HOST:"
                                           rf"DM_SCHED_PORT=127.0.0.1:{ps_env} within "
                                           rf"connect_timeout=0.5 s"):
        communication.init()
    assert dm.context._STATE.ps_role is None


def test_ps_scheduler_port_in_use(ps_env, monkeypatch):
    monkeypatch.setenv("DM_ROLE", "DM_SCHED")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ps_env))
        s.listen(1)
        with pytest.raises(RuntimeError, match=rf"the scheduler cannot listen on DM_SCHED_HOST:"
                                               rf"DM_SCHED_PORT .*= 127.0.0.1:{ps_env} "
                                               rf"\(Address already in use"):
            communication.init()


def test_ps_counts_that_do_not_match(ps_env, monkeypatch, tmp_path):
    """A worker started with DM_WORKER_NUM=3 against a scheduler started with 1."""
    from _ps import base_env
    env = base_env("DM", 1, 1, port=ps_env)
    with Cluster(tmp_path, {"steps": 1, "connect_timeout": 5}, env=env) as c:
        c.start("DM_SCHED", "scheduler")
        monkeypatch.setenv("DM_WORKER_NUM", "3")
        dm.set_ps_context(connect_timeout=10.0)
        with pytest.raises(RuntimeError, match=r"the scheduler refused this worker: "
                                               r"DM_WORKER_NUM \(MS_WORKER_NUM\)=3 on a worker "
                                               r"\(pid \d+\) does not match DM_WORKER_NUM=1 on "
                                               r"the scheduler"):
            communication.init()
        monkeypatch.setenv("DM_WORKER_NUM", "1")
        dm.set_ps_context(mode="async")
        with pytest.raises(RuntimeError, match=r"set_ps_context\(mode='async', staleness="
                                               r"None\) on a worker .* differs from "
                                               r"mode='sync', staleness=None on the scheduler"):
            communication.init()


# --------------------------------------------------- in the training script


def test_ps_hybrid_without_mpi_refused(tmp_path):
    """Workers started by hand (no MPI) with a trainable weight left on them."""
    with Cluster(tmp_path, {"steps": 2, "hybrid_plain": True}) as c:
        c.start_all()
        codes = c.wait()
        assert codes["worker_0"] != 0 and codes["worker_1"] != 0
        assert ("RuntimeError: SGD: parameter 'fc2.weight' is trainable but not held by the "
                "parameter servers, and this worker runs without MPI") in c.log("worker_0")


def test_ps_workers_seeded_differently_refused(tmp_path):
    with Cluster(tmp_path, {"steps": 2, "seed_by_rank": True}) as c:
        c.start_all()
        c.wait()
        logs = c.log("worker_0") + c.log("worker_1")
        # both weights differ; which server reports first depends on timing
        assert re.search(r"initial value of parameter 'fc1\.(weight|bias)' differs from the "
                         r"first worker's; seed every worker alike \(dm\.set_seed\)", logs), \
            c.all_logs()


def test_ps_parameter_marks():
    net = nn.Dense(3, 2)
    assert not net.weight.is_param_ps
    assert net.set_param_ps() is net
    assert net.weight.is_param_ps and net.bias.is_param_ps
    with pytest.raises(ValueError, match=r"Parameter weight: set_param_ps\(init_in_server=True"
                                         r"\) is supported for the embedding_table of an "
                                         r"nn.EmbeddingLookup with sparse=True only"):
        net.weight.set_param_ps(init_in_server=True)
    with pytest.raises(TypeError, match=r"set_param_ps\(init_in_server='yes'\) needs a bool"):
        net.weight.set_param_ps(init_in_server="yes")
    assert net.weight.__dict__["ps_init_in_server"] is False       # unchanged
    dense = nn.EmbeddingLookup(10, 3, sparse=False)
    with pytest.raises(ValueError, match=r"embedding_table: set_param_ps\(init_in_server=True"):
        dense.embedding_table.set_param_ps(init_in_server=True)


def test_ps_init_in_server_marks():
    """A cell marks its weights init_in_server only when every one can take it (else
    nothing is marked); a table whose value this process already made cannot be
    initialised on the servers."""
    from dualmode.ps.embedding import server_initialised

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.lookup = nn.EmbeddingLookup(10, 3)
            self.fc = nn.Dense(3, 2)

    net = Net()
    with pytest.raises(ValueError, match=r"Parameter fc.weight: set_param_ps\(init_in_server"):
        net.set_param_ps(init_in_server=True)
    assert not any(p.is_param_ps for p in net.trainable_params())
    table = net.lookup.embedding_table
    assert server_initialised(table) is None                  # not marked
    net.lookup.set_param_ps(init_in_server=True)
    assert table.is_param_ps and not net.fc.weight.is_param_ps
    # outside a parameter server worker the table was made at once: the mark cannot
    # keep this process from making it
    with pytest.raises(RuntimeError, match=r"Parameter lookup.embedding_table: set_param_ps\("
                                           r"init_in_server=True\), but this worker already "
                                           r"made the table's value"):
        server_initialised(table)


def test_ps_optimizer_that_cannot_run_on_servers():
    net = nn.Dense(3, 2)
    opt = nn.SGD(net.trainable_params(), learning_rate=lambda step: 0.1)
    with pytest.raises(ValueError, match=r"SGD: parameter 'weight' is held by the parameter "
                                         r"servers and its learning rate is a callable"):
        optimizer_spec(opt, 0)

    class Mine(nn.SGD):
        pass

    with pytest.raises(ValueError, match=r"Mine: parameter 'weight' is held by the parameter "
                                         r"servers, which run SGD, Momentum or Adam"):
        optimizer_spec(Mine(net.trainable_params()), 0)


def test_embedding_lookup_arguments_and_plain_lookup():
    with pytest.raises(ValueError, match=r"EmbeddingLookup: vocab_cache_size=4 needs "
                                         r"sparse=True"):
        nn.EmbeddingLookup(10, 3, sparse=False, vocab_cache_size=4)
    with pytest.raises(ValueError, match=r"EmbeddingLookup: slice_mode='table_row_slice' is "
                                         r"not supported; expected 'batch_slice'"):
        nn.EmbeddingLookup(10, 3, slice_mode="table_row_slice")
    with pytest.raises(ValueError, match=r"EmbeddingLookup: target='GPU' is not valid"):
        nn.EmbeddingLookup(10, 3, target="GPU")
    lookup = nn.EmbeddingLookup(10, 3, vocab_cache_size=4)
    ids = np.array([[1, 9], [9, 0]], np.int32)
    out = lookup(dm.Tensor(ids)).asnumpy()
    np.testing.assert_array_equal(out, lookup.embedding_table.asnumpy()[ids])


# ------------------------------------------------------------------ messages


def test_ps_malformed_messages_named():
    """A message that is not ours raises PSError naming where it came from."""
    from dualmode.ps.transport import PSError, decode, encode
    where = "server 0 (tcp://127.0.0.1:1)"
    with pytest.raises(PSError, match=r"server 0 \(tcp://127.0.0.1:1\): the message header "
                                      r"is not JSON"):
        decode([b"\x80not json"], where)
    with pytest.raises(PSError, match=r"server 0 .*: the message header is a list; expected "
                                      r"a JSON object"):
        decode([b"[1, 2]"], where)
    frames = encode({"op": "push"}, [np.zeros(3, np.float32)])
    with pytest.raises(PSError, match=r"the header lists 1 arrays but 2 buffers followed"):
        decode(frames + [b"x"], where)
    with pytest.raises(PSError, match=r"array spec \['complex64', \[3\]\] is not \[dtype, "
                                      r"shape\] with a dtype among float16, float32"):
        decode([b'{"arrays": [["complex64", [3]]]}', bytes(24)], where)
    with pytest.raises(PSError, match=r"an array of shape \(4,\) \(float32\) arrived with 3 "
                                      r"elements"):
        decode([b'{"arrays": [["float32", [4]]]}', bytes(12)], where)


def test_ps_push_of_wrong_shapes_refused():
    """A push whose arrays do not match the server's shards is refused naming the
    shard, before any gradient is summed or applied."""
    from dualmode.ps.server import _Group, _make_keys, split_push
    from dualmode.ps.transport import PSError
    spec = {"cls": "SGD", "hyper": {"momentum": 0.0, "dampening": 0.0, "nesterov": False},
            "loss_scale": 1.0, "lr": 0.1, "weight_decay": 0.0}
    specs = [{"name": "fc.weight", "shape": [4, 3], "dtype": "float32", "rows": None,
              "sparse": False, "opt": spec},
             {"name": "table", "shape": [10, 2], "dtype": "float32", "rows": [0, 10],
              "sparse": True, "opt": spec}]
    keys, opts = _make_keys(specs, [np.zeros((4, 3), np.float32), np.zeros((10, 2), np.float32)])
    g = _Group("opt0", keys, opts)
    assert len(opts) == 2                           # the sparse table has its own optimizer
    ids, rows = np.array([1, 4]), np.zeros((2, 2), np.float32)
    cached = np.array([4, 9])
    grad = np.ones((4, 3), np.float32)
    assert split_push(g, [grad, ids, rows, cached], "w")[0] is grad
    with pytest.raises(PSError, match=r"push from worker 1: 3 arrays for 2 shard\(s\) of opt0; "
                                      r"expected 4"):
        split_push(g, [grad, ids, rows], "push from worker 1")
    with pytest.raises(PSError, match=r"push from worker 1: the gradient of 'fc.weight' has "
                                      r"shape \(3, 4\); the shard has shape \(4, 3\)"):
        split_push(g, [grad.T.copy(), ids, rows, cached], "push from worker 1")
    with pytest.raises(PSError, match=r"the rows of 'table' have shape \(2, 3\) for \(2,\) "
                                      r"ids; expected rows of shape \(2,\)"):
        split_push(g, [grad, ids, np.zeros((2, 3), np.float32), cached], "push from worker 1")
    with pytest.raises(PSError, match=r"the ids of 'table' must be a 1-D array of integers in "
                                      r"this server's rows \[0, 10\), got int64 \(2,\) in "
                                      r"\[1, 12\]"):
        split_push(g, [grad, np.array([1, 12]), rows, cached], "push from worker 1")
    with pytest.raises(PSError, match=r"the cached ids of 'table' must be a 1-D array of "
                                      r"integers in this server's rows \[0, 10\), got "
                                      r"float64 \(1,\) in \[2.0, 2.0\]"):
        split_push(g, [grad, ids, rows, np.array([2.0])], "push from worker 1")
    with pytest.raises(PSError, match=r"the cached ids of 'table' .* got int64 \(1, 1\)"):
        split_push(g, [grad, ids, rows, np.array([[2]])], "push from worker 1")
