"""CommReport's predicted time under the alpha-beta model: every collective kind checked
against the ring / tree formulas of SPEC §8 computed by hand, the link presets, the
table, bad models named, and per-op times of a compiled graph."""
import math

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, ops
from dualmode.communication import SimBackend, axis_groups
from dualmode.communication.trace import LINKS, predicted_seconds
from dualmode.parallel import CommReport, compiled_comm_times

ALPHA, BETA = 1e-5, 1e-9


def _stack(n, local):
    return np.arange(n * math.prod(local), dtype=np.float32).reshape((n,) + local)


def test_predicted_time_of_each_collective_equals_the_formulas_by_hand():
    b = SimBackend(8)
    x = _stack(8, (8, 4))                                    # S = 128 bytes per device
    s = 128.0
    pairs = axis_groups((4, 2), 1)                           # 4 groups of 2
    quads = axis_groups((2, 4), 1)                           # 2 groups of 4
    with CommReport(alpha_s=ALPHA, beta_s_per_byte=BETA) as r:
        b.all_reduce(x)                                      # p = 8, n = S
        b.all_gather(x, pairs)                               # p = 2, n = 2 S (gathered)
        b.reduce_scatter(x, quads)                           # p = 4, n = S (before)
        b.all_to_all(x, None)                                # p = 8, n = S
        b.broadcast(x, None, root=1)                         # p = 8, n = S
        b.reduce(x, quads, 0, "max")                         # p = 4, n = S
        b.send_recv(x, [(0, 3)])                             # one message of S
    want = [2 * 7 * ALPHA + 2 * 7 / 8 * s * BETA,
            1 * ALPHA + 1 / 2 * (2 * s) * BETA,
            3 * ALPHA + 3 / 4 * s * BETA,
            7 * ALPHA + 7 / 8 * s * BETA,
            3 * (ALPHA + s * BETA),
            2 * (ALPHA + s * BETA),
            ALPHA + s * BETA]
    got = [r.record_time(rec) for rec in r.records]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(r.predicted_time(), sum(want), rtol=1e-12)
    np.testing.assert_allclose(r.predicted_time("AllGather"), want[1], rtol=1e-12)
    np.testing.assert_allclose(r.predicted_time(reason="user"), sum(want), rtol=1e-12)
    assert r.predicted_time(reason="gradient") == 0.0


def test_scatter_gather_push_pull_and_single_device_groups():
    assert predicted_seconds("Scatter", 4, 400.0, ALPHA, BETA) == pytest.approx(
        3 * ALPHA + 3 / 4 * 400 * BETA, rel=1e-12)
    assert predicted_seconds("Gather", 4, 400.0, ALPHA, BETA) == pytest.approx(
        3 * ALPHA + 300 * BETA, rel=1e-12)
    assert predicted_seconds("Push", 1, 1000.0, ALPHA, BETA) == pytest.approx(
        ALPHA + 1000 * BETA, rel=1e-12)
    assert predicted_seconds("Pull", 1, 1000.0, ALPHA, BETA) == pytest.approx(
        ALPHA + 1000 * BETA, rel=1e-12)
    for kind in ("AllReduce", "AllGather", "Broadcast", "Send/Recv"):
        assert predicted_seconds(kind, 1, 1000.0, ALPHA, BETA) == 0.0
    # Broadcast rounds up to whole tree levels: 5 devices take 3 rounds
    assert predicted_seconds("Broadcast", 5, 10.0, ALPHA, BETA) == pytest.approx(
        3 * (ALPHA + 10 * BETA), rel=1e-12)


def test_link_presets_and_two_strategies_compared():
    b = SimBackend(8)
    x = _stack(8, (256, 256))                                # 256 KiB per device
    with CommReport(link="10GbE") as slow, CommReport(link="100GbE") as fast:
        b.all_reduce(x)
    a10, b10 = LINKS["10GbE"]
    n = 256 * 256 * 4
    assert slow.predicted_time() == pytest.approx(14 * a10 + 14 / 8 * n * b10, rel=1e-12)
    assert fast.predicted_time() < slow.predicted_time()
    # the same bytes as one AllGather of 1/8 (what a sharded strategy would move) is cheaper
    with CommReport(link="10GbE") as sharded:
        b.all_gather(_stack(8, (32, 256)))
    assert sharded.predicted_time() < slow.predicted_time()


def test_report_table_shows_predicted_times():
    b = SimBackend(4)
    with CommReport(link="nvlink") as r:
        b.all_reduce(_stack(4, (4,)))
    text = str(r)
    assert "predicted" in text and "AllReduce" in text
    assert "predicted" in repr(r)
    with CommReport() as plain:
        b.all_reduce(_stack(4, (4,)))
    assert "predicted" not in str(plain)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"link": "5G"}, ValueError, r"CommReport: link='5G' is not valid; expected one of "
                                 r"'10GbE', '100GbE', 'nvlink'"),
    ({"alpha_s": 1e-6}, ValueError, r"CommReport: beta_s_per_byte is missing"),
    ({"beta_s_per_byte": 1e-9}, ValueError, r"CommReport: alpha_s is missing"),
    ({"alpha_s": -1.0, "beta_s_per_byte": 1e-9}, ValueError,
     r"CommReport: alpha_s=-1.0 is not valid; expected a finite number >= 0"),
    ({"alpha_s": "1us", "beta_s_per_byte": 1e-9}, TypeError,
     r"CommReport: alpha_s='1us' has type str; expected a number"),
    ({"alpha_s": 1e-6, "beta_s_per_byte": 1e-9, "link": "10GbE"}, ValueError,
     r"CommReport: give either link='10GbE' or alpha_s/beta_s_per_byte, not both"),
])
def test_bad_network_models_are_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        CommReport(**kwargs)


def test_predicted_time_without_a_model_says_how_to_give_one():
    r = CommReport()
    with pytest.raises(RuntimeError, match=r"CommReport.predicted_time: no network model; "
                                           r"create the report with CommReport\(alpha_s="):
        r.predicted_time()
    with pytest.raises(ValueError, match=r"CommReport.predicted_time: kind='Allreduce' is "
                                         r"not valid"):
        CommReport(link="10GbE").predicted_time("Allreduce")
    with pytest.raises(ValueError, match=r"predicted_seconds: kind='Ring' is not valid"):
        predicted_seconds("Ring", 2, 1.0, ALPHA, BETA)


def test_compiled_graph_times_per_op_equal_the_report_of_its_run(sim_devices):
    sim_devices(4)
    w = Tensor(np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32))

    def block(x, w):
        return ops.relu(ops.matmul(x, w))

    f = ops.shard(block, in_strategy=((1, 4), (4, 1)))
    x = Tensor(np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32))
    f(x, w)                                                   # compile
    compiled = f.compiled
    with CommReport(alpha_s=ALPHA, beta_s_per_byte=BETA) as rep:
        f(x, w)
    per_op = compiled_comm_times(compiled, alpha_s=ALPHA, beta_s_per_byte=BETA)
    assert per_op, "the contracted split must communicate"
    total = sum(e["time"] for e in per_op.values())
    assert total == pytest.approx(rep.predicted_time(), rel=1e-9)
    names = set(compiled.strategies())
    assert set(per_op) <= names
    assert compiled_comm_times(f, alpha_s=ALPHA, beta_s_per_byte=BETA) == per_op


def test_compiled_comm_times_bad_arguments():
    with pytest.raises(ValueError, match=r"compiled_comm_times: no network model"):
        compiled_comm_times(object())
    with pytest.raises(TypeError, match=r"compiled_comm_times: compiled=object is not a "
                                        r"compiled graph"):
        compiled_comm_times(object(), link="10GbE")
