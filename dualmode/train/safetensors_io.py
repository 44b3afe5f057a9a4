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
Whole tensors are read straight into their final array (:meth:`CheckpointFile.read_into`
fills a caller's array, e.g. one device's slot of a stack): a large range is mapped and
copied by a kernel that checksums the bytes as it copies them (one pass over memory,
like a plain read's copy out of the page cache), a small one read and then checked. The
CRC-32 is the PCLMULQDQ kernel of :mod:`dualmode._core._checksum` (``zlib.crc32``,
its reference, where the CPU lacks the instruction).

Writing goes to a temporary file in the destination directory, is flushed and
``fsync``-ed, then renamed over the destination (and the directory synced): a process
killed in the middle of a save leaves the previous file untouched. The tensors are
written from the arrays' own memory (no intermediate bytes), each chunk checksummed
just before it is written, and the header last, into room reserved for it (its length
bounded by the widest CRC-32s, padded with spaces); :func:`write_files` writes several
files (one per rank) before syncing any, then fsyncs them all at once (on threads: the
filesystem commits them together rather than one journal commit per file).
"""
from __future__ import annotations

import functools
import json
import mmap
import os
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from .._core import _checksum

__all__ = ["CHUNK", "CheckpointError", "CheckpointFile", "write_file", "write_files",
           "atomic_write_bytes", "chunk_crcs", "chunk_crcs_reference", "DTYPE_CODES"]

#: bytes covered by one CRC-32 of a tensor's data
CHUNK = 1 << 22

#: reads at least this long go through a mapping and the copy-and-checksum kernel
_MAP_MIN = 1 << 20

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


def chunk_crcs_reference(buf, chunk: int) -> np.ndarray:
    """CRC-32 (zlib's) of each `chunk`-byte piece of `buf`, one ``zlib.crc32`` per piece."""
    view = memoryview(buf).cast("B")
    return np.array([zlib.crc32(view[i:i + chunk]) for i in range(0, len(view), chunk)],
                    np.uint32)


def chunk_crcs(buf: np.ndarray, chunk: int) -> np.ndarray:
    """CRC-32 of each `chunk`-byte piece of the contiguous uint8 array `buf`, in one
    kernel call (GIL released); ``chunk_crcs_reference`` where the CPU lacks PCLMULQDQ."""
    if not _checksum.HAVE_CLMUL:
        return chunk_crcs_reference(buf, chunk)
    out = np.empty(-(-buf.size // chunk), np.uint32)
    _checksum.chunk_crcs(buf, chunk, out)
    return out


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """The little-endian bytes of `arr` in C order, as a 1-D uint8 array (a view of
    `arr` when it is already contiguous and little-endian: no copy)."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.reshape(-1).view(np.uint8)


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
        self.synced = False

    def write(self, data) -> None:
        """Write all of `data` (bytes or a 1-D uint8 array), from its own memory."""
        view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else \
            memoryview(data)
        step = CHUNK * 16                      # FileIO.write may write less than asked
        pos, n = 0, len(view)
        while pos < n:
            done = self.f.write(view[pos:pos + step])
            if not done:
                raise OSError(f"checkpoint: writing {self.tmp!r} (for {self.path!r}) "
                              f"made no progress at byte {pos} of {n}")
            pos += done

    def write_checksummed(self, piece: np.ndarray) -> int:
        """Write the uint8 array `piece` (one checksum chunk) and return its CRC-32,
        computed first: the write then copies it from the CPU cache."""
        crc = _checksum.crc32(piece) if _checksum.HAVE_CLMUL else zlib.crc32(piece)
        self.write(piece)
        return crc

    def sync(self):
        """Flush and fsync the temporary file (commit then skips it)."""
        self.f.flush()
        os.fsync(self.f.fileno())
        self.synced = True

    def commit(self, sync_dir: bool = True):
        """fsync (unless done), rename over the destination, and sync its directory
        (unless `sync_dir` is False: the caller syncs it)."""
        if not self.synced:
            self.sync()
        self.f.close()
        os.replace(self.tmp, self.path)
        if sync_dir:
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
        out.write(data)
        out.commit()
    except BaseException:
        out.abort()
        raise


_CRC_MAX = 0xFFFFFFFF          # the widest CRC-32 in decimal: a header's length bound


class _Encoded:
    """One file to write: its tensors' bytes and header fields, checked, before any
    checksum. The header is written last, into room reserved before the data: its
    length is bounded by that of the header with every CRC-32 at its widest, and the
    real one is padded with spaces to it (JSON allows trailing whitespace)."""

    def __init__(self, path, tensors: Sequence[Tuple[str, np.ndarray]],
                 metadata: Optional[dict]):
        self.path = os.fspath(path)
        self.chunk = CHUNK
        self.entries, self.views, offset = {}, [], 0
        for name, arr in tensors:
            arr = np.asarray(arr)
            code = DTYPE_CODES.get(arr.dtype.newbyteorder("=")) \
                if arr.dtype.byteorder != "|" else DTYPE_CODES.get(arr.dtype)
            if code is None:
                raise TypeError(f"save_checkpoint: parameter {name!r} has dtype {arr.dtype}, "
                                f"which a safetensors file cannot hold; valid dtypes: "
                                f"{', '.join(str(d) for d in DTYPE_CODES)}")
            view = _bytes_of(arr)
            self.entries[name] = {"dtype": code, "shape": [int(s) for s in arr.shape],
                                  "data_offsets": [offset, offset + view.size]}
            self.views.append(view)
            offset += view.size
        self.metadata = dict(metadata or {})
        widest = {name: [_CRC_MAX] * max(1, -(-v.size // self.chunk))
                  for name, v in zip(self.entries, self.views)}
        self.header_len = len(self.header(widest, _CRC_MAX))

    def header(self, crcs: dict, header_crc: Optional[int] = None,
               size: Optional[int] = None) -> bytes:
        """The JSON header with these per-chunk CRC-32s, padded with spaces to `size`
        bytes (default: a multiple of 8, where safetensors aligns the data)."""
        meta = dict(self.metadata, crc=crcs, chunk=self.chunk)
        meta_str = json.dumps(meta, sort_keys=True)
        if header_crc is None:
            header_crc = _header_crc(self.entries, meta_str)
        header = dict(self.entries)
        header["__metadata__"] = {"format": "dualmode", "dualmode": meta_str,
                                  "dualmode_header_crc": str(header_crc)}
        raw = json.dumps(header).encode()
        size = len(raw) + (-len(raw) % 8) if size is None else size
        if len(raw) > size:
            raise RuntimeError(f"checkpoint {self.path!r}: the header needs {len(raw)} bytes "
                               f"but {size} were reserved for it")
        return raw + b" " * (size - len(raw))

    def write(self, out: "_AtomicFile") -> None:
        """The data, each chunk checksummed just before it is written (one pass over the
        arrays' memory), then the header into the room left before it."""
        out.f.seek(8 + self.header_len)
        crcs = {}
        for name, view in zip(self.entries, self.views):
            crcs[name] = [out.write_checksummed(view[i:i + self.chunk])
                          for i in range(0, view.size, self.chunk)] or [0]
        out.f.seek(0)
        out.write(struct.pack("<Q", self.header_len) +
                  self.header(crcs, size=self.header_len))


def write_files(files: Sequence[Tuple[str, Sequence[Tuple[str, np.ndarray]], Optional[dict]]]
                ) -> None:
    """Write several checkpoint files ``(path, tensors, metadata)``, each atomically and
    with checksums (see :func:`write_file`).

    Every file is checked before any is created, and every one is written to its
    temporary file before any is synced; then all are fsynced at once, renamed, and
    their directories synced. A failure removes the temporary files not renamed yet (a
    failed fsync: all of them, so no file of the set is replaced).
    """
    encoded = [_Encoded(path, tensors, metadata) for path, tensors, metadata in files]
    pending = []
    try:
        for enc in encoded:
            out = _AtomicFile(enc.path)
            pending.append(out)
            enc.write(out)
        if len(pending) == 1:
            pending[0].commit()
            pending.pop()
            return
        # several files: fsync them all at once (the filesystem commits them together
        # instead of one journal commit each), rename each, then sync each directory
        _in_parallel([out.sync for out in pending])
        directories = sorted({out.directory for out in pending})
        while pending:
            pending[0].commit(sync_dir=False)
            pending.pop(0)
        _in_parallel([functools.partial(_sync_dir, d) for d in directories])
    except BaseException:
        for out in pending:
            out.abort()
        raise


def _in_parallel(calls) -> None:
    """Run the I/O calls `calls` (which release the GIL) on threads, wait for all, and
    raise the first error."""
    with ThreadPoolExecutor(min(len(calls), 8), thread_name_prefix="dualmode-ckpt") as pool:
        futures = [pool.submit(call) for call in calls]
    for fut in futures:
        fut.result()


def write_file(path: str, tensors: Sequence[Tuple[str, np.ndarray]],
               metadata: Optional[dict] = None) -> None:
    """Write `tensors` (name, array) to `path` as safetensors, atomically, with checksums.

    `metadata` (JSON-serialisable) is stored as dualmode's metadata; the per-chunk
    CRC-32 of every tensor is added to it under ``"crc"``. The data is written from the
    arrays' memory (a view when they are C-contiguous and little-endian).
    """
    write_files([(path, tensors, metadata)])


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
        self.chunk = meta.pop("chunk", CHUNK)
        if not isinstance(self.chunk, int) or self.chunk <= 0:
            self._fail(f"corrupt dualmode metadata: checksum chunk {self.chunk!r}")
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
            want = max(1, -(-(end - b) // self.chunk))
            if not isinstance(crcs[name], list) or len(crcs[name]) != want:
                self._fail(f"corrupt header: {want} checksums expected for its "
                           f"{end - b} bytes", name)
            self._entries[name] = (dtype, shape, b, end, np.asarray(crcs[name], np.int64))
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

    def _check(self, name, got: np.ndarray, first: int, start: int) -> None:
        """Compare the CRC-32s `got` of chunks `first`.. with the recorded ones."""
        crcs = self._entry(name)[4]
        bad = np.flatnonzero(got != crcs[first:first + got.size])
        if bad.size:
            i = start + int(bad[0]) * self.chunk
            self._fail(f"checksum mismatch in bytes {i}..{i + self.chunk} of its data: the "
                       f"file is corrupt", name)

    def _read_piece(self, name, view: memoryview, lo: int, total: int) -> None:
        """Fill `view` from the file's current position (bytes `lo`.. of a `total`-byte
        read of tensor `name`), or fail naming the truncation."""
        want, got = len(view), 0
        while got < want:                # one call, unless the kernel returns a short read
            more = self._f.readinto(view[got:]) or 0
            if not more:
                self._fail(f"truncated while reading (got {lo + got} of {total} bytes)", name)
            got += more

    def _read_verified(self, name, buf: np.ndarray, start: int) -> None:
        """Read bytes ``[start, start + buf.size)`` of tensor `name`'s data (`start` on a
        chunk boundary, the end on one or at the tensor's end) into the uint8 array `buf`
        and verify them.

        A large range is mapped and copied into `buf` by the kernel that checksums what
        it copies (one pass over memory, as a plain read's copy); a small one is read,
        then checksummed."""
        ch = self.chunk
        pos = self._data_start + self._entry(name)[2] + start
        n = buf.size
        if n >= _MAP_MIN and _checksum.FOLD_BITS == 256:
            crcs = self._map_copy(name, buf, pos)
        else:
            self._f.seek(pos)
            self._read_piece(name, memoryview(buf), 0, n)
            crcs = chunk_crcs(buf, ch)
        self._check(name, crcs, start // ch, start)
        self.bytes_read += n

    def _map_copy(self, name, buf: np.ndarray, pos: int) -> np.ndarray:
        """Copy file bytes ``[pos, pos + buf.size)`` into `buf` through a read-only
        mapping, returning the CRC-32 of each chunk copied. The file's size is checked
        first (a file that shrank is named); dualmode never truncates a checkpoint in
        place (a save renames a new file over it, and the mapping keeps the old one)."""
        n = buf.size
        size = os.fstat(self._f.fileno()).st_size       # the file may have shrunk since
        if size < pos + n:                               # it was opened
            self._fail(f"truncated while reading (the file now has {size} bytes, the data "
                       f"needs {pos + n})", name)
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        crcs = np.empty(-(-n // self.chunk), np.uint32)
        with mmap.mmap(self._f.fileno(), pos + n - base, access=mmap.ACCESS_READ,
                       offset=base) as mapped:
            src = np.frombuffer(mapped, np.uint8, count=n, offset=pos - base)
            try:
                _checksum.copy_chunk_crcs(src, buf, self.chunk, crcs)
            finally:
                del src                                  # no view may outlive the map
        return crcs

    def _read_chunks(self, name, lo, hi):
        """Bytes [lo, hi) of tensor `name`, rounded out to whole checksum chunks and
        verified; returns (uint8 buffer, offset of `lo` in it)."""
        dtype, shape, b, end, crcs = self._entry(name)
        ch = self.chunk
        c0, c1 = lo // ch, -(-hi // ch) if hi > lo else lo // ch
        start, stop = c0 * ch, min(c1 * ch, end - b)
        buf = np.empty(max(stop - start, 0), np.uint8)
        if buf.size:
            self._read_verified(name, buf, start)
        return buf, lo - start

    def read_into(self, name, out: np.ndarray) -> np.ndarray:
        """Read the whole tensor `name`, verified, straight into `out` (a C-contiguous,
        writable array of its shape and dtype, e.g. one device's slot of a stack);
        returns `out`. On a checksum or truncation error `out` holds partial data."""
        dtype, shape, b, end, _ = self._entry(name)
        if not isinstance(out, np.ndarray) or tuple(out.shape) != shape or \
                out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"read_into: out must be a writable C-contiguous array of shape "
                             f"{shape} and dtype {dtype} (tensor {name!r} in {self.path!r}), "
                             f"got {type(out).__name__} "
                             f"{getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}")
        if end > b:
            self._read_verified(name, out.reshape(-1).view(np.uint8), 0)
        return out

    def read(self, name) -> np.ndarray:
        """The whole tensor `name` (a new array), verified against its checksums."""
        dtype, shape, b, end, _ = self._entry(name)
        if end == b:
            return np.zeros(shape, dtype)
        return self.read_into(name, np.empty(shape, dtype))

    def read_region(self, name, box: Sequence[slice], out: Optional[np.ndarray] = None
                    ) -> np.ndarray:
        """``tensor[box]`` (one slice with step 1 per dim) as a new array (or copied into
        `out`, an array of the box's shape), reading only the byte range from the box's
        first to its last element (rounded out to checksum chunks): a block of rows reads
        just those rows."""
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
        out_shape = tuple(z - a for a, z in zip(starts, stops))
        if out is not None and (tuple(out.shape) != out_shape or out.dtype != dtype):
            raise ValueError(f"read_region: out has shape {out.shape} dtype {out.dtype}, the "
                             f"box {box} of {name!r} in {self.path!r} is {out_shape} {dtype}")
        whole = not shape or all(a == 0 and z == n for a, z, n in zip(starts, stops, shape))
        if any(a == z for a, z in zip(starts, stops)):
            block = np.zeros(out_shape, dtype)
        elif whole and out is not None and out.flags.c_contiguous and out.flags.writeable:
            return self.read_into(name, out)          # straight into place: no copy
        elif whole:
            block = self.read(name)                   # the whole tensor: no strided copy
        else:
            strides = np.cumprod((1,) + shape[:0:-1])[::-1].astype(np.int64) * dtype.itemsize
            first = int(np.dot(starts, strides))
            last = int(np.dot(np.subtract(stops, 1), strides)) + dtype.itemsize
            buf, off = self._read_chunks(name, first, last)
            base = buf[off:off + last - first].view(dtype)
            block = np.lib.stride_tricks.as_strided(base, out_shape,
                                                    tuple(int(s) for s in strides),
                                                    writeable=False)
            if out is None:
                return block.copy()
        if out is None:
            return block
        out[...] = block
        return out

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
