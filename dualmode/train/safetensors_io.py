"""Checkpoint files in the safetensors format, written atomically and verified on read.

A file is ``u64 little-endian header length N`` + ``N`` bytes of JSON header + the raw
little-endian bytes of every tensor, back to back. The header maps each tensor name to
``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}`` (offsets relative to
the end of the header) and holds string metadata under ``"__metadata__"``; any
safetensors reader opens these files. dualmode keeps its own metadata there as one JSON
string (``"dualmode"``): step, layouts, optimizer state names, and a CRC-32 per 4 MiB
chunk of every tensor, plus a CRC-32 of the header itself (``"dualmode_header_crc"``).

Reading never loads more than asked: :meth:`CheckpointFile.read_region` reads the byte
range spanning a box of a tensor (rounded out to whole checksum chunks, which it
verifies), so a device that needs a quarter of a weight reads about a quarter of it.

Writing goes to a temporary file in the destination directory, is flushed and
``fsync``-ed, then renamed over the destination (and the directory synced): a process
killed in the middle of a save leaves the previous file untouched.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CHUNK", "CheckpointError", "CheckpointFile", "write_file", "atomic_write_bytes",
           "DTYPE_CODES"]

#: bytes covered by one CRC-32 of a tensor's data
CHUNK = 1 << 22

_MAX_HEADER = 1 << 28

#: numpy dtype -> safetensors dtype code (and back)
DTYPE_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32",
               np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
               np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
               np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16",
               np.dtype(np.uint32): "U32", np.dtype(np.uint64): "U64",
               np.dtype(np.bool_): "BOOL"}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupt or does not match."""


def _crcs(buf: memoryview) -> list:
    """CRC-32 of each CHUNK-byte piece of `buf` (zlib releases the GIL on large buffers)."""
    return [zlib.crc32(buf[i:i + CHUNK]) for i in range(0, len(buf), CHUNK)] or [0]


def _bytes_of(arr: np.ndarray) -> memoryview:
    """The little-endian bytes of `arr` in C order (no copy when it is already so)."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8))


def _header_crc(entries: dict, meta_str: str) -> int:
    return zlib.crc32(json.dumps(entries, sort_keys=True).encode() + meta_str.encode())


def _sync_dir(directory: str) -> None:
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _AtomicFile:
    """A temporary file beside `path`, renamed over it on success (removed on failure)."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint: directory {directory!r} of {self.path!r} "
                                    f"does not exist")
        self.directory = directory
        fd, self.tmp = tempfile.mkstemp(prefix="." + os.path.basename(self.path) + ".",
                                        suffix=".tmp", dir=directory)
        self.f = os.fdopen(fd, "wb", buffering=0)

    def commit(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        _sync_dir(self.directory)

    def abort(self):
        try:
            self.f.close()
        finally:
            try:
                os.remove(self.tmp)
            except OSError:
                pass


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file, fsync, rename)."""
    out = _AtomicFile(path)
    try:
        out.f.write(data)
        out.commit()
    except BaseException:
        out.abort()
        raise


def write_file(path: str, tensors: Sequence[Tuple[str, np.ndarray]],
               metadata: Optional[dict] = None) -> None:
    """Write `tensors` (name, array) to `path` as safetensors, atomically, with checksums.

    `metadata` (JSON-serialisable) is stored as dualmode's metadata; the per-chunk
    CRC-32 of every tensor is added to it under ``"crc"``.
    """
    entries, views, crcs, offset = {}, [], {}, 0
    for name, arr in tensors:
        arr = np.asarray(arr)
        code = DTYPE_CODES.get(arr.dtype.newbyteorder("=")) if arr.dtype.byteorder != "|" \
            else DTYPE_CODES.get(arr.dtype)
        if code is None:
            raise TypeError(f"save_checkpoint: parameter {name!r} has dtype {arr.dtype}, which "
                            f"a safetensors file cannot hold; valid dtypes: "
                            f"{', '.join(str(d) for d in DTYPE_CODES)}")
        view = _bytes_of(arr)
        entries[name] = {"dtype": code, "shape": [int(s) for s in arr.shape],
                         "data_offsets": [offset, offset + len(view)]}
        crcs[name] = _crcs(view)
        views.append(view)
        offset += len(view)
    meta = dict(metadata or {})
    meta["crc"] = crcs
    meta["chunk"] = CHUNK
    meta_str = json.dumps(meta, sort_keys=True)
    header = dict(entries)
    header["__metadata__"] = {"format": "dualmode", "dualmode": meta_str,
                              "dualmode_header_crc": str(_header_crc(entries, meta_str))}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)               # safetensors aligns the data to 8 bytes
    out = _AtomicFile(path)
    try:
        out.f.write(struct.pack("<Q", len(raw)))
        out.f.write(raw)
        for view in views:
            out.f.write(view)
        out.commit()
    except BaseException:
        out.abort()
        raise


class CheckpointFile:
    """An open checkpoint file: its header checked, tensors read on demand.

    ``names`` (in file order), ``shape(name)``, ``dtype(name)``, ``meta`` (dualmode's
    metadata, without the checksums); ``read(name)`` reads and verifies a whole tensor,
    ``read_region(name, box)`` only the bytes spanning a box of it. ``bytes_read``
    counts the tensor bytes read so far. Use as a context manager (or call close()).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.bytes_read = 0
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"checkpoint file {self.path!r} does not exist")
        if os.path.isdir(self.path):
            raise CheckpointError(f"checkpoint file {self.path!r} is a directory; give the "
                                  f"path of a .safetensors file")
        self._f = open(self.path, "rb", buffering=0)
        try:
            self._parse()
        except BaseException:
            self._f.close()
            raise

    # ---- header --------------------------------------------------------------------
    def _fail(self, what, name=None):
        where = f" (parameter {name!r})" if name is not None else ""
        raise CheckpointError(f"checkpoint file {self.path!r}{where}: {what}")

    def _parse(self):
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) < 8:
            self._fail(f"truncated: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            self._fail(f"truncated or not a safetensors file: header length {n} but the "
                       f"file has {size} bytes")
        raw = self._f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"corrupt header (not valid JSON: {e})")
        if not isinstance(header, dict):
            self._fail("corrupt header (not a JSON object)")
        md = header.pop("__metadata__", None) or {}
        if not isinstance(md, dict) or md.get("format") != "dualmode" or "dualmode" not in md:
            self._fail("has no dualmode metadata (not written by dualmode.save_checkpoint); "
                       "its checksums cannot be verified")
        meta_str = md["dualmode"]
        try:
            meta = json.loads(meta_str)
        except (TypeError, json.JSONDecodeError) as e:
            self._fail(f"corrupt dualmode metadata ({e})")
        if str(_header_crc(header, meta_str)) != md.get("dualmode_header_crc"):
            self._fail("header checksum mismatch: the header is corrupt")
        self._data_start = 8 + n
        self._entries = {}
        crcs = meta.pop("crc", {})
        self.chunk = int(meta.pop("chunk", CHUNK))
        end_max, expected = 0, 0
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = _CODE_DTYPES.get(e.get("dtype"))
            shape = tuple(e.get("shape", ()))
            b, end = e.get("data_offsets", (0, -1))
            if dtype is None:
                self._fail(f"dtype {e.get('dtype')!r} is not supported", name)
            if b != expected or end - b != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                self._fail(f"corrupt header: data_offsets {[b, end]} do not hold shape "
                           f"{list(shape)} of {dtype} after offset {expected}", name)
            if name not in crcs:
                self._fail("no checksum recorded", name)
            self._entries[name] = (dtype, shape, b, end, crcs[name])
            expected = end_max = end
        if self._data_start + end_max > size:
            missing = next(name for name, (_, _, _, end, _) in self._entries.items()
                           if self._data_start + end > size)
            self._fail(f"truncated: {size} bytes, but the data of the tensors needs "
                       f"{self._data_start + end_max}", missing)
        if self._data_start + end_max < size:
            self._fail(f"{size - self._data_start - end_max} unexpected trailing bytes "
                       f"after the tensor data (corrupt file)")
        self.meta = meta

    # ---- reading -------------------------------------------------------------------
    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def _entry(self, name):
        e = self._entries.get(name)
        if e is None:
            self._fail(f"no tensor named {name!r}; it holds {sorted(self._entries)}")
        return e

    def shape(self, name) -> Tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name) -> np.dtype:
        return self._entry(name)[0]

    def _read_chunks(self, name, lo, hi) -> np.ndarray:
        """Bytes [lo, hi) of tensor `name`, rounded out to whole checksum chunks and
        verified; returns (uint8 buffer, offset of `lo` in it)."""
        dtype, shape, b, end, crcs = self._entry(name)
        ch = self.chunk
        c0, c1 = lo // ch, -(-hi // ch) if hi > lo else lo // ch
        start, stop = c0 * ch, min(c1 * ch, end - b)
        buf = np.empty(max(stop - start, 0), np.uint8)
        self._f.seek(self._data_start + b + start)
        got = self._f.readinto(buf) if buf.size else 0
        if got != buf.size:
            self._fail(f"truncated while reading (got {got} of {buf.size} bytes)", name)
        self.bytes_read += buf.size
        view = memoryview(buf)
        for k, i in enumerate(range(0, buf.size, ch)):
            if zlib.crc32(view[i:i + ch]) != crcs[c0 + k]:
                self._fail(f"checksum mismatch in bytes {start + i}..{start + i + ch} of its "
                           f"data: the file is corrupt", name)
        return buf, lo - start

    def read(self, name) -> np.ndarray:
        """The whole tensor `name` (a new array), verified against its checksums."""
        dtype, shape, b, end, _ = self._entry(name)
        if end == b:
            return np.zeros(shape, dtype)
        buf, off = self._read_chunks(name, 0, end - b)
        return buf.view(dtype).reshape(shape)

    def read_region(self, name, box: Sequence[slice]) -> np.ndarray:
        """``tensor[box]`` (one slice with step 1 per dim) as a new array, reading only the
        byte range from the box's first to its last element (rounded out to checksum
        chunks): a block of rows reads just those rows."""
        dtype, shape, b, end, _ = self._entry(name)
        box = tuple(box)
        if len(box) != len(shape):
            raise ValueError(f"read_region: box has {len(box)} dims, tensor {name!r} in "
                             f"{self.path!r} has shape {shape}")
        starts = [s.start or 0 for s in box]
        stops = [shape[d] if s.stop is None else s.stop for d, s in enumerate(box)]
        if any(not 0 <= a <= z <= n for a, z, n in zip(starts, stops, shape)):
            raise ValueError(f"read_region: box {box} lies outside tensor {name!r} of shape "
                             f"{shape} in {self.path!r}")
        if any(a == z for a, z in zip(starts, stops)):
            return np.zeros(tuple(z - a for a, z in zip(starts, stops)), dtype)
        if not shape or all(a == 0 and z == n for a, z, n in zip(starts, stops, shape)):
            return self.read(name)                    # the whole tensor: no strided copy
        strides = np.cumprod((1,) + shape[:0:-1])[::-1].astype(np.int64) * dtype.itemsize
        first = int(np.dot(starts, strides))
        last = int(np.dot(np.subtract(stops, 1), strides)) + dtype.itemsize
        buf, off = self._read_chunks(name, first, last)
        base = buf[off:off + last - first].view(dtype)
        out_shape = tuple(z - a for a, z in zip(starts, stops))
        return np.lib.stride_tricks.as_strided(base, out_shape, tuple(int(s) for s in strides),
                                               writeable=False).copy()

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_all(paths: Iterable[str]) -> Dict[str, CheckpointFile]:
    """Open every file (all checked before any is used); closes them on failure."""
    out = {}
    try:
        for p in paths:
            out[os.fspath(p)] = CheckpointFile(p)
    except BaseException:
        for f in out.values():
            f.close()
        raise
    return out
