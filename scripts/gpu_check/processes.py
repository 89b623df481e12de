"""The two processes of every check.py call, and the driver's handle on them (``Pair``).

An FFN rank (``ffn_main``: the real ``FfnServer`` of ``afd_patches/workers/ffn_server.py`` over the real
connector, serving the stand-in ``Mlp``) and an attention rank (``attention_main``: the real
``TorchDistConnector``, running the plan the call asks for), started with ``spawn`` and talking to the
driver through queues. check.py's docstring says what each call checks; ``checks.py`` holds the checks.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import statistics
import time
from typing import Any

import torch
from piecewise import piecewise_sizes

_CTX = mp.get_context("spawn")


# ------------------------------------------------------------------ pieces both processes use
class Mlp(torch.nn.Module):
    """A Llama-style gated MLP; the same seed gives the same weights in every process."""

    def __init__(self, hidden: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        inter = hidden * 11 // 4
        scale = hidden ** -0.5
        self.gate_up = torch.nn.Parameter((torch.randn(2 * inter, hidden, generator=gen) * scale).to(device, dtype))
        self.down = torch.nn.Parameter((torch.randn(hidden, inter, generator=gen) * scale).to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ self.down.t()

    def afd_ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self(x)


def make_config(role: str, port: int, opts: dict[str, Any]) -> Any:
    """The connector's config, built directly (the rules of ``parse``/``restore`` between link keys, such as
    the refusal of micro-batches on NCCL, are not applied: see ``microbatch`` in the module docstring)."""
    from afd_patches.config import AfdConfig, LinkConfig

    extra: dict[str, Any] = {"backend": opts["backend"]}
    if opts["backend"] == "nccl":
        extra["device"] = opts["devices"][role]
    if opts.get("micro_batches", 1) > 1:
        extra["micro_batches"] = opts["micro_batches"]
    if opts.get("inline_bytes") is not None:
        extra["inline_bytes"] = opts["inline_bytes"]
    return AfdConfig(role=role, port=port, timeout_s=opts["timeout_s"], connector_extra_config=LinkConfig(**extra))


def identity(opts: dict[str, Any]) -> dict[str, Any]:
    layers = {"num_hidden_layers": opts["layers"]} if opts.get("layers") else {}  # bounds a header's layer
    return {"hidden_size": opts["hidden"], "dtype": opts["dtype"], "max_num_batched_tokens": max(opts["tokens"]),
            **layers}


def setup(role: str, opts: dict[str, Any]) -> torch.device:
    """Per process: the device, and (with ``force_distinct``) a bypass of the same-GPU check."""
    torch.set_num_threads(2)
    device = torch.device(opts["devices"][role])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if opts.get("force_distinct"):
        from afd_patches.connectors import torch_group

        torch_group.device_identity = lambda d: f"forced-distinct-{role}"
    return device


def _error(e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "message": str(e)[:600]}


# ------------------------------------------------------------------ the FFN process
def ffn_main(port: int, opts: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """Serve as the FFN worker does (an ``FfnServer`` with the connector ``build_connector`` makes), obey ``inbox``.

    No vLLM worker: the server is given a stand-in MLP on the check's device."""
    device = setup("ffn", opts)
    from afd_patches.config import AfdConfig
    from afd_patches.workers.connection import build_connector
    from afd_patches.workers.ffn_server import FfnServer

    cfg: AfdConfig = make_config("ffn", port, opts)
    ident = identity(opts)
    dtype = getattr(torch, opts["dtype"])
    model = Mlp(opts["hidden"], device, dtype)
    server = FfnServer(cfg.rank, f"{cfg.host}:{cfg.port}", lambda: build_connector(cfg, ident), cfg.timeout_s,
                       cfg.timeout_s, model, (device, dtype), None, None)
    server.start()
    while True:
        try:
            command = inbox.get(timeout=0.5)
        except queue.Empty:
            command = None
        if command == "count":  # messages served so far (the ``microbatch`` call's exchange count)
            outbox.put(("ffn-count", {"batches": server.batches}))
        if command == "close":
            t0 = time.monotonic()
            server.stop()  # cancels the blocked receive, then joins the serve thread
            stop_s = time.monotonic() - t0
            outbox.put(("ffn-closed", {"close_s": stop_s, "thread_s": stop_s, "thread_alive": server.alive}))
            return
        if server.group_ended.is_set():
            err = server.error or server.group_error
            outbox.put(("ffn", {"at": time.monotonic(), "batches": server.batches,
                                **(_error(err) if err else {"error": None})}))
            server.stop()
            return



# ------------------------------------------------------------------ the attention process
def _time_us(fn: Any, reps: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def attention_main(port: int, opts: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """Exchange per ``opts["plan"]``: ``sizes`` (bitwise + timing), ``idle`` (one exchange after idling)."""
    device = setup("attention", opts)
    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    dtype = getattr(torch, opts["dtype"])
    conn = TorchDistConnector(make_config("attention", port, opts), identity=identity(opts))
    t0 = time.monotonic()
    try:
        conn.init()
    except ConnectorError as e:
        outbox.put(("attention", {"stage": "init", "elapsed": time.monotonic() - t0, **_error(e)}))
        return
    ref = Mlp(opts["hidden"], device, dtype)
    step = [0]

    def exchange(x: torch.Tensor) -> torch.Tensor:
        conn.send_attn_output(x, 0, step[0])
        y = conn.recv_ffn_output(0, step[0])
        step[0] += 1
        return y

    try:
        if opts["plan"] == "microbatch":
            import microbatch_step

            for res in microbatch_step.variants(conn, lambda x, layer: ref(x), opts, device, dtype):
                outbox.put(("microbatch", res))
                inbox.get(timeout=120)  # the driver reads the FFN's count meanwhile
            outbox.put(("attention-idle", {}))
            inbox.get(timeout=120)
        elif opts["plan"] == "piecewise":
            for res in piecewise_sizes(conn, opts, device, dtype):
                outbox.put(("piecewise", res))
            outbox.put(("attention-idle", {}))
            inbox.get(timeout=120)
        elif opts["plan"] == "sizes":
            gen = torch.Generator().manual_seed(7)
            for tokens in opts["tokens"]:
                x = torch.randn(tokens, opts["hidden"], generator=gen).to(device, dtype)
                y = exchange(x)
                with torch.inference_mode():
                    local = ref(x)
                rt = _time_us(lambda x=x: exchange(x), opts["reps"], device)
                with torch.inference_mode():
                    mlp = _time_us(lambda x=x: ref(x), opts["reps"], device)
                outbox.put(("size", {"tokens": tokens, "hidden": opts["hidden"], "dtype": opts["dtype"],
                                     "bitwise_equal": bool(torch.equal(y, local)),
                                     "exchange_us_p50": statistics.median(rt),
                                     "exchange_us_p90": sorted(rt)[int(0.9 * (len(rt) - 1))],
                                     "local_mlp_us_p50": statistics.median(mlp)}))
            outbox.put(("attention-idle", {}))
            inbox.get(timeout=120)  # the FFN closes meanwhile
        else:
            exchange(torch.ones(1, opts["hidden"], device=device, dtype=dtype))
            outbox.put(("attention-idle", {"at": time.monotonic()}))
            inbox.get(timeout=opts["idle_s"] + 120)  # idle until told
            y = exchange(torch.ones(1, opts["hidden"], device=device, dtype=dtype))
            outbox.put(("after-idle", {"ok": y.shape == (1, opts["hidden"]), "alive": True}))
            time.sleep(3600)  # idle until killed
    except ConnectorError as e:
        outbox.put(("attention", {"stage": "exchange", **_error(e)}))
        return
    except Exception as e:  # noqa: BLE001 - reported to the driver (a check that fails), not a silent exit
        outbox.put(("attention", {"stage": opts["plan"], **_error(e)}))
        return
    conn.close()


# ------------------------------------------------------------------ driver
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """The two processes of one check and their mailboxes."""

    def __init__(self, opts: dict[str, Any]) -> None:
        port = _port()
        self.out = _CTX.Queue()
        self.to_ffn, self.to_attn = _CTX.Queue(), _CTX.Queue()
        self.ffn = _CTX.Process(target=ffn_main, args=(port, opts, self.to_ffn, self.out), daemon=True)
        self.attn = _CTX.Process(target=attention_main, args=(port, opts, self.to_attn, self.out), daemon=True)
        self.ffn.start()
        self.attn.start()
        self.got: dict[str, list[dict[str, Any]]] = {}

    def wait_for(self, name: str, timeout_s: float) -> dict[str, Any] | None:
        """The next message called ``name``, or None after ``timeout_s``."""
        got = self.wait_any([name], timeout_s)
        return got[1] if got else None

    def wait_any(self, names: list[str], timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        """The next message called one of ``names`` (first of ``names`` that has one), or None."""
        deadline = time.monotonic() + timeout_s
        while True:
            for name in names:
                if self.got.get(name):
                    return name, self.got[name].pop(0)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                key, value = self.out.get(timeout=left)
            except queue.Empty:
                return None
            self.got.setdefault(key, []).append(value)

    def end(self) -> None:
        for p in (self.ffn, self.attn):
            if p.is_alive():
                p.kill()
            p.join(10)

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

