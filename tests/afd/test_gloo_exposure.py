"""What a gloo AFD group exposes on the host it was configured for, and no further (issue 37, item 6).

A real FFN rank and attention rank (processes of ``test_connector``'s forkserver) form a gloo group on
127.0.0.2 with a token, stay in it until the test releases them, then run one exact exchange and close.
The test process reads their sockets from ``/proc`` (``addresses.tcp_sockets``) and plays the stranger:
a plain ``TCPStore`` client and plain sockets, on loopback only. Every wait is bounded.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from afd_patches import LOGGER
from afd_patches.config import AfdConfig
from afd_patches.connectors import auth, sealing, store
from afd_patches.connectors.addresses import TCP_LISTEN, tcp_sockets, tcp_table
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.torch_dist import TorchDistConnector
from harness.env import free_port
from tests.afd.test_connector import _CTX, _join_all, attn_input, collect, ffn, start
from tests.afd.test_rendezvous import FFN_HOST, TOKEN, _Records, host_config

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads sockets from Linux /proc")

HOLD_S = 60.0  # the longest a rank waits in its group for the test's release
SLOW_S = 2.0  # how long the slow attention rank waits between its verdict and the group's store
MIB = 1 << 20


def holding_rank(cfg: AfdConfig, queue: Any, release: Any, slow_s: float = 0.0) -> None:
    """Form the group and report (pid, the AFD log); after ``release`` run one exchange and close.

    ``slow_s``: wait that long between the verdict and opening the store (reported as ``<name>-verdict``),
    as a rank on a loaded machine may: the store is up and the group not yet formed."""
    torch.set_num_threads(1)
    os.environ[auth.TOKEN_ENV] = TOKEN
    records = _Records()
    logging.getLogger(LOGGER).addHandler(records)
    name = f"{cfg.role}{cfg.rank}"
    if slow_s:
        opened = store.group_store

        def slow_group_store(*args: Any) -> Any:
            queue.put((f"{name}-verdict", {}))
            time.sleep(slow_s)
            return opened(*args)

        store.group_store = slow_group_store
    conn = TorchDistConnector(cfg)
    try:
        conn.init()
    except ConnectorError as e:
        queue.put((name, {"error": str(e), "log": records.lines}))
        return
    queue.put((name, {"error": None, "pid": os.getpid(), "log": list(records.lines)}))
    exact = False
    if release.wait(HOLD_S):
        try:
            if cfg.role == "attention":
                x = attn_input(cfg.rank, 0, 0, 3)
                conn.send_attn_output(x, 0, 0)
                exact = torch.equal(conn.recv_ffn_output(0, 0), ffn(x))
            else:
                meta, xs = conn.recv_attn_output()
                conn.send_ffn_output([ffn(x) for x in xs], meta)
                exact = True
        except ConnectorError as e:
            queue.put((f"{name}-done", {"exact": False, "error": str(e)}))
            conn.close()
            return
    conn.close()
    queue.put((f"{name}-done", {"exact": exact, "error": None}))


def _form(port: int, queue: Any, release: Any, slow_s: float = 0.0) -> list[Any]:
    return [start(holding_rank, host_config("ffn", port, backend="gloo"), queue, release),
            start(holding_rank, host_config("attention", port, backend="gloo"), queue, release, slow_s)]


def _finish(procs: list[Any], queue: Any, release: Any) -> None:
    """Release the ranks; both must then exchange exactly and exit."""
    release.set()
    done = collect(queue, {"ffn0-done", "attention0-done"}, 30)
    _join_all(procs, 15)
    assert done["attention0-done"] == {"exact": True, "error": None}, done
    assert done["ffn0-done"] == {"exact": True, "error": None}, done


def _loopback_listeners(port: int) -> set[int]:
    """Inodes of the listening sockets in this network namespace that a connection to 127.0.0.1:``port``
    can reach (bound to 127.0.0.1 or a wildcard), whichever process holds them."""
    reach = {("127.0.0.1", port), ("0.0.0.0", port), ("::", port)}
    return {s.inode for s in tcp_table() if s.state == TCP_LISTEN and s.local in reach}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


# --------------------------------------------------------------------------- tests
def test_every_listening_socket_of_a_gloo_group_is_on_the_configured_host() -> None:
    """gloo's pair listeners bind ``host`` as the store does (before: what the machine's name resolved to,
    127.0.0.1 here, where any local program could reach them); none of theirs answers on 127.0.0.1 at their ports."""
    port, queue, release = free_port(), _CTX.Queue(), _CTX.Event()
    procs = _form(port, queue, release)
    try:
        got = collect(queue, {"ffn0", "attention0"}, 60)
        assert got["ffn0"]["error"] is None and got["attention0"]["error"] is None, got
        listening = {name: [s.local for s in tcp_sockets(r["pid"]) if s.state == TCP_LISTEN]
                     for name, r in got.items()}
        ours = {s.inode for r in got.values() for s in tcp_sockets(r["pid"]) if s.state == TCP_LISTEN}
        pair_ports = [p for name, addresses in listening.items() for _, p in addresses if p != port]
        for p in pair_ports:
            try:
                socket.create_connection(("127.0.0.1", p), timeout=2).close()
            except ConnectionRefusedError:
                continue
            # something answered: another test's process may hold that port on 127.0.0.1 (ports are per
            # address); it must not be one of the ranks' listeners
            assert not _loopback_listeners(p) & ours, (p, listening)
    finally:
        release.set()
    _finish(procs, queue, release)
    assert (FFN_HOST, port) in listening["ffn0"], listening  # the store
    assert len(listening["ffn0"]) >= 2 and len(listening["attention0"]) >= 1, listening  # and gloo's, per rank
    assert {ip for addresses in listening.values() for ip, _ in addresses} == {FFN_HOST}, listening


def test_the_store_takes_nothing_from_a_stranger_once_the_group_formed() -> None:
    """A stranger who reached the store while the group was forming (its one window: documented) is cut when
    the group has formed: its next writes fail and FFN rank 0 does not grow by them; a new connection gets no
    answer; the group itself works on (before: the store kept every 8 MiB value for the group's life)."""
    from torch.distributed import TCPStore

    port, queue, release = free_port(), _CTX.Queue(), _CTX.Event()
    procs = _form(port, queue, release, slow_s=SLOW_S)
    try:
        collect(queue, {"attention0-verdict"}, 60)
        early = TCPStore(FFN_HOST, port, None, False, timedelta(seconds=5), wait_for_workers=False)
        early.set("stranger/early", b"x")
        assert early.get("stranger/early") == b"x"  # the formation window: the store takes it
        got = collect(queue, {"ffn0", "attention0"}, 60)
        assert got["ffn0"]["error"] is None and got["attention0"]["error"] is None, got
        before = _rss_mib(got["ffn0"]["pid"])
        written = 0
        t0 = time.monotonic()
        for i in range(8):  # 64 MiB at most
            try:
                early.set(f"stranger/big{i}", b"y" * (8 * MIB))
                early.get(f"stranger/big{i}")
                written += 1
            except RuntimeError:  # torch's DistNetworkError: the connection was cut
                break
        refused_s = time.monotonic() - t0
        time.sleep(0.5)  # let the store take whatever was on its way
        grown = _rss_mib(got["ffn0"]["pid"]) - before
        with pytest.raises(OSError):
            socket.create_connection((FFN_HOST, port), timeout=2).close()
    finally:
        release.set()
    _finish(procs, queue, release)
    assert written == 0 and refused_s < 5, (written, refused_s)
    assert grown < 16, f"FFN rank 0 grew by {grown:.0f} MiB"
    assert any("cut 1 connection(s) to the group's store" in line for line in got["ffn0"]["log"]), got["ffn0"]


def test_a_rank_that_closed_early_is_not_read_as_translated() -> None:
    """Sealing's judgement of the store's connections (``translated_ranks``), on the cases the 2A2F block-mapping
    test met at random: a rank that finished its work and closed before FFN rank 0 sealed is no error; a rank
    not seen while a connection no rank named is open reads as translated."""
    a, b, c, stranger = ("127.0.0.1", 40001), ("127.0.0.1", 40002), ("127.0.0.1", 40003), ("127.0.0.9", 5)
    named = {0: {a}, 1: {b}, 2: {c}}
    assert sealing.translated_ranks(named, {a, b, c}) == []
    assert sealing.translated_ranks(named, {a}) == []  # ranks 1 and 2 closed their connections already
    assert sealing.translated_ranks(named, set()) == []
    assert sealing.translated_ranks(named, {a, stranger}) == [1, 2]
    assert sealing.translated_ranks(named, {a, b, c, stranger}) == []  # a stranger, cut, nobody unseen
