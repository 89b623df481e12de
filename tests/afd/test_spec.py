"""``GroupSpec``: built once from the config, pure; every bound derived from ``timeout_s`` in one place. Formation
reads the token and the host at each attempt (``formation._token``, ``formation._address``)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from pathlib import Path
from typing import Any

import pytest

from afd_patches import AfdConfigError
from afd_patches.config import AfdConfig
from afd_patches.connectors import auth, formation
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.spec import GroupSpec, SpecError, beat_for
from afd_patches.connectors.torch_dist import TorchDistConnector


def _cfg(**kw: Any) -> AfdConfig:
    extra = kw.pop("extra", {"backend": "tcp"})
    return AfdConfig(**{"role": "ffn", "num_attention_ranks": 4, "num_ffn_ranks": 2, "timeout_s": 8.0,
                        "connector_extra_config": extra, **kw})


def test_the_spec_places_the_rank_and_derives_every_bound() -> None:
    spec = GroupSpec.of(_cfg(rank=1))
    assert (spec.global_rank, spec.world_size, spec.peers) == (1, 6, (4, 5))
    assert (spec.backend, str(spec.device), spec.schedule, spec.inline_bytes) == ("tcp", "cpu", "batched", 0)
    assert (spec.answer_s, spec.alive_s, spec.beat_s, spec.close_wait_s) == (16.0, 8.0, 1.0, 2.0)
    assert not spec.takes_back  # only FFN rank 0 hosts re-joins
    assert GroupSpec.of(_cfg()).takes_back
    pingpong = GroupSpec.of(_cfg(role="attention", extra={"backend": "gloo", "schedule": "pingpong"}))
    assert (pingpong.peers, pingpong.answer_s, pingpong.inline_bytes) == ((0,), 8.0, 64 * 1024)
    assert beat_for(0.1) == 0.05 and beat_for(2.0) == 0.5 and beat_for(60.0) == 1.0
    assert dataclasses.is_dataclass(spec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.timeout_s = 1.0  # type: ignore[misc]
    with pytest.raises(AfdConfigError, match="micro_batches"):  # the link is typed and checked with the config
        _cfg(extra={"micro_batches": 9})
    with pytest.raises(SpecError, match="multiple"):  # a config built directly is placed by the spec
        GroupSpec.of(_cfg(num_attention_ranks=3))


def test_the_connector_constructor_reads_no_token_and_resolves_no_name(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """A missing token file and a name that does not resolve fail the formation attempt, not the constructor."""
    def no_dns(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("resolved a name")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    cfg = AfdConfig(role="ffn", host="afd-nowhere.test", token_file=str(tmp_path / "missing"))
    conn = TorchDistConnector(cfg)
    with pytest.raises(ConnectorError, match="missing"):
        conn.init(0.5)


def test_each_attempt_sees_a_rotated_or_opened_token_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    path = tmp_path / "token"
    first, second = secrets.token_hex(32), secrets.token_hex(32)
    path.write_text(first)
    path.chmod(0o600)
    assert formation._token(str(path)) == first.encode()
    assert formation._token(str(path)) == first.encode()  # unchanged: the judged token
    tmp = tmp_path / "token.new"
    tmp.write_text(second)
    tmp.chmod(0o600)
    os.replace(tmp, path)  # a rotation
    assert formation._token(str(path)) == second.encode()
    path.chmod(0o644)  # mid-rotation, say
    with pytest.raises(auth.TokenError, match="chmod 600"):
        formation._token(str(path))
    path.chmod(0o600)
    os.symlink(path, tmp_path / "link")
    with pytest.raises(auth.TokenError, match="symbolic link"):
        formation._token(str(tmp_path / "link"))
    monkeypatch.setenv(auth.TOKEN_ENV, first)
    with pytest.raises(auth.TokenError, match="use one"):
        formation._token(str(path))
    assert formation._token(None) == first.encode()
    monkeypatch.setenv(auth.TOKEN_ENV, "short")
    with pytest.raises(auth.TokenError, match="fewer than"):
        formation._token(None)


def test_each_attempt_resolves_the_name_again(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter(["127.0.0.1", "127.0.0.3"])
    real = socket.getaddrinfo

    def moving(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "afd-moving.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", moving)
    assert [formation._address("afd-moving.test") for _ in range(2)] == ["127.0.0.1", "127.0.0.3"]
    assert formation._address("::1") == "::1" and formation._address("127.0.0.2") == "127.0.0.2"
