"""The group's ``TCPStore``, which is not trusted: every record this group writes there is MAC'd (``MacStore``).

The store
    FFN rank 0 serves a ``TCPStore`` on the rendezvous' listening socket once the rendezvous is done, every
    rank is its client (``group_store``), and the gloo/NCCL backend is built over ``MacStore`` on top of it
    (``afd_patches.connectors.torch_group``).

The store is not trusted
    torch's ``TCPStore`` has no authentication: anyone who reaches the port can read and write every record.
    So every record this group writes there (gloo's addresses, NCCL's unique id, the heartbeats) carries an
    HMAC under the group's key (``auth.group_key``, from the group id that reached every rank inside its
    authenticated rendezvous session), bound to the record's name; a record that does not verify fails the
    read (``MacStore.tampered`` names it). A stranger can therefore make formation fail (the connector
    reports it; the FFN waits for the next group), but cannot point a rank at another address or
    communicator. Counters (``add``) cannot be MAC'd; gloo and NCCL use none for anything a rank acts on.

The ranks' own connections (``client_key``)
    On opening the store every rank writes, MAC'd, the local addresses of its own connections to it; FFN rank 0
    reads these records to seal the store (``afd_patches.connectors.sealing``).
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from afd_patches.connectors.addresses import TCP_ESTABLISHED, pair_address, tcp_sockets

MAC_BYTES = 32


class StoreTampered(RuntimeError):
    """A record of the group's store failed authentication (written by someone without the group's key)."""


class MacStore(dist.Store):
    """A store whose ``set`` appends an HMAC of (name, value) under ``key`` and whose ``get`` verifies it.

    ``tampered`` holds the name of the first record that failed. Everything else is delegated.
    ``pair_address``: where this rank's gloo pairs listen (``group_store`` sets it; ``None``: torch's choice)."""

    def __init__(self, inner: Any, key: bytes) -> None:
        super().__init__()
        self.inner, self.key = inner, key
        self.tampered: str | None = None
        self.pair_address: str | None = None

    def _mac(self, name: str, value: bytes) -> bytes:
        return hmac.new(self.key, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, data + self._mac(key, data))

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        data, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(self._mac(key, data), mac):
            self.tampered = self.tampered or key
            raise StoreTampered(f"AFD: the record {key!r} in the group's store failed authentication")
        return data

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def group_store(host: str, port: int, rank: int, group: str, key: bytes, timeout_s: float,
                listen_fd: int | None) -> tuple[Any, MacStore]:
    """(the raw ``TCPStore``, the ``MacStore`` over this group's prefix of it). Rank 0 serves the store on
    ``listen_fd`` (the rendezvous' listening socket); the others connect to ``host:port``. Every rank then
    writes its ``client_key`` record (for ``seal_store``) and learns its ``pair_address``."""
    timeout = timedelta(seconds=timeout_s)
    if listen_fd is not None:
        raw = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=listen_fd)
    else:
        raw = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    store = MacStore(dist.PrefixStore(f"afd/{group}", raw), key)
    store.pair_address = pair_address(host)
    store.set(client_key(rank), "\n".join(f"{ip} {p}" for ip, p in store_connections(port)).encode())
    return raw, store


def client_key(rank: int) -> str:
    """The store record in which ``rank`` names the local addresses of its connections to the store."""
    return f"store-client/{rank}"


def store_connections(port: int) -> list[tuple[str, int]]:
    """The local addresses of this process's open connections to a store on ``port`` (``[]`` off Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    return [s.local for s in tcp_sockets() if s.state == TCP_ESTABLISHED and s.remote[1] == port != s.local[1]]
