# cython: language_level=3
"""CRC-32 (zlib's: reflected polynomial 0xEDB88320, initial and final inversion) of
checkpoint data, by carry-less multiplication (PCLMULQDQ), GIL released.

zlib 1.2's table-driven ``crc32`` runs at ~2 GB/s; a checkpoint is verified chunk by
chunk on every load, so that cost sat beside every read. The kernel folds the data into
four accumulators (the method of Gopal, Ozturk et al., "Fast CRC computation for
generic polynomials using PCLMULQDQ", Intel 2009): 128 bytes per step in 256-bit
registers where the CPU has VPCLMULQDQ and AVX2 (~20 GB/s from cache), else 64 bytes
per step in 128-bit ones (~10 GB/s); the lanes are then folded into one and reduced to
32 bits with a Barrett reduction; lengths not a multiple of 16 finish bytewise. The
folding constants are ``x^(d+32)`` and ``x^(d-32)`` mod P (bit-reflected, shifted left
once) for a fold distance of ``d`` bits. Its reference is ``zlib.crc32`` itself (the
tests compare the two for every width the CPU has and every length class).

On a CPU without PCLMULQDQ (or a non-x86 build) ``HAVE_CLMUL`` is False and callers
use ``zlib.crc32``; the kernel then loops bytewise (slow but correct).

* ``crc32(buf, value=0)``: the CRC of a contiguous buffer, continuing from `value`.
* ``chunk_crcs(buf, chunk, out)``: ``out[k] = crc32(buf[k*chunk:(k+1)*chunk])``.
* ``copy_chunk_crcs(src, dst, chunk, out)``: ``dst[:] = src`` and the chunk CRCs of it,
  in one pass over memory (each 32 bytes loaded once, stored and folded): reading a
  checkpoint from the page cache (mapped) and verifying it costs about one copy.
"""
from libc.stdint cimport uint8_t, uint32_t

cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>
    #include <string.h>

    static uint32_t dm_crc_table[256];

    static void dm_crc_init(void) {
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t c = n;
            for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            dm_crc_table[n] = c;
        }
    }

    /* raw (non-inverted) CRC register over len bytes, one byte at a time */
    static uint32_t dm_crc_bytes(uint32_t c, const uint8_t *p, size_t len) {
        while (len--) c = dm_crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
        return c;
    }

    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    #include <immintrin.h>
    #define DM_CLMUL_BUILT 1

    static int dm_have_clmul(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    }

    #define DM_FOLD(x, k, data) _mm_xor_si128(_mm_xor_si128( \\
        _mm_clmulepi64_si128((x), (k), 0x00), _mm_clmulepi64_si128((x), (k), 0x11)), (data))

    static uint32_t dm_crc_reduce(__m128i x1);

    /* raw CRC register over len bytes; len >= 64 and a multiple of 16 */
    __attribute__((target("pclmul,sse4.1")))
    static uint32_t dm_crc_fold(uint32_t c, const uint8_t *p, size_t len) {
        const __m128i *q = (const __m128i *)p;
        __m128i x1 = _mm_loadu_si128(q), x2 = _mm_loadu_si128(q + 1);
        __m128i x3 = _mm_loadu_si128(q + 2), x4 = _mm_loadu_si128(q + 3);
        x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)c));
        q += 4; len -= 64;
        /* x^(4*128+32), x^(4*128-32) mod P, bit-reflected: fold 64 bytes forward */
        __m128i k = _mm_set_epi64x(0x00000001c6e41596LL, 0x0000000154442bd4LL);
        while (len >= 64) {
            x1 = DM_FOLD(x1, k, _mm_loadu_si128(q));
            x2 = DM_FOLD(x2, k, _mm_loadu_si128(q + 1));
            x3 = DM_FOLD(x3, k, _mm_loadu_si128(q + 2));
            x4 = DM_FOLD(x4, k, _mm_loadu_si128(q + 3));
            q += 4; len -= 64;
        }
        /* x^(128+32), x^(128-32) mod P: fold 16 bytes forward */
        k = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
        x1 = DM_FOLD(x1, k, x2);
        x1 = DM_FOLD(x1, k, x3);
        x1 = DM_FOLD(x1, k, x4);
        while (len >= 16) {
            x1 = DM_FOLD(x1, k, _mm_loadu_si128(q));
            q += 1; len -= 16;
        }
        return dm_crc_reduce(x1);
    }

    /* the 128-bit remainder x1 reduced to the 32-bit CRC register */
    __attribute__((target("pclmul,sse4.1")))
    static uint32_t dm_crc_reduce(__m128i x1) {
        __m128i k = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
        /* 128 -> 64 bits (appending 32 zero bits) */
        __m128i t = _mm_clmulepi64_si128(x1, k, 0x10);
        x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
        /* 64 -> 32 bits */
        const __m128i mask = _mm_set_epi32(0, 0, 0, -1);
        k = _mm_set_epi64x(0, 0x0000000163cd6124LL);
        t = _mm_srli_si128(x1, 4);
        x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask), k, 0x00), t);
        /* Barrett reduction: u = floor(x^64 / P), P' (both bit-reflected) */
        k = _mm_set_epi64x(0x00000001f7011641LL, 0x00000001db710641LL);
        t = x1;
        x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask), k, 0x10);
        x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask), k, 0x00);
        x1 = _mm_xor_si128(x1, t);
        return (uint32_t)_mm_extract_epi32(x1, 1);
    }
    static int dm_have_vclmul(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    }

    #define DM_FOLD256(x, k, data) _mm256_xor_si256(_mm256_xor_si256( \
        _mm256_clmulepi64_epi128((x), (k), 0x00), _mm256_clmulepi64_epi128((x), (k), 0x11)), \
        (data))

    /* the eight 128-bit lanes of four 256-bit accumulators folded into one */
    __attribute__((target("vpclmulqdq,avx2,pclmul,sse4.1")))
    static inline __m128i dm_fold_lanes(__m256i y0, __m256i y1, __m256i y2, __m256i y3) {
        const __m128i k = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
        __m128i x = _mm256_castsi256_si128(y0);
        x = DM_FOLD(x, k, _mm256_extracti128_si256(y0, 1));
        x = DM_FOLD(x, k, _mm256_castsi256_si128(y1));
        x = DM_FOLD(x, k, _mm256_extracti128_si256(y1, 1));
        x = DM_FOLD(x, k, _mm256_castsi256_si128(y2));
        x = DM_FOLD(x, k, _mm256_extracti128_si256(y2, 1));
        x = DM_FOLD(x, k, _mm256_castsi256_si128(y3));
        x = DM_FOLD(x, k, _mm256_extracti128_si256(y3, 1));
        return x;
    }

    /* raw CRC register over len bytes; len >= 128 and a multiple of 16: four 256-bit
       accumulators fold 128 bytes per step, then their eight 128-bit lanes are folded
       into one, 16 bytes at a time, and the rest goes as in dm_crc_fold */
    __attribute__((target("vpclmulqdq,avx2,pclmul,sse4.1")))
    static uint32_t dm_crc_fold256(uint32_t c, const uint8_t *p, size_t len) {
        const __m256i *q = (const __m256i *)p;
        __m256i y0 = _mm256_loadu_si256(q), y1 = _mm256_loadu_si256(q + 1);
        __m256i y2 = _mm256_loadu_si256(q + 2), y3 = _mm256_loadu_si256(q + 3);
        y0 = _mm256_xor_si256(y0, _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)c)));
        q += 4; len -= 128;
        /* x^(1024+32), x^(1024-32) mod P, bit-reflected, in both lanes */
        const __m256i k4 = _mm256_set_epi64x(0x000000014a7fe880LL, 0x00000001e88ef372LL,
                                             0x000000014a7fe880LL, 0x00000001e88ef372LL);
        while (len >= 128) {
            y0 = DM_FOLD256(y0, k4, _mm256_loadu_si256(q));
            y1 = DM_FOLD256(y1, k4, _mm256_loadu_si256(q + 1));
            y2 = DM_FOLD256(y2, k4, _mm256_loadu_si256(q + 2));
            y3 = DM_FOLD256(y3, k4, _mm256_loadu_si256(q + 3));
            q += 4; len -= 128;
        }
        __m128i x = dm_fold_lanes(y0, y1, y2, y3);
        /* x^(128+32), x^(128-32) mod P: fold 16 bytes forward */
        const __m128i k = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
        const __m128i *r = (const __m128i *)q;
        while (len >= 16) {
            x = DM_FOLD(x, k, _mm_loadu_si128(r));
            r += 1; len -= 16;
        }
        return dm_crc_reduce(x);
    }
    /* dm_crc_fold256 that also stores every 32 bytes it loads to dst: one pass over
       memory copies and checksums (len >= 128, a multiple of 128) */
    __attribute__((target("vpclmulqdq,avx2,pclmul,sse4.1")))
    static uint32_t dm_crc_fold256_copy(uint32_t c, uint8_t *dst, const uint8_t *p,
                                        size_t len) {
        const __m256i *q = (const __m256i *)p;
        __m256i *o = (__m256i *)dst;
        __m256i d0 = _mm256_loadu_si256(q), d1 = _mm256_loadu_si256(q + 1);
        __m256i d2 = _mm256_loadu_si256(q + 2), d3 = _mm256_loadu_si256(q + 3);
        _mm256_storeu_si256(o, d0); _mm256_storeu_si256(o + 1, d1);
        _mm256_storeu_si256(o + 2, d2); _mm256_storeu_si256(o + 3, d3);
        __m256i y0 = _mm256_xor_si256(d0, _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)c)));
        __m256i y1 = d1, y2 = d2, y3 = d3;
        q += 4; o += 4; len -= 128;
        const __m256i k4 = _mm256_set_epi64x(0x000000014a7fe880LL, 0x00000001e88ef372LL,
                                             0x000000014a7fe880LL, 0x00000001e88ef372LL);
        while (len >= 128) {
            d0 = _mm256_loadu_si256(q); d1 = _mm256_loadu_si256(q + 1);
            d2 = _mm256_loadu_si256(q + 2); d3 = _mm256_loadu_si256(q + 3);
            _mm256_storeu_si256(o, d0); _mm256_storeu_si256(o + 1, d1);
            _mm256_storeu_si256(o + 2, d2); _mm256_storeu_si256(o + 3, d3);
            y0 = DM_FOLD256(y0, k4, d0);
            y1 = DM_FOLD256(y1, k4, d1);
            y2 = DM_FOLD256(y2, k4, d2);
            y3 = DM_FOLD256(y3, k4, d3);
            q += 4; o += 4; len -= 128;
        }
        return dm_crc_reduce(dm_fold_lanes(y0, y1, y2, y3));
    }
    #else
    #define DM_CLMUL_BUILT 0
    static int dm_have_vclmul(void) { return 0; }
    static uint32_t dm_crc_fold256_copy(uint32_t c, uint8_t *dst, const uint8_t *p,
                                        size_t len) {
        memcpy(dst, p, len);
        return dm_crc_bytes(c, dst, len);
    }
    static uint32_t dm_crc_fold256(uint32_t c, const uint8_t *p, size_t len) {
        return dm_crc_bytes(c, p, len);
    }
    static int dm_have_clmul(void) { return 0; }
    static uint32_t dm_crc_fold(uint32_t c, const uint8_t *p, size_t len) {
        return dm_crc_bytes(c, p, len);
    }
    #endif

    static int dm_clmul = 0;      /* 0: bytewise, 1: 128-bit folding, 2: 256-bit folding */

    static void dm_checksum_init(void) {
        dm_crc_init();
        dm_clmul = dm_have_vclmul() ? 2 : dm_have_clmul();
    }

    static uint32_t dm_crc32(uint32_t value, const uint8_t *p, size_t len);

    /* copy len bytes src -> dst and return zlib's crc32(value, src, len): in one pass
       with 256-bit folding, else the copy then the CRC of the copy (still cached) */
    static uint32_t dm_copy_crc32(uint32_t value, uint8_t *dst, const uint8_t *src,
                                  size_t len) {
        uint32_t c = ~value;
        if (dm_clmul == 2 && len >= 128) {
            size_t body = len & ~(size_t)127;
            c = dm_crc_fold256_copy(c, dst, src, body);
            dst += body; src += body; len -= body;
        }
        memcpy(dst, src, len);
        return dm_crc32(~c, dst, len);
    }

    /* zlib-compatible crc32(value, p, len) */
    static uint32_t dm_crc32(uint32_t value, const uint8_t *p, size_t len) {
        uint32_t c = ~value;
        if (dm_clmul && len >= 64) {
            size_t body = len & ~(size_t)15;
            c = dm_clmul == 2 && body >= 128 ? dm_crc_fold256(c, p, body)
                                             : dm_crc_fold(c, p, body);
            p += body; len -= body;
        }
        return ~dm_crc_bytes(c, p, len);
    }
    """
    void dm_checksum_init() nogil
    int dm_have_clmul() nogil
    int dm_have_vclmul() nogil
    int dm_clmul
    uint32_t dm_crc32(uint32_t value, const uint8_t *p, size_t length) noexcept nogil
    uint32_t dm_copy_crc32(uint32_t value, uint8_t *dst, const uint8_t *src,
                           size_t length) noexcept nogil

dm_checksum_init()

#: True when the kernel runs on PCLMULQDQ (else it is bytewise: use zlib.crc32)
HAVE_CLMUL = bool(dm_clmul)
#: The folding width in bits: 256 (VPCLMULQDQ + AVX2), 128 (PCLMULQDQ) or 0 (bytewise)
FOLD_BITS = (0, 128, 256)[dm_clmul]


def _set_fold_bits(int bits):
    """Use `bits`-wide folding (256, 128 or 0 = bytewise) when the CPU has it; returns
    the previous width (for the tests, which compare every path with zlib.crc32)."""
    global dm_clmul, HAVE_CLMUL, FOLD_BITS
    cdef int best = 2 if dm_have_vclmul() else dm_have_clmul()
    cdef int want = {0: 0, 128: 1, 256: 2}.get(bits, -1)
    if want < 0:
        raise ValueError(f"_set_fold_bits: bits must be 0, 128 or 256, got {bits}")
    if want > best:
        raise ValueError(f"_set_fold_bits: this CPU folds at most {FOLD_BITS} bits")
    prev = FOLD_BITS
    dm_clmul = want
    HAVE_CLMUL = bool(want)
    FOLD_BITS = bits
    return prev


def crc32(const uint8_t[::1] buf, uint32_t value=0):
    """zlib.crc32(buf, value) of a contiguous byte buffer (GIL released)."""
    cdef uint32_t out
    cdef size_t n = buf.shape[0]
    if n == 0:
        return value
    with nogil:
        out = dm_crc32(value, &buf[0], n)
    return out


def chunk_crcs(const uint8_t[::1] buf, Py_ssize_t chunk, uint32_t[::1] out):
    """out[k] = crc32(buf[k*chunk:(k+1)*chunk]) for every chunk (the last one may be
    shorter); `out` has ceil(len(buf) / chunk) entries (GIL released)."""
    cdef Py_ssize_t n = buf.shape[0], k, nchunks, lo, hi
    if chunk <= 0:
        raise ValueError(f"chunk_crcs: chunk must be positive, got {chunk}")
    nchunks = (n + chunk - 1) // chunk
    if out.shape[0] != nchunks:
        raise ValueError(f"chunk_crcs: out has {out.shape[0]} entries, {n} bytes in chunks "
                         f"of {chunk} need {nchunks}")
    with nogil:
        for k in range(nchunks):
            lo = k * chunk
            hi = lo + chunk if lo + chunk < n else n
            out[k] = dm_crc32(0, &buf[lo], <size_t>(hi - lo))


def copy_chunk_crcs(const uint8_t[::1] src, uint8_t[::1] dst, Py_ssize_t chunk,
                    uint32_t[::1] out):
    """dst[:] = src and out[k] = crc32 of chunk k of it (the last may be shorter), in one
    pass over memory (GIL released)."""
    cdef Py_ssize_t n = src.shape[0], k, nchunks, lo, hi
    if chunk <= 0:
        raise ValueError(f"copy_chunk_crcs: chunk must be positive, got {chunk}")
    if dst.shape[0] != n:
        raise ValueError(f"copy_chunk_crcs: dst has {dst.shape[0]} bytes but src has {n}")
    nchunks = (n + chunk - 1) // chunk
    if out.shape[0] != nchunks:
        raise ValueError(f"copy_chunk_crcs: out has {out.shape[0]} entries, {n} bytes in "
                         f"chunks of {chunk} need {nchunks}")
    with nogil:
        for k in range(nchunks):
            lo = k * chunk
            hi = lo + chunk if lo + chunk < n else n
            out[k] = dm_copy_crc32(0, &dst[lo], &src[lo], <size_t>(hi - lo))
