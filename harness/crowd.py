"""A crowd of strangers at an AFD rendezvous port: 240 loopback addresses connecting as fast as they can.

Shared by ``tests/afd/test_link_faults.py`` (the real rank must join within 2 s) and
``benchmarks/link_crowd.py`` (how long it takes, before and after). Loopback only: the sources are
``CROWD`` (127.0.1.1–127.0.1.240, all on ``lo`` under Linux) and the target is whatever loopback
address the caller names. Nothing here imports ``afd_patches`` at module level, so a process that
later puts another checkout first on ``sys.path`` (``benchmarks.connector_latency._use``) may import it.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time

CROWD = [f"127.0.1.{i}" for i in range(1, 241)]
MAX_ATTEMPTS = 200_000  # per ``flood`` call, whatever ``until`` says
NONCE_BYTES = 32  # what a protocol 3 or 4 step 1 carries (``auth.NONCE_BYTES``)


def step1(protocol: int) -> bytes:
    """A joiner's valid step 1 of AFD session protocol ``protocol``: ``{"afd": protocol, "nonce": …}``."""
    return json.dumps({"afd": protocol, "nonce": secrets.token_hex(NONCE_BYTES)}).encode() + b"\n"


def flood(host: str, port: int, sources: list[str], until: float, made: list[int], protocol: int,
          stop: threading.Event | None = None) -> None:
    """Connect to ``host:port`` from ``sources`` in turn, as fast as one thread can, until ``time.monotonic()``
    passes ``until``, ``stop`` is set or ``MAX_ATTEMPTS`` were made; odd attempts send a valid step 1 of
    ``protocol`` and then close, even ones close without a byte. Appends the number of attempts (refused or
    failed ones included) to ``made`` (a list, so that threads can share it).

    Limits: one connection at a time per call (run several threads for more pressure; with the GIL four
    threads roughly fill one core); each connect waits at most 0.5 s; every error is ignored. No connection
    is held open, so this crowd tests the accept budgets and the refusal log more than the pending bounds.
    """
    i = 0
    while time.monotonic() < until and i < MAX_ATTEMPTS and not (stop and stop.is_set()):
        source = sources[i % len(sources)]
        i += 1
        try:
            with socket.create_connection((host, port), timeout=0.5, source_address=(source, 0)) as s:
                if i % 2:
                    s.sendall(step1(protocol))
        except OSError:
            pass
    made.append(i)
