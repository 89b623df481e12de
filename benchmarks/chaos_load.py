"""The chaos benchmark's load and its witnesses: streams through the ``openai`` client, ``/metrics`` samples.

``Load`` runs ``streams`` concurrent greedy streamed completions (``openai.AsyncOpenAI``, token-id prompts,
``return_tokens_as_token_ids``) on a thread of its own, stream ``i`` on attention server ``i % n``, one request
after another, until ``stop()``. Each request becomes one ``Outcome``, classified at its end:

``exact``    every token equal to plain vLLM's for that prompt;
``wrong``    all ``max_tokens`` tokens came and differ from plain's;
``lost``     the stream ended early without an error, or the connection dropped while its server was not being
             killed or restarted;
``named``    an error whose message names the cause (``AFD``, an attention rank, or the FFN's ``host:port``);
``unnamed``  any other error message;
``cut``      the connection was refused or reset while its server was deliberately down (``down`` names it);
``hung``     no chunk for ``timeout_s`` (the client's read timeout).

After a request that did not end ``exact`` a stream pauses, ``RETRY_PAUSE_S`` doubled per failure in a row up to
``RETRY_CAP_S`` (as a client retrying with backoff: failing requests still step the engine, and on 2 cores their
busy-polling workers take CPU from a restarting FFN). ``Sampler`` reads every attention
server's ``vllm:afd_group_up`` and ``vllm:afd_metrics_stale`` every ``SAMPLE_S``; ``gauge_wrong_s`` judges the
samples against the requests: a server is up at ``t`` when a request to it ended ``exact`` within ``WINDOW_S``
and none failed there, down when one failed and none was exact, unknown otherwise (then no sample is judged).
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

RETRY_PAUSE_S, RETRY_CAP_S = 0.25, 1.0
SAMPLE_S = 0.5
WINDOW_S = 1.0
FAILED = ("named", "unnamed", "cut")


@dataclass
class Outcome:
    server: str
    start: float
    end: float
    kind: str
    detail: str = ""


def _tokens(chunk: object) -> list[int]:
    logprobs = chunk.choices[0].logprobs if chunk.choices else None  # type: ignore[attr-defined]
    return [int(t.split(":", 1)[1]) for t in (logprobs.tokens if logprobs and logprobs.tokens else [])]


class Load:
    """See the module docstring. ``targets``: server label -> base URL (``http://addr:port``); ``expected[j]``:
    plain's tokens for ``prompts[j]``; ``down()``: the labels of servers being killed or restarted now; ``names``:
    strings an error message must hold one of to count as ``named``."""

    def __init__(self, targets: dict[str, str], model: str, prompts: list[list[int]], expected: list[list[int]],
                 max_tokens: int, streams: int, timeout_s: float, down: Callable[[], set[str]],
                 names: tuple[str, ...]) -> None:
        self.targets, self.model, self.prompts, self.expected = targets, model, prompts, expected
        self.max_tokens, self.streams, self.timeout_s, self.down, self.names = (max_tokens, streams, timeout_s,
                                                                               down, names)
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="chaos-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait_s: float) -> bool:
        """Stop sending; wait up to ``wait_s`` for the requests in flight. Whether they all ended."""
        self._stop.set()
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    async def _main(self) -> None:
        from openai import AsyncOpenAI

        labels = list(self.targets)
        clients = {k: AsyncOpenAI(base_url=f"{u}/v1", api_key="none", timeout=self.timeout_s, max_retries=0)
                   for k, u in self.targets.items()}
        await asyncio.gather(*(self._stream(i, labels[i % len(labels)], clients[labels[i % len(labels)]])
                               for i in range(self.streams)))
        for c in clients.values():
            await c.close()

    async def _stream(self, i: int, label: str, client: object) -> None:
        k = failures = 0
        while not self._stop.is_set():
            j = (i + k) % len(self.prompts)
            k += 1
            outcome = await self._one(label, client, j)
            self.outcomes.append(outcome)
            failures = 0 if outcome.kind == "exact" else failures + 1
            if failures:
                await asyncio.sleep(min(RETRY_PAUSE_S * 2 ** (failures - 1), RETRY_CAP_S))

    async def _one(self, label: str, client: object, j: int) -> Outcome:
        import openai

        start, got = time.monotonic(), []
        try:
            stream = await client.completions.create(  # type: ignore[attr-defined]
                model=self.model, prompt=self.prompts[j], max_tokens=self.max_tokens, temperature=0, logprobs=1,
                stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            async for chunk in stream:
                got += _tokens(chunk)
        except openai.APITimeoutError:
            return Outcome(label, start, time.monotonic(), "hung", f"no chunk for {self.timeout_s:g}s")
        except openai.APIConnectionError as e:
            kind = "cut" if label in self.down() else "lost"
            return Outcome(label, start, time.monotonic(), kind, f"{e}: {e.__cause__!r}"[:200])
        except openai.APIError as e:
            text = str(e)
            kind = "named" if any(n in text for n in self.names) else "unnamed"
            return Outcome(label, start, time.monotonic(), kind, text[:300])
        end = time.monotonic()
        want = self.expected[j][:self.max_tokens]
        if got == want:
            return Outcome(label, start, end, "exact")
        if len(got) < self.max_tokens:
            return Outcome(label, start, end, "lost", f"{len(got)} of {self.max_tokens} tokens, no error")
        return Outcome(label, start, end, "wrong", f"prompt {j}: {got} != {want}")


@dataclass
class Sample:
    t: float
    server: str
    up: float | None  # vllm:afd_group_up, None when absent
    stale: bool
    reachable: bool


def read_gauges(url: str) -> tuple[float | None, bool]:
    """(``vllm:afd_group_up`` of the attention role or None, ``vllm:afd_metrics_stale`` is 1)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=SAMPLE_S) as r:
        text = r.read().decode()
    up, stale = None, False
    for line in text.splitlines():
        if line.startswith("vllm:afd_group_up{") and 'role="attention"' in line:
            up = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:afd_metrics_stale") and float(line.rsplit(" ", 1)[1]) == 1.0:
            stale = True
    return up, stale


class Sampler:
    """Reads every target's gauges every ``SAMPLE_S`` on a thread until ``stop()``; ``samples`` in time order."""

    def __init__(self, targets: dict[str, str]) -> None:
        self.targets = targets
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for label, url in self.targets.items():
                t = time.monotonic()
                try:
                    up, stale = read_gauges(url)
                    self.samples.append(Sample(t, label, up, stale, True))
                except (OSError, ValueError):
                    self.samples.append(Sample(t, label, None, False, False))


def truth(outcomes: list[Outcome], server: str, t: float) -> bool | None:
    """Whether ``server``'s group was up at ``t`` by the requests (module docstring); None when unknown."""
    near = [o.kind for o in outcomes if o.server == server and abs(o.end - t) <= WINDOW_S]
    exact, failed = "exact" in near, any(k in FAILED or k in ("lost", "hung") for k in near)
    return True if exact and not failed else False if failed and not exact else None


def gauge_judgement(samples: list[Sample], outcomes: list[Outcome], since: float,
                    until: float) -> tuple[float, float]:
    """(longest stretch in seconds any server's gauge contradicted the requests, seconds it was stale) over the
    samples in [since, until). Absent and not stale while the truth is known counts as wrong."""
    longest = stale_s = 0.0
    for server in {s.server for s in samples}:
        run_from: float | None = None
        for s in (s for s in samples if s.server == server and since <= s.t < until):
            if s.stale:
                stale_s += SAMPLE_S
            real = truth(outcomes, server, s.t) if s.reachable else None
            wrong = real is not None and not s.stale and (s.up is None or (s.up == 1.0) != real)
            if wrong:
                run_from = s.t if run_from is None else run_from
                longest = max(longest, s.t - run_from + SAMPLE_S)
            else:  # right, or unknown: a stretch is contradicted sample by sample (a held step answers nothing)
                run_from = None
    return longest, stale_s
