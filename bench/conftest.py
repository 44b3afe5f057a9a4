"""Benchmark helpers: every dualmode benchmark is read against a plain-numpy
baseline measured in the same run; the ratios go into ``extra_info`` and a table
printed at the end of the session."""
import ctypes
import ctypes.util
import statistics
import sys
import time
from pathlib import Path

import pytest

# the benchmarks run some of the tests' helper networks (tests/_sharded_weights.py)
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))


def _steady_malloc():
    """Keep freed memory in the process (glibc): without this, each step's large
    temporaries are mmap'ed fresh and page-faulted in, and the same step's time swings
    by ~1.6x with the allocator's state. Applies to numpy and dualmode alike."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 31)
    except (OSError, AttributeError):
        pass


_steady_malloc()

_MEDIANS = {}
_RATIOS = []


def _median(benchmark):
    return benchmark.stats.stats.median


@pytest.fixture
def record():
    """record(benchmark, key, baseline_key=None, target=None): store this run's median
    under `key`; with `baseline_key`, also the ratio to that baseline."""

    def _record(benchmark, key, baseline_key=None, target=None):
        if getattr(benchmark, "stats", None) is None:     # --benchmark-disable: no timings
            return None
        med = _median(benchmark)
        _MEDIANS[key] = med
        benchmark.extra_info["median_s"] = med
        if baseline_key is not None:
            base = _MEDIANS.get(baseline_key)
            if base is None:
                benchmark.extra_info["ratio"] = None
                return None
            ratio = med / base
            benchmark.extra_info["ratio"] = ratio
            benchmark.extra_info["baseline"] = baseline_key
            if target is not None:
                benchmark.extra_info["target"] = target
            _RATIOS.append((key, baseline_key, ratio, target))
            return ratio
        return None

    return _record


@pytest.fixture
def paired(record):
    """paired(benchmark, fn, args, baseline, baseline_args, key, baseline_key,
    target=None, rounds=20, warmup_rounds=2): time `fn(*args)` with pytest-benchmark and,
    before each of its rounds, one `baseline(*baseline_args)` timed by hand; record both
    medians and the ratio. The two alternate round by round, so a drift of the machine's
    speed during the run (this VM's swings 1.2-1.5x between minutes) moves both alike,
    where two blocks of rounds one after the other would each see a different machine."""

    def _paired(benchmark, fn, args, baseline, baseline_args, key, baseline_key,
                target=None, rounds=20, warmup_rounds=2):
        times = []

        def setup():
            start = time.perf_counter()
            baseline(*baseline_args)
            times.append(time.perf_counter() - start)
            return args, {}

        benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=warmup_rounds,
                           iterations=1)
        if getattr(benchmark, "stats", None) is None:     # --benchmark-disable
            return None
        _MEDIANS[baseline_key] = statistics.median(times[warmup_rounds:])
        benchmark.extra_info["baseline_median_s"] = _MEDIANS[baseline_key]
        return record(benchmark, key, baseline_key, target=target)

    return _paired


@pytest.fixture
def record_value():
    """record_value(key, seconds, baseline_key=None, target=None): like ``record`` for a
    time measured elsewhere (e.g. inside rank 0 of an MPI job)."""

    def _record(key, seconds, baseline_key=None, target=None):
        _MEDIANS[key] = seconds
        base = _MEDIANS.get(baseline_key) if baseline_key is not None else None
        if base is None:
            return None
        ratio = seconds / base
        _RATIOS.append((key, baseline_key, ratio, target))
        return ratio

    return _record


def pytest_terminal_summary(terminalreporter):
    if not _RATIOS:
        return
    tr = terminalreporter
    tr.write_sep("=", "dualmode / numpy baseline (median, same run)")
    for key, base, ratio, target in _RATIOS:
        t = f"  target <= {target:.2f}x" if target is not None and target >= 1 else (
            f"  target >= {1 / target:.2f}x faster" if target is not None else "")
        tr.write_line(f"{key:<44} vs {base:<28} {ratio:6.2f}x{t}")


@pytest.fixture
def parallel_context():
    """parallel_context(mode, devices): a parallel context of simulated devices for one
    benchmark (gradients_mean=True), reset afterwards."""
    import dualmode as dm
    from dualmode import communication

    def setup(mode, devices):
        dm.set_auto_parallel_context(parallel_mode=mode, device_num=devices,
                                     gradients_mean=True)
        communication.init()

    yield setup
    dm.reset_auto_parallel_context()
    communication.init()
