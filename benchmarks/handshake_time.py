"""Time of one AFD rendezvous handshake (1 attention rank joins FFN rank 0), with and without a token.

Measures ``handshake.collect`` (host thread) + ``handshake.join`` (joining thread)
in one process on loopback, without forming the torch group: listener up, join
started, until both sides returned. Alternates token / no token per repetition
and prints the median and p90 of each in milliseconds.

    .venv/bin/python -m benchmarks.handshake_time [--reps 200]

Nothing leaves the machine (127.0.0.1 and a free port).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

from afd_patches.connectors import handshake
from harness.env import free_port

TOKEN = b"benchmark-token-0123456789abcdef"
FIELDS = {"num_attention_ranks": 1, "num_ffn_ranks": 1, "backend": "gloo", "inline_bytes": 65536,
          "model.hidden_size": 64, "model.dtype": "float32"}


def once(token: bytes | None) -> float:
    """Seconds from the join's start until both sides have returned."""
    port = free_port()
    listener = handshake.listen("127.0.0.1", port)
    own = handshake.Hello("ffn", 0, FIELDS)
    result: list[list[socket.socket]] = []
    deadline = time.monotonic() + 10

    def host() -> None:
        conns = handshake.collect(listener, own, {("attention", 0)}, deadline, f"127.0.0.1:{port}", 10, token)
        handshake.accept_all(conns)
        result.append(conns)

    t = threading.Thread(target=host)
    t.start()
    t0 = time.perf_counter()
    handshake.join("127.0.0.1", port, handshake.Hello("attention", 0, FIELDS), deadline, 10, token)
    t.join()
    elapsed = time.perf_counter() - t0
    listener.close()
    assert result, "the host did not complete"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"token": [], "no token": []}
    for _ in range(args.reps):
        times["token"].append(once(TOKEN))
        times["no token"].append(once(None))
    for name, samples in times.items():
        ms = sorted(x * 1e3 for x in samples)
        print(f"handshake 1A1F loopback, {name}: median {statistics.median(ms):.2f} ms, "
              f"p90 {ms[int(0.9 * (len(ms) - 1))]:.2f} ms over {len(ms)} handshakes")


if __name__ == "__main__":
    main()
