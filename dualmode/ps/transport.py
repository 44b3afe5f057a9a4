"""Messages over ZeroMQ: a JSON header frame, then one raw frame per numpy array.

A message is ``[header, buf_0, buf_1, ...]``: the header is a JSON object whose
``"arrays"`` entry lists ``[dtype, shape]`` of each following frame; the arrays travel as
their own buffers (``send_multipart(..., copy=False)``: no copy on send, and the
received frames are wrapped with ``np.frombuffer``, no copy on receive). Nothing is
pickled. A received array is a view of its frame, which belongs to the receiver (it
may be written, or kept as a parameter's storage); sent on, the whole of a received
frame goes as the frame itself (ZeroMQ shares the message). The header is small: the
request's fields and the arrays' specs.

A message sent every step with the same fields and array specs (a push of dense
gradients, its answer) has its header encoded once (:class:`Template`): per message only
its integer fields (step, version, request id) are formatted in, and
:func:`send_encoded` sends the arrays as they are.
"""
from __future__ import annotations

import json
import math
import socket
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import zmq

__all__ = ["encode", "decode", "send", "send_tracked", "recv", "recv_frames", "poll_recv",
           "local_host", "tcp_address", "check_host", "check_port", "PSError", "Template",
           "push_template", "answer_template", "send_encoded"]

#: below this many bytes a frame is copied into the message (ZeroMQ's own threshold)
_COPY_THRESHOLD = zmq.COPY_THRESHOLD
_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
           "bool")


class PSError(RuntimeError):
    """A failure of the parameter server cluster (lost peer, timeout, refused request)."""


_DTYPE_OF = {name: np.dtype(name) for name in _DTYPES}
_NAME_OF = {dt: name for name, dt in _DTYPE_OF.items()}


def _frames(header: Dict[str, Any], arrays: Sequence[np.ndarray],
            track: Union[bool, Sequence[bool]]):
    """(frames, array bytes, trackers): the JSON header listing ``[dtype, shape]`` per
    array, then each array as its own frame. The arrays go as they are (their buffers,
    no copy; a non-contiguous one is made contiguous first); `track` (for all arrays,
    or one flag per array): the trackers (one per array) report when ZeroMQ no longer
    reads an array (None: not tracked, or it was copied, being small or not
    contiguous)."""
    bufs, specs, trackers, nbytes = [], [], [], 0
    flags = [track] * len(arrays) if isinstance(track, bool) else track
    for a, track in zip(arrays, flags):
        a = np.asarray(a)
        copied = not a.flags.c_contiguous
        if copied:
            a = np.ascontiguousarray(a)
        specs.append((_NAME_OF.get(a.dtype) or a.dtype.name, a.shape))
        nbytes += a.nbytes
        frame = _received_frame(a)
        if frame is not None:
            # goes out as a reference to the received message: no copy, and nothing
            # for pyzmq's garbage-collector thread to do when ZeroMQ is done with it
            trackers.append(None)
            bufs.append(frame)
        elif track and not copied and a.nbytes >= _COPY_THRESHOLD:  # smaller: copied
            frame = zmq.Frame(a, track=True, copy=False)
            trackers.append(frame.tracker)
            bufs.append(frame)
        else:
            trackers.append(None)
            bufs.append(a)
    head = dict(header, arrays=specs)
    return [json.dumps(head, separators=(",", ":")).encode("utf-8")] + bufs, nbytes, trackers


def _received_frame(a: np.ndarray) -> Optional[zmq.Frame]:
    """The received frame whose whole buffer `a` (C-contiguous) is, or None. Sending
    the frame itself shares ZeroMQ's message; sending `a` without a copy would hand
    ZeroMQ a Python buffer, released later through pyzmq's garbage-collector thread
    (which takes the GIL: a wait for the sender's next Python step on a busy machine)."""
    base = a.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, zmq.Frame) and a.nbytes == len(base) and a.nbytes:
        return base
    return None


class Template:
    """The header of a message sent again and again with the same fields and array
    specs (`specs`: ``(dtype name, shape)`` per array) but for the integer fields
    `varying`, encoded once: ``template(*values)`` is the header with those fields (in
    that order; the JSON that :func:`decode` reads as that header and those arrays);
    ``nbytes`` the bytes of the arrays.

    A receiver that expects such messages reads them with :meth:`match` (no JSON
    parsing: after a large message has gone through the caches, parsing is the
    costliest part of a receive), and :func:`decode` the others."""

    __slots__ = ("_fmt", "_prefix", "_arrays", "nbytes")

    def __init__(self, header: Dict[str, Any], specs: Sequence[Tuple[str, Sequence[int]]],
                 varying: Sequence[str]):
        if not varying:
            raise ValueError("Template: varying must name at least one integer field")
        fixed = json.dumps(dict(header, arrays=[[d, list(shape)] for d, shape in specs]),
                           separators=(",", ":"))
        head = fixed[:-1] + f',"{varying[0]}":'
        tail = "".join(f',"{name}":%d' for name in varying[1:])
        self._fmt = (head.replace("%", "%%") + "%d" + tail + "}").encode("utf-8")
        self._prefix = head.encode("utf-8")
        self._arrays = [(_DTYPE_OF[d], tuple(shape), _DTYPE_OF[d].itemsize * math.prod(shape))
                        for d, shape in specs]
        self.nbytes = sum(n for _, _, n in self._arrays)

    def __call__(self, *values: int) -> bytes:
        return self._fmt % values

    def match(self, frames: Sequence[Any]) -> Optional[Tuple[Tuple[int, ...], List[np.ndarray]]]:
        """``(values, arrays)`` of a received message (`frames`: its header, then its
        arrays' frames) whose header is this one with integer `values`, its arrays views
        of the frames as :func:`decode` gives them; None for any other message."""
        raw = frames[0].bytes if isinstance(frames[0], zmq.Frame) else bytes(frames[0])
        if len(frames) != len(self._arrays) + 1 or not raw.startswith(self._prefix):
            return None
        try:
            values = tuple(int(part.rpartition(b":")[2])
                           for part in raw[len(self._prefix):-1].split(b","))
            if self._fmt % values != raw:          # exactly this header, nothing else
                return None
        except (TypeError, ValueError):
            return None
        arrays = []
        for (dt, shape, nbytes), fr in zip(self._arrays, frames[1:]):
            if len(fr) != nbytes:
                return None
            arrays.append(np.frombuffer(fr, dt).reshape(shape) if nbytes else np.zeros(shape, dt))
        return values, arrays


def push_template(group: str, worker: int,
                  specs: Sequence[Tuple[str, Sequence[int]]]) -> Template:
    """The header of worker `worker`'s pushes of the dense shards `specs` (dtype name,
    shape) of optimizer group `group` to one server: per push its step, the version its
    gradients were computed on and the request id."""
    return Template({"op": "push", "group": group, "worker": worker}, specs,
                    ("step", "base", "req"))


def answer_template(specs: Sequence[Tuple[str, Sequence[int]]]) -> Template:
    """The header of a server's answer to such a push: the new values of the dense
    shards `specs`, with the group's version and the request id."""
    return Template({"op": "pulled"}, specs, ("version", "req"))


def send_encoded(sock: zmq.Socket, head: bytes, arrays: Sequence[np.ndarray],
                 ident: Optional[bytes] = None) -> None:
    """Send a message whose header is already encoded (a :class:`Template`'s) with
    `arrays`, C-contiguous with the dtypes and shapes that header lists: no copy,
    nothing tracked (do not write them before the peer has answered); a whole
    received frame goes as the frame itself."""
    frames = [head] if ident is None else [ident, head]
    for a in arrays:
        frame = _received_frame(a)
        frames.append(a if frame is None else frame)
    sock.send_multipart(frames, copy=False)


def encode(header: Dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> List[Any]:
    """The frames of a message: the JSON header (with the arrays' dtypes and shapes)
    followed by the arrays' buffers (C-contiguous; copied only when they are not, or
    when they are smaller than ZeroMQ's copy threshold)."""
    return _frames(header, arrays, False)[0]


def decode(frames: Sequence[Any], where: str) -> Tuple[Dict[str, Any], List[np.ndarray]]:
    """(header, arrays) of a received message; a malformed one raises PSError naming
    `where` (the peer or socket it came from). The arrays are views of the received
    frames (writable: a received frame belongs to its receiver)."""
    if not frames:
        raise PSError(f"{where}: received an empty message")
    first = frames[0]
    raw = first.bytes if isinstance(first, zmq.Frame) else bytes(first)
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PSError(f"{where}: the message header is not JSON ({exc})") from None
    if not isinstance(head, dict):
        raise PSError(f"{where}: the message header is a {type(head).__name__}; expected "
                      "a JSON object")
    specs = head.pop("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise PSError(f"{where}: the header lists {len(specs)} arrays but "
                      f"{len(frames) - 1} buffers followed")
    arrays = []
    for spec, fr in zip(specs, frames[1:]):
        try:
            dtype, shape = spec
            dt = _DTYPE_OF[dtype]
            count = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise PSError(f"{where}: array spec {spec!r} is not [dtype, shape] with a dtype "
                          "among " + ", ".join(_DTYPES)) from None
        arr = np.frombuffer(fr, dtype=dt) if len(fr) else np.zeros(0, dt)
        if arr.size != count:
            raise PSError(f"{where}: an array of shape {tuple(shape)} ({dtype}) arrived with "
                          f"{arr.size} elements")
        arrays.append(arr.reshape(shape))
    return head, arrays


def send(sock: zmq.Socket, header: Dict[str, Any], arrays: Sequence[np.ndarray] = (),
         ident: Optional[bytes] = None) -> int:
    """Send one message (prefixed by the peer identity on a ROUTER); the bytes of its
    arrays (what a push or pull moves). The arrays are sent without a copy: do not
    write them before the peer has answered."""
    return send_tracked(sock, header, arrays, ident, False)[0]


def send_tracked(sock: zmq.Socket, header: Dict[str, Any], arrays: Sequence[np.ndarray],
                 ident: Optional[bytes] = None,
                 track: Union[bool, Sequence[bool]] = True) -> Tuple[int, list]:
    """:func:`send`, also returning a tracker per array (``tracker.done``: ZeroMQ has
    finished reading that array, it may be written again; None: it was copied, or not
    tracked: `track` may name the arrays to track, one flag each)."""
    frames, nbytes, trackers = _frames(header, arrays, track)
    if ident is not None:
        frames.insert(0, ident)
    sock.send_multipart(frames, copy=False)
    return nbytes, trackers


def recv_frames(sock: zmq.Socket, flags: int = 0) -> List[zmq.Frame]:
    """The frames of one message, received without copies (what
    ``recv_multipart(flags, copy=False)`` returns, asking each frame whether more
    follow instead of the socket); zmq.Again when none came (``flags=zmq.NOBLOCK``, or
    the socket's receive timeout ran out)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def recv(sock: zmq.Socket, where: str, router: bool = False, flags: int = 0):
    """Receive one message: ``(header, arrays)``, or ``(ident, header, arrays)`` on a
    ROUTER (``flags=zmq.NOBLOCK``: raises zmq.Again when none is waiting)."""
    frames = recv_frames(sock, flags)
    if router:
        ident = frames[0].bytes
        head, arrays = decode(frames[1:], where)
        return ident, head, arrays
    return decode(frames, where)


def poll_recv(sock: zmq.Socket, timeout_s: float, where: str):
    """:func:`recv` within `timeout_s` seconds, else None."""
    if sock.poll(max(0, int(timeout_s * 1000))):
        return recv(sock, where)
    return None


def local_host(peer_host: str) -> str:
    """The address of this machine that `peer_host` can reach (the interface a UDP
    socket towards it would use; 127.0.0.1 for a local peer)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def check_host(var: str, host: str) -> str:
    """`host` resolved to an IPv4 address (ValueError naming `var` when it cannot be)."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        raise ValueError(f"{var}={host!r} is not a host name or IPv4 address that resolves "
                         "here; expected e.g. 127.0.0.1 or the scheduler's host name") from None


def check_port(var: str, value: str) -> int:
    """`value` as a TCP port (ValueError naming `var`)."""
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(f"{var}={value!r} is not a valid port; expected an int in "
                         "[1, 65535]")
    return port


def deadline(seconds: float) -> float:
    """The monotonic time `seconds` from now."""
    return time.monotonic() + seconds
