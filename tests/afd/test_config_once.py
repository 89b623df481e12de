"""The AFD config parsed once (issue 51, item 2 and finding 5).

- Values that cannot work are refused by ``parse``, naming the key and the bound: each row of ``CANNOT_WORK``
  passed ``parse`` before and failed later where it is used (a raw ``OverflowError``, or an allocation or a
  list that cannot be built); the consumers that are cheap to call show it here.
- ``restore`` rebuilds the front end's normalized config in any process without I/O (no file, no name
  resolution, no affinity), and refuses a tampered mapping naming the key.
"""

from __future__ import annotations

import builtins
import datetime
import io
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from afd_patches import AfdConfigError
from afd_patches import config as afd_config
from afd_patches.config import MAX_SECONDS, AfdConfig, LinkConfig, from_additional_config, parse, restore

TOKEN = "3f9a0c6de5b2817f4c0d9e3a6b5f1728e4d0c9b3a7f6e5d4c3b2a1908f7e6d5c"  # secrets.token_hex(32)


def _settimeout(seconds: float) -> None:
    with socket.socket() as s:
        s.settimeout(seconds)  # every link and rendezvous socket waits timeout_s


def _event_wait(seconds: float) -> None:
    threading.Event().wait(seconds)  # the FFN's idle wait, the re-forming thread's pause


def _timedelta(seconds: float) -> None:
    datetime.timedelta(seconds=seconds)  # gloo/NCCL group and store timeouts (torch_group)


def _inline_buffer(inline_bytes: int) -> None:
    import torch

    from afd_patches.connectors import wire

    torch.empty(wire.HEADER_BYTES + inline_bytes, dtype=torch.uint8)  # what every gloo receive posts


# (where in additional_config["afd"], the value, the bound the error names, a consumer it fails in or None)
CANNOT_WORK: list[tuple[tuple[str, ...], Any, str, Callable[[Any], None] | None]] = [
    (("timeout_s",), 1e10, "2592000 seconds", _settimeout),
    (("timeout_s",), 1e14, "2592000 seconds", _timedelta),
    (("connector_extra_config", "idle_timeout_s"), 1e10, "2592000 seconds", _event_wait),
    (("connector_extra_config", "idle_timeout_s"), 1e14, "2592000 seconds", _timedelta),
    (("connector_extra_config", "inline_bytes"), 10**15, "1073741824", _inline_buffer),
    # FFN rank 0 of 10**9 attention ranks lists one peer per served rank (10**9 entries) before it forms a group
    (("num_attention_ranks",), 10**9, "4096", None),
]


def _raw(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"role": "ffn"}
    if path[0] == "connector_extra_config":
        raw["connector_extra_config"] = {"backend": "gloo", path[1]: value}
    else:
        raw[path[0]] = value
    return raw


@pytest.mark.parametrize("path,value,bound,consumer", CANNOT_WORK, ids=lambda v: str(v)[:20])
def test_values_that_cannot_work_are_refused_in_parse_naming_key_and_bound(
        path: tuple[str, ...], value: Any, bound: str, consumer: Callable[[Any], None] | None) -> None:
    if consumer is not None:
        with pytest.raises((OverflowError, MemoryError, RuntimeError, ValueError)):
            consumer(value)  # where it is used, the value fails
    where = 'additional_config["afd"]' + "".join(f'["{k}"]' for k in path)
    for check in (parse, restore):
        with pytest.raises(AfdConfigError) as e:
            check(_raw(path, value))
        assert str(e.value).startswith(where + ": ") and f"maximum of {bound}" in str(e.value), e.value


def test_the_bounds_themselves_work_where_they_are_used() -> None:
    """At the bound every consumer accepts the value (a week, idle_timeout_s's default, is within it); the
    group timeout gloo/NCCL get is the larger of the two seconds values, also doubled (answer_s)."""
    _settimeout(MAX_SECONDS)
    assert threading.TIMEOUT_MAX > 2 * MAX_SECONDS
    _timedelta(2 * MAX_SECONDS)
    assert LinkConfig().idle_timeout_s < MAX_SECONDS
    from afd_patches.connectors import wire

    assert afd_config.MAX_INLINE_BYTES == wire.MAX_MESSAGE_BYTES  # no larger tensor travels at all
    cfg = parse({"role": "ffn", "timeout_s": MAX_SECONDS, "num_attention_ranks": 4096, "num_ffn_ranks": 4096,
                 "rank": 4095, "connector_extra_config": {"backend": "gloo", "idle_timeout_s": MAX_SECONDS,
                                                          "inline_bytes": afd_config.MAX_INLINE_BYTES}})
    assert cfg.timeout_s == cfg.link.idle_timeout_s == MAX_SECONDS


# ------------------------------------------------------------------ restore: no I/O, nothing trusted
@pytest.fixture
def front_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the front end stores: ``parse`` (token file read, host resolved, cores checked) then ``to_dict``."""
    monkeypatch.delenv("AFD_TOKEN", raising=False)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    cpu = min(os.sched_getaffinity(0))
    cfg = parse({"role": "attention", "host": "localhost", "port": 4000, "num_attention_ranks": 2, "rank": 1,
                 "token_file": str(token), "cpu_cores": str(cpu), "timeout_s": 5,
                 "connector_extra_config": {"backend": "tcp", "schedule": "pingpong", "data_port": 4001,
                                            "advertise": "[::1]:4002", "micro_batches": 2}})
    return cfg.to_dict()


def _no_io(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every file open, name resolution and affinity query raise (and record it)."""
    calls: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called in the restore path")
        return call

    for target, name in [(builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat"),
                         (socket, "getaddrinfo"), (socket, "gethostbyname"), (os, "sched_getaffinity")]:
        monkeypatch.setattr(target, name, refuse(f"{target.__name__}.{name}"))
    return calls


def test_restore_rebuilds_the_front_ends_config_without_io(front_end: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from afd_patches.models.causal_lm import afd_config_of
    from afd_patches.patches import data_parallel
    from afd_patches.patches.engine_config import role_of

    expected = parse(front_end)  # the front end's check accepts its own output again
    afd_config._fields.cache_clear()  # the declaration is read in the restore path too: no I/O there either
    vllm_config = SimpleNamespace(additional_config={"afd": front_end},
                                  parallel_config=SimpleNamespace(data_parallel_index=0))
    calls = _no_io(monkeypatch)
    cfg = restore(front_end)
    assert cfg == expected and from_additional_config({"afd": front_end}) == cfg
    assert role_of(vllm_config) == "attention" and afd_config_of(vllm_config) == cfg  # the engine, the model
    assert data_parallel.attention_config(vllm_config, cfg) == cfg  # the attention worker's load_model
    assert cfg.link == LinkConfig(backend="tcp", schedule="pingpong", data_port=4001, advertise=("::1", 4002),
                                  micro_batches=2)
    monkeypatch.undo()
    assert calls == []


def test_to_dict_is_json_and_complete(front_end: dict[str, Any]) -> None:
    import json

    assert json.loads(json.dumps(front_end)) == front_end
    assert front_end["connector_extra_config"] == {
        "backend": "tcp", "idle_timeout_s": 604800.0, "schedule": "pingpong", "data_port": 4001,
        "advertise": "[::1]:4002", "micro_batches": 2, "micro_batch_min_tokens": 32}
    assert restore(AfdConfig(role="ffn").to_dict()) == AfdConfig(role="ffn")


@pytest.mark.parametrize("change,where,fragment", [
    ({"afd_role": "ffn"}, "afd_role", "unknown key"),  # the front end writes canonical keys only
    ({"smuggled": 1}, "smuggled", "unknown key"),
    ({"role": "root"}, "role", "is not one of"),
    ({"port": "4000"}, "port", "is not an integer"),
    ({"port": True}, "port", "is not an integer"),
    ({"rank": 5}, "rank", "out of range for 2 attention"),
    ({"num_ffn_ranks": 3}, "num_ffn_ranks", "need A >= F"),
    ({"timeout_s": float("inf")}, "timeout_s", "not a finite number"),
    ({"timeout_s": 1e10}, "timeout_s", "maximum of 2592000 seconds"),
    ({"token_file": 7}, "token_file", "is not of type 'string'"),
    ({"connector": "evil"}, "connector", "unknown connector"),
    ({"connector_extra_config": "tcp"}, "connector_extra_config", "is not an object"),
    ({"connector_extra_config": {"bakend": "gloo"}}, 'connector_extra_config"]["bakend', "unknown key"),
    ({"connector_extra_config": {"schedule": "pingpong", "backend": "nccl"}}, 'connector_extra_config"]["schedule',
     "needs backend gloo or tcp"),
    ({"connector_extra_config": {"inline_bytes": 4096, "backend": "tcp"}}, 'connector_extra_config"]["inline_bytes',
     "needs backend gloo"),
    ({"connector_extra_config": {"advertise": "nohost"}}, 'connector_extra_config"]["advertise', "host:port"),
    ({"connector_extra_config": {"micro_batches": 3, "micro_batch_min_tokens": 2}},
     'connector_extra_config"]["micro_batch_min_tokens', "less than micro_batches (3)"),
    ({"connector_extra_config": {"idle_timeout_s": 1e10}}, 'connector_extra_config"]["idle_timeout_s',
     "maximum of 2592000 seconds"),
])
def test_restore_refuses_a_tampered_mapping_naming_the_key(front_end: dict[str, Any], change: dict[str, Any],
                                                           where: str, fragment: str) -> None:
    tampered = {**front_end, **change}
    with pytest.raises(AfdConfigError) as e:
        restore(tampered)
    assert str(e.value).startswith(f'additional_config["afd"]["{where}"]: ') and fragment in str(e.value), e.value


def test_restore_of_something_else_than_a_mapping() -> None:
    with pytest.raises(AfdConfigError, match=r'additional_config\["afd"\] must be a mapping, not list'):
        restore(["role", "ffn"])
