"""What the CUDA path needs, checked on CPU: device refusal at the handshake, NCCL error texts, the NCCL
group timeout, the FFN serve thread's device and dtype, NCCL-style polling waits, the FFN worker on vLLM's
GPU worker. Real NCCL/CUDA runs are scripts/gpu_check's job (docs/running.md, "CUDA")."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

from afd_patches.config import IDLE_TIMEOUT_S, AfdConfig, LinkConfig, restore
from afd_patches.connectors import torch_group
from afd_patches.connectors.base import ConnectorClosed, ConnectorError, ConnectorMismatch, ConnectorTimeout, Meta
from afd_patches.connectors.torch_dist import TorchDistConnector
from afd_patches.connectors.torch_group import TorchGroupTransport
from afd_patches.connectors.transport import BackendError
from afd_patches.workers.ffn import FfnRoleMixin
from afd_patches.workers.ffn_server import FfnServer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(role: str, port: int, backend: str = "nccl", **extra: Any) -> AfdConfig:
    return AfdConfig(role=role, port=port, timeout_s=5.0,
                     connector_extra_config=LinkConfig(backend=backend, device="cpu", **extra))


def _init_both(port: int, backend: str = "nccl", **extra: Any) -> dict[str, ConnectorError | None]:
    """``init()`` an FFN and an attention connector in two threads; each one's exception (or None)."""
    results: dict[str, ConnectorError | None] = {}

    def run(role: str) -> None:
        conn = TorchDistConnector(_config(role, port, backend, **extra))
        try:
            conn.init()
            results[role] = None
        except ConnectorError as e:  # reported to the test
            results[role] = e
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(role,)) for role in ("ffn", "attention")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


# ------------------------------------------------------------------ handshake
def test_two_ranks_on_one_gpu_are_refused_at_the_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ranks report the same GPU with NCCL: both fail in the handshake, before any group, saying what to do."""
    monkeypatch.setattr(torch_group, "device_identity", lambda device: "box/GPU-5d2c7a4e")
    results = _init_both(_port())
    for role, err in results.items():
        assert isinstance(err, ConnectorMismatch), (role, err)
        text = str(err)
        assert "both use GPU box/GPU-5d2c7a4e" in text and "NCCL cannot put two ranks" in text, text
        assert "CUDA_VISIBLE_DEVICES" in text and "backend: gloo" in text, text


def test_same_gpu_with_gloo_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo copies through host memory, so two ranks on one GPU are fine there: the group forms."""
    monkeypatch.setattr(torch_group, "device_identity", lambda device: "box/GPU-5d2c7a4e")
    assert _init_both(_port(), backend="gloo") == {"ffn": None, "attention": None}


def test_nccl_error_is_reported_as_a_backend_failure_not_as_a_crashed_peer() -> None:
    """On NCCL an operation's exception is ``BackendError`` by the backend it came from (no message is
    parsed), and the connector says so, with NCCL's own text."""
    transport = TorchGroupTransport(_Group(), "nccl", torch.device("cpu"), 5.0, 0)
    err = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage, NCCL version 2.21.5")
    out = transport._error(err, 1, 0.01, 5.0)
    assert isinstance(out, BackendError) and "NCCL reported an error" in str(out), out
    conn = TorchDistConnector(_config("ffn", _port(), backend="gloo"))
    text = str(conn._fail(out, 1, "layer 0 step 0"))
    assert "not a lost connection" in text and "NCCL version 2.21.5" in text and "crashed" not in text, text


# ------------------------------------------------------------------ NCCL group timeout
def test_nccl_group_timeout_covers_the_idle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeout the group is built with (``ProcessGroupNCCL.Options._timeout``, the watchdog's bound) is at
    least ``max(idle_timeout_s, timeout_s)`` on NCCL; gloo keeps the rendezvous budget."""
    seen: dict[str, float] = {}

    def fake_build(store: Any, backend: str, rank: int, world_size: int, timeout_s: float) -> Any:
        seen[f"{backend}{rank}"] = timeout_s
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch_group, "build_group", fake_build)
    for backend in ("nccl", "gloo"):
        results = _init_both(_port(), backend=backend, idle_timeout_s=3600.0)
        assert all(isinstance(e, ConnectorError) for e in results.values()), results
    assert seen["nccl0"] == seen["nccl1"] == 3600.0, seen
    assert seen["gloo0"] <= 5 and seen["gloo1"] <= 5, seen
    assert restore({"role": "ffn"}).link.idle_timeout_s == IDLE_TIMEOUT_S


# ------------------------------------------------------------------ NCCL-style waits
class _Work:
    """Completes after ``after_s``; records ``wait()`` calls (what an NCCL work object offers)."""

    def __init__(self, after_s: float) -> None:
        self.done_at = time.monotonic() + after_s
        self.waited = 0

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: Any = None) -> bool:
        assert timeout is None and self.is_completed(), "waited on an incomplete NCCL work (a host block)"
        self.waited += 1
        return True


def test_polling_wait_completes_times_out_and_stops() -> None:
    work = _Work(0.05)
    assert torch_group.poll(work, time.monotonic() + 5, lambda: False) and work.waited == 1
    t0 = time.monotonic()
    assert not torch_group.poll(_Work(60), time.monotonic() + 0.2, lambda: False)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert not torch_group.poll(_Work(60), time.monotonic() + 60, stop.is_set)
    assert time.monotonic() - t0 < 1.5


def _nccl_connector(group: Any) -> tuple[TorchDistConnector, TorchGroupTransport]:
    conn = TorchDistConnector(_config("ffn", _port()))
    transport = TorchGroupTransport(group, "nccl", torch.device("cpu"), 5.0, 0)
    conn._transport = transport
    return conn, transport


def test_nccl_wait_is_interrupted_by_a_lost_peer() -> None:
    """The FFN's idle wait on NCCL: the heartbeat losing the peer ends it, typed as a timeout naming the cause.
    (close() from another thread: test_nccl_close_from_another_thread_interrupts_the_wait_and_aborts.)"""
    conn, transport = _nccl_connector(_Group())
    threading.Timer(0.2, lambda: conn._on_lost(1, "no heartbeat for 5.0s")).start()
    t0 = time.monotonic()
    with pytest.raises(ConnectorTimeout, match=r"lost attention rank 0.*no heartbeat"):
        conn._io("the next attention output", 1, lambda: transport.wait(_Work(60), 1, 60))
    assert time.monotonic() - t0 < 1.5


# ------------------------------------------------------------------ FFN serve thread: device and dtype
class _Model(torch.nn.Module):
    """An FFN-role model stand-in: records what ``afd_ffn`` was given."""

    def __init__(self, device: str | None) -> None:
        super().__init__()
        if device is not None:
            self.w = torch.nn.Parameter(torch.empty(4, device=device))
        self.seen: list[tuple[torch.device, torch.dtype]] = []

    def afd_ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.device, x.dtype))
        return x


class _OneStep:
    """A connector stand-in: one float32 CPU step from one attention rank, then the group ends; a second
    formation waits until ``close()`` (the server's stop)."""

    def __init__(self) -> None:
        self.steps = [(Meta(0, 0, (3, 4), "float32"), [torch.ones(3, 4)])]
        self.sent: list[torch.Tensor] = []
        self.formed = 0
        self.closed = threading.Event()
        self.messages_sent = self.messages_received = 0

    def init(self, *_: Any) -> None:
        self.formed += 1
        if self.formed > 1:
            self.closed.wait(10)
            raise ConnectorClosed("closed while forming")

    def recv_attn_output(self) -> tuple[Meta, list[torch.Tensor]]:
        if not self.steps:
            raise ConnectorClosed("every served attention rank closed")
        return self.steps.pop()

    def send_ffn_output(self, outputs: list[torch.Tensor], meta: Meta) -> None:
        self.sent.extend(outputs)

    def close(self) -> None:
        self.closed.set()


def _serve_once(model: _Model, dtype: str, device: str = "cpu") -> tuple[FfnServer, _OneStep]:
    """One group served by an ``FfnServer`` placed as the FFN worker places it (``_afd_placement``)."""
    worker = FfnRoleMixin.__new__(FfnRoleMixin)
    worker.device = torch.device(device)
    conn = _OneStep()
    server = FfnServer(0, "127.0.0.1:1", lambda: conn, 1.0, 1.0, model, worker._afd_placement(model, {"dtype": dtype}),
                       None, None)
    server.start()
    assert server.group_ended.wait(10)
    server.stop()
    assert not server.alive
    return server, conn


def test_serve_loop_moves_inputs_to_the_models_device_and_dtype() -> None:
    model = _Model("meta")
    server, conn = _serve_once(model, "bfloat16")
    assert server.error is None, server.error
    assert model.seen == [(torch.device("meta"), torch.bfloat16)]
    assert len(conn.sent) == 1 and conn.sent[0].dtype == torch.bfloat16


def test_serve_thread_sets_the_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA worker the serve thread makes the worker's device current in that thread, first."""
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    model = _Model(None)  # no parameters: the worker's device decides
    moved: list[Any] = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: moved.append(k) or self)
    _serve_once(model, "float16", device="cuda:1")
    assert calls and calls[0][1] == torch.device("cuda", 1) and calls[0][0] != threading.current_thread().name
    assert moved and moved[0] == {"device": torch.device("cuda", 1), "dtype": torch.float16}


# ------------------------------------------------------------------ the FFN worker on vLLM's GPU worker
def test_cuda_ffn_worker_builds_no_kv_cache_in_either_model_runner() -> None:
    """Neither runner is handed the FFN's empty KV cache config (V2 would build attention backends, block
    tables and a CUDA-graph manager for it); only the block count is recorded."""
    from types import SimpleNamespace

    from afd_patches.workers.cuda import CudaFfnWorker

    class Runner:
        def initialize_kv_cache(self, *a: Any, **k: Any) -> None:
            raise AssertionError("the FFN role must not initialise a KV cache")

    worker = CudaFfnWorker.__new__(CudaFfnWorker)
    worker.cache_config = SimpleNamespace(num_gpu_blocks=None)
    worker.model_runner = Runner()
    worker.initialize_from_config(SimpleNamespace(num_blocks=0, kv_cache_groups=[]))
    assert worker.cache_config.num_gpu_blocks == 0
    assert worker.compile_or_warm_up_model().language_model == 0.0


class _Group:
    """A process-group stand-in: sends complete at once; records how the group was ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        return _Work(0)

    def abort(self) -> None:
        self.ended.append("abort")

    def shutdown(self) -> None:
        self.ended.append("shutdown")


def test_nccl_close_from_another_thread_interrupts_the_wait_and_aborts() -> None:
    """shutdown() while the serve thread waits on NCCL: the wait ends with ConnectorClosed, close() then
    offers CLOSE alone and aborts the group (its abandoned receive stays queued; a shutdown would wait)."""
    group = _Group()
    conn, transport = _nccl_connector(group)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            conn._io("the next attention output", 1, lambda: transport.wait(_Work(60), 1, 60))
        except ConnectorError as e:
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    conn.close()
    waiter.join(5)
    assert time.monotonic() - t0 < 1.0 and not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ConnectorClosed), errors
    assert group.ended == ["abort"]
