"""Who talks to whom in an rA:F AFD deployment.

Roles and role ranks
    ``A`` attention ranks (role ranks ``0..A-1``) and ``F`` FFN ranks (role
    ranks ``0..F-1``), with ``A >= F`` and ``A % F == 0``.

Block mapping
    FFN rank ``j`` serves the contiguous block of attention ranks
    ``[j * A/F, (j + 1) * A/F)``; attention rank ``i`` is served by FFN rank
    ``i // (A/F)``. Every attention rank has exactly one FFN rank, and every FFN
    rank serves exactly ``A/F`` attention ranks.

Global ranks (inside the connector's own process group)
    FFN-first ordering: FFN rank ``j`` is global rank ``j`` (``0..F-1``) and
    attention rank ``i`` is global rank ``F + i`` (``F..F+A-1``); the world size
    is ``A + F``. Global rank 0 (FFN rank 0) therefore hosts the group's TCP
    store, so the FFN role must be reachable at the configured host and port.

These are the only topology rules: ``afd_patches.config`` checks a user's config with ``validate`` and
``check_rank``. All functions are pure and raise ``TopologyError`` (a ``ValueError``) whose ``key`` is the
config key at fault and whose message names the bad value; they never touch torch or vLLM.
"""

from __future__ import annotations

ATTENTION = "attention"
FFN = "ffn"
ROLES = (ATTENTION, FFN)


class TopologyError(ValueError):
    """A topology rule broken: ``key`` is the config key at fault (``num_attention_ranks``, ``num_ffn_ranks``
    or ``rank``), the message says what is wrong without repeating it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def validate(num_attention: int, num_ffn: int) -> None:
    """Check an ``A:F`` topology; raise ``TopologyError`` explaining what is wrong."""
    for name, value in (("num_attention_ranks", num_attention), ("num_ffn_ranks", num_ffn)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TopologyError(name, f"{name} must be an int, not {type(value).__name__}")
        if value < 1:
            raise TopologyError(name, f"{name} must be >= 1, got {value}")
    if num_attention < num_ffn:
        raise TopologyError("num_ffn_ranks", f"{num_ffn} FFN ranks for {num_attention} attention ranks: need A >= F "
                            "(num_attention_ranks >= num_ffn_ranks)")
    if num_attention % num_ffn:
        raise TopologyError("num_attention_ranks", f"{num_attention} is not a multiple of num_ffn_ranks={num_ffn}: "
                            "every FFN rank must serve the same number of attention ranks")


def check_rank(rank: int, count: int, role: str) -> None:
    """``rank`` must be a role rank of ``role``, which has ``count`` of them."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TopologyError("rank", f"{role} rank must be an int, not {type(rank).__name__}")
    if not 0 <= rank < count:
        raise TopologyError("rank", f"{role} rank {rank} is out of range for {count} {role} rank(s)")


def ranks_per_ffn(num_attention: int, num_ffn: int) -> int:
    """``A/F``: how many attention ranks each FFN rank serves."""
    validate(num_attention, num_ffn)
    return num_attention // num_ffn


def ffn_rank_of(attn_rank: int, num_attention: int, num_ffn: int) -> int:
    """The FFN role rank that serves attention role rank ``attn_rank``."""
    per = ranks_per_ffn(num_attention, num_ffn)
    check_rank(attn_rank, num_attention, ATTENTION)
    return attn_rank // per


def attention_ranks_of(ffn_rank: int, num_attention: int, num_ffn: int) -> list[int]:
    """The attention role ranks served by FFN role rank ``ffn_rank``, ascending."""
    per = ranks_per_ffn(num_attention, num_ffn)
    check_rank(ffn_rank, num_ffn, FFN)
    return list(range(ffn_rank * per, (ffn_rank + 1) * per))


def world_size(num_attention: int, num_ffn: int) -> int:
    """Size of the connector's process group: ``A + F``."""
    validate(num_attention, num_ffn)
    return num_attention + num_ffn


def global_rank(role: str, rank: int, num_attention: int, num_ffn: int) -> int:
    """Global rank of a role rank in the connector's group (FFN-first ordering)."""
    validate(num_attention, num_ffn)
    if role == FFN:
        check_rank(rank, num_ffn, FFN)
        return rank
    if role == ATTENTION:
        check_rank(rank, num_attention, ATTENTION)
        return num_ffn + rank
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def role_of_global(global_rank_: int, num_attention: int, num_ffn: int) -> tuple[str, int]:
    """Inverse of ``global_rank``: ``(role, role rank)`` of a global rank."""
    validate(num_attention, num_ffn)
    check_rank(global_rank_, num_attention + num_ffn, "global")
    if global_rank_ < num_ffn:
        return FFN, global_rank_
    return ATTENTION, global_rank_ - num_ffn
