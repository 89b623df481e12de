"""Roles on their own cores: the ``cpu_cores`` syntax, the default placement, the front-end check, and the
wrapper of vLLM's own ``OMPProcessManager.__init__`` (the real class, given a config object with the fields it
reads; the pair test with real engines is tests/integration/test_afd_cores.py)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import pytest

from afd_patches import LOGGER, AfdConfigError
from afd_patches.config import parse, restore
from afd_patches.cores import Cpu, derive, format_core_lists, format_cores, parse_core_lists, physical_cores
from afd_patches.patches import cpu_binding


def _flat(n: int) -> list[Cpu]:
    """``n`` CPUs, each its own core, one NUMA node."""
    return [Cpu(i, i) for i in range(n)]


# ------------------------------------------------------------------ syntax
@pytest.mark.parametrize("spec,lists", [
    ("0", [[0]]), ("0-3", [[0, 1, 2, 3]]), ("0-1,8", [[0, 1, 8]]), ("0-1|2-3", [[0, 1], [2, 3]]),
    ("5,2-4", [[5, 2, 3, 4]]),
])
def test_parse_core_lists(spec: str, lists: list[list[int]]):
    assert parse_core_lists(spec) == lists


@pytest.mark.parametrize("spec,fragment", [
    ("", "is not a CPU list"), ("a", "is not a list of CPU ids"), ("0-", "is not a list"), ("0 -1", "is not a list"),
    ("3-1", "runs backwards"), ("0,0", "names a CPU twice"), ("0||1", "'' in"), ("auto", "is not a list"),
])
def test_parse_core_lists_refusals(spec: str, fragment: str):
    with pytest.raises(ValueError, match=fragment):
        parse_core_lists(spec)


def test_format_round_trips():
    assert format_cores([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_core_lists([[0, 1], [3]]) == "0-1|3"
    for spec in ("0-2,5", "0|1", "4-7|0-3"):
        assert format_core_lists(parse_core_lists(spec)) == spec


# ------------------------------------------------------------------ default placement
_SMT = [Cpu(i, i % 8, (i % 8) // 4) for i in range(16)]  # 2 sockets of 4 cores, 2-way SMT (Linux numbering:
# socket 0 cores 0-3 are CPUs 0-3 with siblings 8-11, socket 1 cores 4-7 are CPUs 4-7 with siblings 12-15)


@pytest.mark.parametrize("cpus,role,rank,a,f,workers,expected", [
    # two cores, one pair: FFN first
    (_flat(2), "ffn", 0, 1, 1, 1, [[0]]),
    (_flat(2), "attention", 0, 1, 1, 1, [[1]]),
    # fewer cores than engines: shared round robin
    (_flat(1), "ffn", 0, 1, 1, 1, [[0]]),
    (_flat(1), "attention", 0, 1, 1, 1, [[0]]),
    (_flat(2), "ffn", 0, 2, 1, 1, [[0]]),
    (_flat(2), "attention", 0, 2, 1, 1, [[1]]),
    (_flat(2), "attention", 1, 2, 1, 1, [[0]]),
    # 7 cores, 2A1F: contiguous, disjoint shares of 2, 2, 3 (extra cores to the last attention engine), each
    # keeping its last core for the engine core
    (_flat(7), "ffn", 0, 2, 1, 1, [[0]]),
    (_flat(7), "attention", 0, 2, 1, 1, [[2]]),
    (_flat(7), "attention", 1, 2, 1, 1, [[4, 5]]),
    # 8 cores, 1A1F: 4 each, one kept back
    (_flat(8), "ffn", 0, 1, 1, 1, [[0, 1, 2]]),
    (_flat(8), "attention", 0, 1, 1, 1, [[4, 5, 6]]),
    # two sockets with SMT: one role per socket, one thread per core (the last sibling), one core kept back
    (_SMT, "ffn", 0, 1, 1, 1, [[8, 9, 10]]),
    (_SMT, "attention", 0, 1, 1, 1, [[12, 13, 14]]),
    # several workers per engine: the share split between them (4 cores: 2 kept, one each)
    (_flat(8), "attention", 0, 1, 1, 2, [[4], [5]]),
    (_flat(12), "ffn", 0, 1, 1, 2, [[0, 1], [2, 3]]),
    (_flat(2), "ffn", 0, 1, 1, 2, [[0], [0]]),
])
def test_default_placement(cpus: list[Cpu], role: str, rank: int, a: int, f: int, workers: int,
                           expected: list[list[int]]):
    assert derive(cpus, role, rank, a, f, workers=workers) == expected


def test_every_engine_gets_its_own_cores_when_there_are_enough():
    for n in range(4, 40):
        for a, f in ((1, 1), (2, 1), (4, 2), (3, 3)):
            if n < a + f:
                continue
            seen: set[int] = set()
            for role, count in (("ffn", f), ("attention", a)):
                for rank in range(count):
                    cpus = {c for ids in derive(_flat(n), role, rank, a, f) for c in ids}
                    assert cpus and not cpus & seen, (n, a, f, role, rank)
                    seen |= cpus


def test_physical_cores_group_smt_siblings():
    assert physical_cores(_SMT)[:2] == [[0, 8], [1, 9]]


def test_bad_topology_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        derive(_flat(4), "attention", 1, 1, 1)
    with pytest.raises(ValueError, match="no CPUs"):
        derive([], "ffn", 0, 1, 1)


# ------------------------------------------------------------------ front end
def test_cpu_cores_is_accepted_and_kept():
    allowed = format_cores(os.sched_getaffinity(0))
    cfg = parse({"role": "ffn", "cpu_cores": allowed})
    assert cfg.cpu_cores == allowed and parse(cfg.to_dict()) == cfg
    assert "cpu_cores" not in parse({"role": "ffn"}).to_dict()


@pytest.mark.parametrize("value,fragment", [
    ("0-", "is not a list of CPU ids"), ("", "should be non-empty"), (3, "is not of type 'string'"),
    ("2-1", "runs backwards"), ("100000", "are not among the CPUs this process may run on"),
])
def test_bad_cpu_cores_names_the_key(value: Any, fragment: str):
    with pytest.raises(AfdConfigError) as err:
        parse({"role": "attention", "cpu_cores": value})
    assert 'additional_config["afd"]["cpu_cores"]' in str(err.value) and fragment in str(err.value)


# ------------------------------------------------------------------ the wrapper, on vLLM's class
def _config(afd: dict[str, Any] | None, workers: int = 1, dp: int = 1, dp_index: int = 0) -> SimpleNamespace:
    """What ``OMPProcessManager.__init__`` and the wrapper read of a ``VllmConfig``."""
    parallel = SimpleNamespace(local_world_size=workers, data_parallel_rank_local=None, _api_process_count=1,
                               data_parallel_size=dp, data_parallel_size_local=1, data_parallel_index=dp_index)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=None,
                           additional_config={"afd": restore(afd).to_dict()} if afd else {})


def _build(config: SimpleNamespace) -> Any:
    import inspect

    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager.__new__(OMPProcessManager)
    cpu_binding.omp_manager_init(inspect.unwrap(OMPProcessManager.__init__), manager, config)
    return manager


@pytest.fixture
def bind_env(monkeypatch: pytest.MonkeyPatch):
    """A clean VLLM_CPU_OMP_THREADS_BIND (unset: vLLM's auto) and the allowed CPUs as this test says."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    def allow(cpus: list[Cpu]) -> None:
        monkeypatch.setattr(cpu_binding, "_allowed_cpus", lambda: cpus)
    return allow


def test_wrapper_places_each_role_and_restores_the_env(bind_env, afd_caplog: pytest.LogCaptureFixture):
    bind_env(_flat(2))
    with afd_caplog.at_level(logging.INFO, logger=LOGGER):
        ffn = _build(_config({"role": "ffn"}))
        attention = _build(_config({"role": "attention"}))
    assert ffn.cpu_lists == [[0]] and attention.cpu_lists == [[1]]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    lines = [r.getMessage() for r in afd_caplog.records if r.name == LOGGER]
    assert lines[0].startswith("AFD: ffn rank 0 worker(s) on cores 0 (derived: 2 allowed CPU(s)"), lines
    assert lines[1].startswith("AFD: attention rank 0 worker(s) on cores 1 (derived"), lines


def test_precedence_cpu_cores_then_env_then_derived(bind_env, monkeypatch: pytest.MonkeyPatch,
                                                    afd_caplog: pytest.LogCaptureFixture):
    bind_env(_flat(2))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with afd_caplog.at_level(logging.INFO, logger=LOGGER):
        explicit = _build(_config({"role": "attention", "cpu_cores": "0"}))
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # restored
        from_env = _build(_config({"role": "attention"}))
    assert explicit.cpu_lists == [[0]] and not explicit.skip_setup
    assert from_env.skip_setup and from_env.cpu_lists == []
    lines = [r.getMessage() for r in afd_caplog.records if r.name == LOGGER]
    assert lines == ["AFD: attention rank 0 worker(s) on cores 0 (cpu_cores of the AFD config)",
                     "AFD: attention rank 0 worker(s) not bound (nobind) (VLLM_CPU_OMP_THREADS_BIND=nobind)"]


def test_non_loopback_host_keeps_vllms_auto(bind_env, monkeypatch: pytest.MonkeyPatch):
    bind_env(_flat(2))
    monkeypatch.setenv("AFD_TOKEN", "d7aa4601264fc8e9137ce38eba6b8d7a9059517eb69c0cfb2c3d4ca268e4ad39")
    config = _config({"role": "ffn", "host": "10.0.0.1"})
    afd = restore(config.additional_config["afd"])
    mask, source = cpu_binding.choose(afd, config)
    assert mask is None and "not loopback" in source


def test_wrong_list_count_names_the_key(bind_env):
    bind_env(_flat(2))
    with pytest.raises(AfdConfigError, match=r'\["cpu_cores"\]: \'0\|1\' has 2 CPU list\(s\) for 1 worker'):
        _build(_config({"role": "ffn", "cpu_cores": "0|1"}))


def test_engine_without_afd_is_vllms_own(bind_env, monkeypatch: pytest.MonkeyPatch):
    bind_env(_flat(2))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    plain = _build(_config(None))
    assert plain.cpu_lists == [[1]]  # what vLLM parsed from the variable, nothing of AFD's


def test_a_data_parallel_engine_reports_its_dp_rank(bind_env, afd_caplog: pytest.LogCaptureFixture):
    bind_env(_flat(2))
    with afd_caplog.at_level(logging.INFO, logger=LOGGER):
        _build(_config({"role": "attention", "num_attention_ranks": 2}, dp=2, dp_index=1))
    lines = [r.getMessage() for r in afd_caplog.records if r.name == LOGGER]
    assert lines[0].startswith("AFD: attention rank 1 worker(s)") and "the engine is data parallel" in lines[0], lines


def test_a_dense_dp_engine_gets_its_share_at_its_local_dp_rank(bind_env):
    """vLLM resets a dense DP engine's data_parallel_size to 1 but slices the CPU lists at its local DP rank."""
    bind_env(_flat(3))
    config = _config({"role": "attention", "num_attention_ranks": 2}, dp=1, dp_index=1)
    config.parallel_config.data_parallel_rank_local = 1
    dp1 = _build(config)
    dp0 = _build(_config({"role": "attention", "num_attention_ranks": 2}))
    assert dp0.cpu_lists == [[1]] and dp1.cpu_lists == [[2]]  # FFN core 0, attention ranks 1 and 2
