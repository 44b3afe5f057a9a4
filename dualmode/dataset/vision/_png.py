"""PNG encode/decode (8-bit grey, grey+alpha, RGB, RGBA; not interlaced) with zlib: the
image format ``vision.Decode`` reads without an imaging library."""
from __future__ import annotations

import struct
import zlib

import numpy as np

__all__ = ["encode_png", "decode_png", "PNG_SIGNATURE"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 4: 2, 2: 3, 6: 4}            # colour type -> channels


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(image: np.ndarray) -> bytes:
    """HW or HWC (C in 1..4) uint8 -> PNG bytes (filter 0 on every row)."""
    img = np.asarray(image, np.uint8)
    if img.ndim == 2:
        img = img[:, :, None]
    h, w, c = img.shape
    ctype = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * c)], axis=1)
    return (PNG_SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, ctype, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw.tobytes())) + _chunk(b"IEND", b""))


def _unfilter(data: np.ndarray, h: int, stride: int, bpp: int, owner: str) -> np.ndarray:
    rows = data.reshape(h, stride + 1)
    out = np.zeros((h, stride), np.uint8)
    prev = np.zeros(stride, np.int32)
    for y in range(h):                     # rows depend on the previous row: one pass each
        ftype, line = rows[y, 0], rows[y, 1:].astype(np.int32)
        if ftype == 0:
            cur = line
        elif ftype == 2:
            cur = (line + prev) & 0xFF
        elif ftype == 1:                   # Sub: a running sum per channel
            cur = (np.cumsum(line.reshape(-1, bpp), axis=0) & 0xFF).reshape(-1)
        elif ftype in (3, 4):
            cur = np.zeros(stride, np.int32)
            # Average/Paeth read the decoded pixel to the left: sequential (not a hot
            # path: the image readers take raw bytes, and encode_png writes filter 0)
            for x in range(stride):
                a = cur[x - bpp] if x >= bpp else 0
                b = prev[x]
                if ftype == 3:
                    p = (a + b) >> 1
                else:
                    c = prev[x - bpp] if x >= bpp else 0
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    p = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (line[x] + p) & 0xFF
        else:
            raise ValueError(f"{owner}: PNG row {y} has filter type {ftype}; valid: 0-4")
        out[y] = cur
        prev = cur
    return out


def decode_png(buf: bytes, owner: str = "Decode") -> np.ndarray:
    """PNG bytes -> HWC uint8."""
    if buf[:8] != PNG_SIGNATURE:
        raise ValueError(f"{owner}: the data is not a PNG image (first bytes "
                         f"{bytes(buf[:8])!r}); supported: 8-bit PNG")
    pos, idat, head = 8, [], None
    while pos + 8 <= len(buf):
        n, kind = struct.unpack(">I4s", buf[pos:pos + 8])
        data = buf[pos + 8:pos + 8 + n]
        if len(data) != n:
            raise ValueError(f"{owner}: PNG chunk {kind!r} is truncated")
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            idat.append(data)
        elif kind == b"IEND":
            break
        pos += 12 + n
    if head is None:
        raise ValueError(f"{owner}: PNG without an IHDR chunk")
    w, h, depth, ctype, _, _, interlace = head
    if depth != 8 or ctype not in _CHANNELS or interlace:
        raise ValueError(f"{owner}: PNG with bit depth {depth}, colour type {ctype}, "
                         f"interlace {interlace} is not supported; supported: 8-bit grey, "
                         f"grey+alpha, RGB, RGBA, not interlaced")
    c = _CHANNELS[ctype]
    try:
        raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8)
    except zlib.error as e:
        raise ValueError(f"{owner}: PNG image data is corrupt ({e})") from None
    if raw.size != h * (w * c + 1):
        raise ValueError(f"{owner}: PNG image data has {raw.size} bytes; expected "
                         f"{h * (w * c + 1)} for {w}x{h}x{c}")
    return _unfilter(raw, h, w * c, c, owner).reshape(h, w, c)
