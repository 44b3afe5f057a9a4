"""Rank tables: the JSON file that lists the machines and devices of a job.

The format is MindSpore's (``RANK_TABLE_FILE``)::

    {"version": "1.0", "server_count": "2",
     "server_list": [
        {"server_id": "10.0.0.1",
         "device": [{"device_id": "0", "device_ip": "192.1.27.6", "rank_id": "0"},
                    {"device_id": "1", "device_ip": "192.2.27.6", "rank_id": "1"}],
         "host_nic_ip": "reserve"},
        {"server_id": "10.0.0.2", "device": [...ranks 2, 3...]}],
     "status": "completed"}

Numbers may be JSON ints or strings of digits. The rank ids must be ``0 .. N - 1``, each
once, handed out server by server in list order (as ``mpiexec`` places consecutive ranks
on each host of a hostfile); device ids are distinct within a server. ``server_id`` is
the host name or address that ``mpiexec`` reaches the machine by.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Tuple

__all__ = ["RankTable", "load_rank_table"]


@dataclass(frozen=True)
class RankTable:
    """A validated rank table.

    Attributes
    ----------
    path : str
    hosts : tuple of str
        ``server_id`` of each server, in list order.
    device_ids : tuple of tuple of int
        The device ids of each server, in rank order.
    """

    path: str
    hosts: Tuple[str, ...]
    device_ids: Tuple[Tuple[int, ...], ...]

    @property
    def server_count(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        """Devices (ranks) in the job."""
        return sum(len(d) for d in self.device_ids)

    @property
    def slots(self) -> Tuple[int, ...]:
        """Ranks per server, in list order."""
        return tuple(len(d) for d in self.device_ids)


def _int(where: str, value: Any, problem) -> int:
    if isinstance(value, bool):
        raise problem(f"{where}={value!r} is not an int")
    if isinstance(value, int):
        out = value
    elif isinstance(value, str) and value.strip().isdigit():
        out = int(value)
    else:
        raise problem(f"{where}={value!r} is not an int (or a string of digits)")
    if out < 0:
        raise problem(f"{where}={value!r} is negative")
    return out


def load_rank_table(path: str, source: str = "rank_table") -> RankTable:
    """Read and validate the rank table at ``path``.

    Parameters
    ----------
    path : str
        The JSON file.
    source : str
        Where the path came from (e.g. ``"RANK_TABLE_FILE"``), for the messages.

    Raises
    ------
    ValueError
        The file is missing, unreadable or not JSON, or its content does not follow the
        format (the message names the file, the key and the value).
    """
    head = f"rank table {source}={path!r}"

    def problem(msg: str) -> ValueError:
        return ValueError(f"{head}: {msg}; expected the format of MindSpore's rank table: "
                          '{"server_count": "K", "server_list": [{"server_id": HOST, '
                          '"device": [{"device_id": "0", "rank_id": "0"}, ...]}, ...]}')

    if not isinstance(path, str) or not path:
        raise ValueError(f"{head}: expected the path of a JSON file")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"{head}: cannot read the file ({exc.strerror or exc})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{head}: not valid JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    if not isinstance(doc, dict):
        raise problem(f"the top level is a {type(doc).__name__}, not an object")
    for key in ("server_count", "server_list"):
        if key not in doc:
            raise problem(f"key {key!r} is missing")
    count = _int("server_count", doc["server_count"], problem)
    servers = doc["server_list"]
    if not isinstance(servers, list) or not servers:
        raise problem(f"server_list={servers!r} is not a non-empty list")
    if count != len(servers):
        raise problem(f"server_count={doc['server_count']!r} but server_list has "
                      f"{len(servers)} servers")
    status = doc.get("status", "completed")
    if status != "completed":
        raise problem(f"status={status!r}; a usable table has status 'completed'")
    hosts, device_ids, next_rank = [], [], 0
    for i, server in enumerate(servers):
        where = f"server_list[{i}]"
        if not isinstance(server, dict):
            raise problem(f"{where} is a {type(server).__name__}, not an object")
        host = server.get("server_id")
        if not isinstance(host, str) or not host.strip():
            raise problem(f"{where}.server_id={host!r} is not a host name or address")
        devices = server.get("device")
        if not isinstance(devices, list) or not devices:
            raise problem(f"{where}.device={devices!r} is not a non-empty list")
        ids, ranks = [], []
        for j, dev in enumerate(devices):
            dwhere = f"{where}.device[{j}]"
            if not isinstance(dev, dict):
                raise problem(f"{dwhere} is a {type(dev).__name__}, not an object")
            for key in ("device_id", "rank_id"):
                if key not in dev:
                    raise problem(f"{dwhere} has no {key!r}")
            ids.append(_int(f"{dwhere}.device_id", dev["device_id"], problem))
            ranks.append(_int(f"{dwhere}.rank_id", dev["rank_id"], problem))
        if len(set(ids)) != len(ids):
            raise problem(f"{where} lists a device_id twice (device ids {ids})")
        want = list(range(next_rank, next_rank + len(ranks)))
        if ranks != want:
            raise problem(f"{where} has rank_ids {ranks}; expected {want} (rank ids 0 .. N-1, "
                          "consecutive, server by server in list order)")
        next_rank += len(ranks)
        hosts.append(host.strip())
        device_ids.append(tuple(ids))
    return RankTable(path, tuple(hosts), tuple(device_ids))
