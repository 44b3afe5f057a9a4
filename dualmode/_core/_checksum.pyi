"""Type stub for the CRC-32 kernel (`_checksum.pyx`): zlib's CRC-32 by carry-less
multiplication (PCLMULQDQ), GIL released. Its reference is ``zlib.crc32``; the tests
compare the two (and ``chunk_crcs`` with
``dualmode.train.safetensors_io.chunk_crcs_reference``)."""
import numpy as np

#: True when the kernel runs on PCLMULQDQ; otherwise it is bytewise and callers use
#: ``zlib.crc32``.
HAVE_CLMUL: bool

def crc32(buf: "np.ndarray | bytes | memoryview", value: int = 0) -> int:
    """``zlib.crc32(buf, value)`` of a C-contiguous byte buffer."""
    ...

def chunk_crcs(buf: "np.ndarray | bytes | memoryview", chunk: int, out: np.ndarray) -> None:
    """``out[k] = crc32(buf[k*chunk:(k+1)*chunk])`` (the last chunk may be shorter);
    `out` is a uint32 array of ``ceil(len(buf) / chunk)`` entries."""
    ...

def copy_chunk_crcs(src: "np.ndarray | bytes | memoryview", dst: np.ndarray, chunk: int,
                    out: np.ndarray) -> None:
    """``dst[:] = src`` and ``out[k] = crc32(src[k*chunk:(k+1)*chunk])``, in one pass over
    memory; `dst` a writable uint8 buffer of the same length."""
    ...

#: The folding width in bits: 256 (VPCLMULQDQ + AVX2), 128 (PCLMULQDQ) or 0 (bytewise).
FOLD_BITS: int

def _set_fold_bits(bits: int) -> int:
    """Fold `bits` wide (256, 128 or 0) if the CPU can; returns the previous width."""
    ...
