"""Plain Python/numpy reference for the Philox kernels in `_random.pyx` (tests compare
the two; the conversions are documented there).

``philox_words`` is the textbook algorithm on Python ints for any word width (32 bits:
Philox4x32-10, the kernel's; 64 bits: Philox4x64-10, numpy's ``np.random.Philox``), so
the round structure can be checked against numpy and the 32-bit constants against the
published Random123 known-answer vectors. ``uniform`` and ``normal`` are the element
values, vectorised with numpy for the Philox words and with ``math`` for Box-Muller.
"""
import math

import numpy as np

# (multipliers, Weyl key increments) per word width (Salmon et al. 2011, table 2)
_CONSTANTS = {
    32: ((0xD2511F53, 0xCD9E8D57), (0x9E3779B9, 0xBB67AE85)),
    64: ((0xD2E7470EE14C6C93, 0xCA5A826395121157), (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B)),
}


def philox_words(counter, key, width=32, rounds=10):
    """Philox4xW-R of the 4-word `counter` under the 2-word `key` (Python ints)."""
    (m0, m1), (w0, w1) = _CONSTANTS[width]
    mask = (1 << width) - 1
    x = [int(c) & mask for c in counter]
    k0, k1 = (int(k) & mask for k in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        p0, p1 = m0 * x[0], m1 * x[2]
        x = [(p1 >> width) ^ x[1] ^ k0, p1 & mask, (p0 >> width) ^ x[3] ^ k1, p0 & mask]
    return tuple(x)


def words(key, index):
    """The four Philox4x32-10 words (uint32 arrays) of the elements `index` (int64) of
    the tensor of `key`: counter ``(lo32(i), hi32(i), 0, 0)``, key ``(lo32, hi32)``."""
    i = np.asarray(index, np.int64).astype(np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    x = [i & m32, i >> np.uint64(32), np.zeros_like(i), np.zeros_like(i)]
    (m0, m1), (w0, w1) = _CONSTANTS[32]
    k0, k1 = int(key) & 0xFFFFFFFF, (int(key) >> 32) & 0xFFFFFFFF
    for r in range(10):
        if r:
            k0, k1 = (k0 + w0) & 0xFFFFFFFF, (k1 + w1) & 0xFFFFFFFF
        p0, p1 = np.uint64(m0) * x[0], np.uint64(m1) * x[2]   # exact: < 2**64
        x = [(p1 >> np.uint64(32)) ^ x[1] ^ np.uint64(k0), p1 & m32,
             (p0 >> np.uint64(32)) ^ x[3] ^ np.uint64(k1), p0 & m32]
    return x


def _u53(lo, hi):
    return ((hi << np.uint64(32)) | lo) >> np.uint64(11)


def uniform(key, index, dtype=np.float64, low=0.0, high=1.0):
    """Reference for ``fill_index(..., dist=UNIFORM)``."""
    x = words(key, index)
    if np.dtype(dtype) == np.float32:
        u = (x[0] >> np.uint64(8)).astype(np.float64) * 2.0 ** -24
    else:
        u = _u53(x[0], x[1]).astype(np.float64) * 2.0 ** -53
    return (low + (high - low) * u).astype(dtype)


def normal(key, index, dtype=np.float64, mean=0.0, std=1.0):
    """Reference for ``fill_index(..., dist=NORMAL)``: Box-Muller with libm's log/cos."""
    x = words(key, index)
    u1 = (_u53(x[0], x[1]) + np.uint64(1)).astype(np.float64) * 2.0 ** -53
    u2 = _u53(x[2], x[3]).astype(np.float64) * 2.0 ** -53
    two_pi = 2.0 * math.pi
    z = np.array([math.sqrt(-2.0 * math.log(a)) * math.cos(two_pi * b)
                  for a, b in zip(u1.tolist(), u2.tolist())], np.float64)
    return (mean + std * z).astype(dtype)
