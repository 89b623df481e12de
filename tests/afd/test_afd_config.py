"""additional_config["afd"] parsing: every mistake names its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from afd_patches.config import AfdConfig, AfdConfigError, from_additional_config, parse
from afd_patches.patches.engine_config import role_of


def test_aliases_are_normalized_and_defaults_filled(monkeypatch: pytest.MonkeyPatch):
    # 10.0.0.1 is not loopback: a token is required
    monkeypatch.setenv("AFD_TOKEN", "d7aa4601264fc8e9137ce38eba6b8d7a9059517eb69c0cfb2c3d4ca268e4ad39")
    cfg = parse({"afd_role": "attention", "afd_host": "10.0.0.1", "afd_port": 4000, "num_attention_ranks": 2,
                 "rank": 1})
    assert cfg == AfdConfig(role="attention", host="10.0.0.1", port=4000, num_attention_ranks=2, rank=1)
    assert cfg.connector == "torch_dist" and cfg.num_ffn_ranks == 1


@pytest.mark.parametrize("raw,key,fragment", [
    ({"role": "ffn", "colour": "red"}, "colour", "unknown key"),
    ({"role": "ffn", "afd_role": "ffn"}, "afd_role", "together with its canonical key 'role'"),
    ({"port": 1}, "role", "is required"),
    ({"role": "both"}, "role", "is not one of"),
    ({"role": "ffn", "port": 0}, "port", "less than the minimum"),
    ({"role": "ffn", "port": 70000}, "port", "greater than the maximum"),
    ({"role": "ffn", "port": 1.0}, "port", "is not an integer"),
    ({"role": "ffn", "timeout_s": float("nan")}, "timeout_s", "not a finite number"),
    ({"role": "ffn", "timeout_s": 0}, "timeout_s", "less than or equal to the minimum"),
    ({"role": "ffn", "num_attention_ranks": 1, "num_ffn_ranks": 2}, "num_ffn_ranks", "need A >= F"),
    ({"role": "ffn", "num_attention_ranks": 3, "num_ffn_ranks": 2}, "num_attention_ranks", "not a multiple"),
    ({"role": "attention", "num_attention_ranks": 2, "rank": 2}, "rank", "out of range for 2 attention"),
    ({"role": "ffn", "connector": "pigeon"}, "connector", "unknown connector 'pigeon'"),
])
def test_bad_configs_name_the_key(raw, key, fragment):
    with pytest.raises(AfdConfigError) as err:
        parse(raw)
    assert f'additional_config["afd"]["{key}"]' in str(err.value)
    assert fragment in str(err.value)


def test_off_unless_present():
    assert from_additional_config(None) is None and from_additional_config({"other": 1}) is None

    from types import SimpleNamespace

    assert role_of(SimpleNamespace(additional_config={"afd": {"role": "ffn"}})) == "ffn"
    assert role_of(SimpleNamespace(additional_config={"other": 1})) is None
    with pytest.raises(AfdConfigError, match="must be a mapping"):
        parse(["role", "ffn"])


class _Args:
    """The two attributes of vLLM's EngineArgs that ``validate_afd_config`` reads and writes."""

    def __init__(self, additional_config: dict[str, Any]) -> None:
        self.additional_config = additional_config
        self.enable_prefix_caching = True


def test_afd_is_refused_with_the_supported_releases_on_an_unsupported_vllm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a vLLM no pinned manifest fits, the fallback plan is active and AFD fails naming the releases."""
    import afd_patches
    import patchkit
    from afd_patches.patches.engine_config import AfdUnavailable, validate_afd_config
    from patchkit.plan import Runtime

    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    patchkit.revert("afd")
    with pytest.raises(AfdUnavailable, match="did not run in this process"):
        validate_afd_config(lambda args: "config", _Args({"afd": {"role": "ffn"}}))
    try:
        status = patchkit.activate("afd", afd_patches.manifest_dir(), Runtime("0.99.0", None, _platform="cpu"))
        assert status.active and status.fallback and status.vllm_version == "0.99.0"
        with pytest.raises(AfdUnavailable, match=r"vLLM 0\.99\.0 is not supported .*vllm==0\.30\.0.*vllm==0\.32\.0"):
            validate_afd_config(lambda args: "config", _Args({"afd": {"role": "ffn"}}))
        assert validate_afd_config(lambda args: "config", _Args({"other": 1})) == "config"  # plain runs go on
    finally:
        patchkit.revert("afd")


def test_the_modules_every_process_imports_leave_the_config_machinery_unloaded():
    """The hook's modules (and ``role_of`` with AFD off) do not import ``afd_patches.config``."""
    import subprocess
    import sys

    code = (
        "import sys; from types import SimpleNamespace\n"
        "import afd_patches, afd_patches.patches.cli_flags as f, afd_patches.patches.engine_config as e\n"
        "assert e.role_of(SimpleNamespace(additional_config={'x': 1})) is None\n"
        "print('afd_patches.config' in sys.modules, 'jsonschema' in sys.modules)\n"
        "print(f.flags()[1].help, 'afd_patches.config' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    unloaded, built = out.stdout.splitlines()
    assert unloaded == "False False"
    assert built.endswith("(default: torch_dist). True"), built


# ------------------------------------------------------------------ rendezvous token
TOKEN = "8e134ea4ff71efb1213da1930f9f124c4df96c897d6d56f44691f218a1a45cbf"  # secrets.token_hex(32)


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AFD_TOKEN", raising=False)


@pytest.mark.parametrize("host", ["10.0.0.1", "0.0.0.0", "::", "192.168.1.5"])
def test_non_loopback_host_without_token_fails_naming_how_to_set_one(host: str, no_token: None) -> None:
    with pytest.raises(AfdConfigError) as e:
        parse({"role": "ffn", "host": host})
    text = str(e.value)
    assert text.startswith('additional_config["afd"]["host"]') and "AFD_TOKEN" in text and "token_file" in text
    assert "allow_unauthenticated" in text
    assert parse({"role": "ffn", "host": host, "allow_unauthenticated": True}).allow_unauthenticated


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_host_needs_no_token(host: str, no_token: None) -> None:
    assert parse({"role": "ffn", "host": host}).host == host


def test_token_from_env_or_private_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from afd_patches.connectors.auth import load_token

    monkeypatch.setenv("AFD_TOKEN", TOKEN + "\n")
    assert load_token(None) == TOKEN.encode()
    assert parse({"role": "ffn", "host": "10.0.0.1"}).token_file is None
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    with pytest.raises(AfdConfigError, match="both AFD_TOKEN and token_file"):
        parse({"role": "ffn", "host": "10.0.0.1", "token_file": str(path)})
    monkeypatch.delenv("AFD_TOKEN")
    assert load_token(str(path)) == TOKEN.encode()
    assert parse({"role": "ffn", "host": "10.0.0.1", "token_file": str(path)}).token_file == str(path)


def _token_file(text: str, mode: int) -> Any:
    def make(tmp_path: Path) -> Path:
        path = tmp_path / "token"
        path.write_text(text)
        path.chmod(mode)
        return path

    return make


def _symlink_to_a_good_one(tmp_path: Path) -> Path:
    link = tmp_path / "link"
    link.symlink_to(_token_file(TOKEN, 0o600)(tmp_path))
    return link


def _fifo(tmp_path: Path) -> Path:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    return fifo


@pytest.mark.parametrize("make,fragment", [
    (_token_file(TOKEN, 0o644), "chmod 600"),
    (_symlink_to_a_good_one, "symbolic link"),
    (_fifo, "not a regular file"),  # and it did not block waiting for a writer
    (_token_file("abc", 0o600), "fewer than 128"),
    (lambda tmp_path: tmp_path / "missing", "cannot open"),
    (_token_file("x" * 5000, 0o600), "more than 4096"),
], ids=["loose", "symlink", "fifo", "short", "missing", "big"])
def test_token_file_refusals(tmp_path: Path, no_token: None, make: Any, fragment: str) -> None:
    path = str(make(tmp_path))
    with pytest.raises(AfdConfigError) as e:
        parse({"role": "ffn", "host": "10.0.0.1", "token_file": path})
    assert str(e.value).startswith('additional_config["afd"]["token_file"]') and fragment in str(e.value), e.value


def test_to_dict_parses_again(tmp_path, no_token: None) -> None:
    """The front end stores the normalized config and parses it again in later processes."""
    assert parse(parse({"role": "ffn"}).to_dict()) == parse({"role": "ffn"})
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    cfg = parse({"role": "ffn", "host": "10.0.0.1", "token_file": str(path)})
    assert parse(cfg.to_dict()) == cfg


def test_schedule_defaults_to_batched_and_accepts_pingpong():
    assert parse({"role": "ffn"}).link.schedule == "batched"
    cfg = parse({"role": "ffn", "connector_extra_config": {"schedule": "pingpong", "inline_bytes": 0}})
    assert cfg.link.schedule == "pingpong" and cfg.link.inline_bytes == 0


@pytest.mark.parametrize("value", ["lockstep", "", 1, None])
def test_bad_schedule_names_the_nested_key(value):
    with pytest.raises(AfdConfigError) as err:
        parse({"role": "ffn", "connector_extra_config": {"schedule": value}})
    assert 'additional_config["afd"]["connector_extra_config"]["schedule"]' in str(err.value)
    assert "batched" in str(err.value) and "pingpong" in str(err.value)


def test_micro_batches_default_to_one_and_take_two_to_four():
    from afd_patches.config import DEFAULT_MICRO_BATCH_MIN_TOKENS

    assert parse({"role": "attention"}).link.micro_batches == 1
    opts = parse({"role": "attention", "connector_extra_config": {"micro_batches": 4}}).link
    assert opts.micro_batches == 4 and opts.micro_batch_min_tokens == max(4, DEFAULT_MICRO_BATCH_MIN_TOKENS)


@pytest.mark.parametrize("extra,key", [
    ({"micro_batches": 0}, "micro_batches"), ({"micro_batches": 5}, "micro_batches"),
    ({"micro_batches": True}, "micro_batches"), ({"micro_batches": "2"}, "micro_batches"),
    ({"micro_batches": 3, "micro_batch_min_tokens": 2}, "micro_batch_min_tokens"),
    ({"micro_batches": 2, "backend": "nccl"}, "micro_batches")])
def test_bad_micro_batch_settings_fail_in_the_front_end_naming_the_key(extra, key):
    with pytest.raises(AfdConfigError) as err:
        parse({"role": "attention", "connector_extra_config": extra})
    assert key in str(err.value)
