"""AFD attention ranks as vLLM data-parallel engines (``--data-parallel-size N --afd-role attention``).

One API server starts N engine cores (vLLM's coordinator balances requests over them); each engine
is attention rank ``i`` of an ``N A : F`` group, ``i`` being vLLM's data-parallel rank of that engine.
The FFN role is started as usual (``--afd-num-attention-ranks N``), not under data parallelism.

Front end (``check_front_end``, called by ``validate_afd_config`` with the raw
``additional_config["afd"]``, before it is normalized):

- ``num_attention_ranks`` absent → the data-parallel size; present and different → ``AfdConfigError``
  naming both.
- ``rank`` absent → each engine takes its data-parallel rank; present → it must be the data-parallel
  rank of every engine this process starts (so only with ``--data-parallel-rank N``, external load
  balancing, one engine per server); otherwise ``AfdConfigError`` naming both ranks.
- The FFN role under ``--data-parallel-size > 1`` is refused (its ranks are separate servers).

Engine (``attention_config``, the attention worker): the AFD rank is ``parallel_config.data_parallel_index``,
which vLLM sets to the engine's data-parallel rank in every engine process (dense models too, where
``data_parallel_rank`` is reset to 0 because their DP engines are independent) and which is 0 outside
data parallelism; a non-zero index replaces the config's rank (which the front end checked agrees).

Lockstep (``vllm_keeps_lockstep``): vLLM 0.32 couples DP engines only for MoE models
(``DPEngineCoreProc``: a rank without work runs ``execute_dummy_batch`` — a real model forward of one
token, so every layer exchanges with the FFN role — while any rank has work). Dense models' DP engines
are independent (``reconfigure_for_independent_dp_rank`` resets the worker's ``data_parallel_size`` to 1),
so their attention workers keep AFD's own idle steps (``schedule: batched``) or use ``pingpong``.

Limits: pipeline parallelism stays unsupported; tensor parallelism inside an attention DP engine is not
handled here (one connector per engine).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from afd_patches import AfdConfigError
from afd_patches.config import AfdConfig


def started_dp_ranks(engine_args: Any) -> list[int]:
    """The data-parallel ranks of the engines this process starts (``[0]`` without data parallelism).

    ``--data-parallel-rank N`` (external load balancing): ``[N]``; otherwise
    ``--data-parallel-start-rank`` (default 0) and the ``--data-parallel-size-local`` engines after it
    (default: all of ``--data-parallel-size``)."""
    size = int(getattr(engine_args, "data_parallel_size", 1) or 1)
    rank = getattr(engine_args, "data_parallel_rank", None)
    if rank is not None:
        return [int(rank)]
    start = int(getattr(engine_args, "data_parallel_start_rank", None) or 0)
    local = getattr(engine_args, "data_parallel_size_local", None)
    return list(range(start, start + int(size if local is None else local)))


def check_front_end(engine_args: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (``additional_config["afd"]`` as given) completed for data parallelism; raises
    ``AfdConfigError`` naming both values when a flag disagrees with vLLM's data-parallel settings.
    Without data parallelism ``raw`` is returned unchanged."""
    size = int(getattr(engine_args, "data_parallel_size", 1) or 1)
    if size <= 1 or not isinstance(raw, dict):
        return raw
    role = raw.get("role", raw.get("afd_role"))
    if role == "ffn":
        raise AfdConfigError(
            f"--afd-role ffn with --data-parallel-size {size}: the FFN role does not run as vLLM data-parallel "
            "engines; start one FFN server per FFN rank (--afd-num-ffn-ranks, --afd-rank)")
    if role != "attention":
        return raw
    micro = (raw.get("connector_extra_config") or {}).get("micro_batches", 1)
    if micro != 1:
        raise AfdConfigError(
            f'additional_config["afd"]["connector_extra_config"]["micro_batches"] {micro!r} with '
            f"--data-parallel-size {size}: AFD micro-batches do not run under vLLM data parallelism yet (vLLM "
            "coordinates the split across its DP ranks, dummy batches included); use micro_batches 1 there")
    out = dict(raw)
    given_a = raw.get("num_attention_ranks")
    if given_a is None:
        out["num_attention_ranks"] = size
    elif given_a != size:
        raise AfdConfigError(
            f'--afd-num-attention-ranks (additional_config["afd"]["num_attention_ranks"]) {given_a!r} disagrees '
            f"with --data-parallel-size {size}: under data parallelism every DP engine is one attention rank")
    if "rank" in raw:
        for dp_rank in started_dp_ranks(engine_args):
            if raw["rank"] != dp_rank:
                raise AfdConfigError(
                    f'--afd-rank (additional_config["afd"]["rank"]) {raw["rank"]!r} disagrees with vLLM\'s '
                    f"data-parallel rank {dp_rank} of an engine this server starts (--data-parallel-size {size}); "
                    "leave --afd-rank out: each engine's AFD attention rank is its data-parallel rank")
    return out


def dp_rank_of(vllm_config: Any) -> int:
    """This engine's data-parallel rank (``parallel_config.data_parallel_index``; 0 without DP)."""
    return int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)


def attention_config(vllm_config: Any, cfg: AfdConfig) -> AfdConfig:
    """``cfg`` with the rank of this attention engine: its data-parallel rank under DP, else ``cfg.rank``.

    Raises ``AfdConfigError`` naming both when the config names another non-zero rank (the front end
    normally refuses that first)."""
    dp_rank = dp_rank_of(vllm_config)
    if dp_rank == 0 or dp_rank == cfg.rank:
        return cfg
    if cfg.rank != 0:
        raise AfdConfigError(
            f'additional_config["afd"]["rank"] {cfg.rank} disagrees with vLLM\'s data-parallel rank {dp_rank} '
            "of this engine; leave --afd-rank out under data parallelism")
    if dp_rank >= cfg.num_attention_ranks:
        raise AfdConfigError(f"vLLM data-parallel rank {dp_rank} is out of range for "
                             f"{cfg.num_attention_ranks} attention rank(s) (--afd-num-attention-ranks)")
    return dataclasses.replace(cfg, rank=dp_rank)


def vllm_keeps_lockstep(vllm_config: Any) -> bool:
    """Whether vLLM steps this engine with its DP peers (dummy batches while idle): only engines of a
    coupled DP group (MoE models) keep ``data_parallel_size > 1`` in the worker."""
    return int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1) > 1
