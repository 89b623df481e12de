"""FFN-restart recovery as an AFD attention server sees it: FFN back → first successful request.

Starts one FFN server and one attention server (1A1F, tiny float32 Llama with a
tiny tokenizer, 127.0.0.1, the servers of ``afd_server_load.py``), checks one
greedy completion, then ``--rounds`` times: SIGKILLs the FFN server's process
group, checks that a request to the attention server fails naming AFD, starts a
new FFN server on the same AFD port and sends the same completion every
``POLL_S`` until one succeeds (it must equal the first). Prints per round: the
FFN server's start (started → ``/health`` 200), the recovery after it
(FFN ``/health`` 200 → first successful request, which includes the attention
worker's re-formation), and the whole outage (FFN started → first success).
The attention server keeps its pid throughout and holds no step (``hold_s`` 0: requests fail while the FFN is
down). With ``--record`` the medians go to benchmarks/results/.

    python -m benchmarks.ffn_restart_recovery [--rounds 3] [--timeout-s 5] [--record]
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from statistics import median

from benchmarks import record
from benchmarks.afd_server_load import ARCH, HOST, Server
from harness.env import free_port, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

POLL_S = 0.05
PROMPT = [1, 2, 3, 4, 5]


def complete(port: int, model: Path) -> list[str]:
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"http://{HOST}:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return list(json.loads(r.read())["choices"][0]["logprobs"]["tokens"])


def main() -> None:
    parser = record.parser(__doc__, recorded=True, rounds=3)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="afd-recovery-"))
    model = build_tokenizer(build(work / "tiny-llama", "llama"), vocab_size=512)
    env = vllm_env(PYTHONUNBUFFERED="1")
    afd = ["--afd-host", HOST, "--afd-port", str(free_port()), "--afd-timeout-s", str(args.timeout_s)]
    ffn = Server("ffn-0", model, work, [*ARCH, "--afd-role", "ffn", *afd], env, None)
    attn = None
    rows: list[tuple[float, float, float]] = []
    try:
        ffn.wait_healthy()
        # hold_s 0: the requests of the outage fail at once (a hold would keep them until the FFN is back; that is
        # ``benchmarks.chaos --hold-s``)
        attn = Server("attention", model, work, [*ARCH, "--afd-role", "attention", "--afd-hold-s", "0", *afd],
                      env, None)
        attn.wait_healthy()
        expected = complete(attn.port, model)
        for i in range(1, args.rounds + 1):
            os.killpg(ffn.proc.pid, signal.SIGKILL)
            ffn.proc.wait(30)
            try:
                complete(attn.port, model)
                raise RuntimeError("a request succeeded with the FFN server killed")
            except urllib.error.HTTPError as e:
                message = e.read().decode(errors="replace")
                assert "AFD" in message, message
            started = time.monotonic()
            ffn = Server(f"ffn-{i}", model, work, [*ARCH, "--afd-role", "ffn", *afd], env, None)
            ffn.wait_healthy()
            healthy = time.monotonic()
            while True:
                try:
                    tokens = complete(attn.port, model)
                    break
                except urllib.error.HTTPError:
                    time.sleep(POLL_S)
            done = time.monotonic()
            assert tokens == expected, (tokens, expected)
            assert attn.proc.poll() is None
            rows.append((healthy - started, done - healthy, done - started))
            print(f"round {i}: FFN server healthy in {rows[-1][0]:.1f}s; first successful request "
                  f"{rows[-1][1]:.2f}s after that ({rows[-1][2]:.1f}s after the FFN server was started)", flush=True)
    finally:
        for s in (attn, ffn):
            if s is not None:
                s.stop()
    load = os.getloadavg()
    print(f"median over {len(rows)} rounds: FFN start {median(r[0] for r in rows):.1f}s, recovery after FFN healthy "
          f"{median(r[1] for r in rows):.2f}s, whole outage {median(r[2] for r in rows):.1f}s "
          f"(load average {load[0]:.1f} / {load[1]:.1f}, {os.cpu_count()} CPUs)")
    if args.record:
        recovery = [r[1] for r in rows]
        record.write("ffn_restart_recovery", [
            record.Figure("recovery_s", "FFN engine restarted: its healthy restart → the attention engine's first "
                          "answered request", median(recovery), "s", 2,
                          f"median of {len(rows)} rounds, {min(recovery):.2f}–{max(recovery):.2f} s; in-flight "
                          f"requests fail within `timeout_s` ({args.timeout_s:g} s here), naming the FFN", readme=3),
            record.Figure("outage_s", "the whole outage: FFN server started → first answered request",
                          median(r[2] for r in rows), "s", 1, "median; mostly the FFN server's own start"),
        ])


if __name__ == "__main__":
    main()
