"""``GroupSpec``: what one rank of an AFD group is, fixed once from its config; every bound derived in one place.

``GroupSpec.of(cfg, identity)`` is pure: it reads the typed link settings (``cfg.link``, checked when the config
was parsed or restored), places the rank in the topology, decides what backend ``auto`` means (``decide_backend``,
the one place that asks torch about CUDA) and derives every timeout's dependants. It reads no file and resolves
no name: the token source (``token_file`` or the ``AFD_TOKEN`` variable) and the host *name* are kept, and
formation reads them at each attempt (``formation.form``), so a rotated token or a changed DNS answer is seen by
the next group.

Derived bounds (all from ``timeout_s`` unless named)
    ``answer_s``: an attention rank's wait for its answer; ``2 * timeout_s`` under ``batched`` with several
    attention ranks per FFN rank (the FFN may first wait ``timeout_s`` for the others), else ``timeout_s``.
    ``alive_s``: tcp's silence bound (nothing, not even a keep-alive, for that long: the peer is frozen or gone).
    ``beat_s``: tcp's keep-alive interval and gloo/NCCL's heartbeat interval, ``timeout_s / 4`` clamped to
    [``MIN_BEAT_S``, ``MAX_BEAT_S``]. ``idle_timeout_s``: an FFN rank's wait for the next step of an idle group
    (and a formation's wait for its peers). ``group_timeout_s(remaining)``: the torch group's own timeout.
    ``close_wait_s``: how long ``close()`` waits for each peer to take its ``CLOSE``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from afd_patches import topology
from afd_patches.config import DEFAULT_INLINE_BYTES, HOST_BACKENDS
from afd_patches.connectors import auth, wire

if TYPE_CHECKING:
    from afd_patches.config import AfdConfig

MIN_BEAT_S = 0.05
MAX_BEAT_S = 1.0
CLOSE_WAIT_S = 2.0  # how long close() waits for each peer to take its CLOSE header


class SpecError(ValueError):
    """The config cannot make a group spec (topology, connector options); the message says which value."""


def decide_backend(requested: str | None) -> str:
    """The backend a rank uses: the one configured, else ``nccl`` where CUDA is available, else ``tcp``."""
    return requested or ("nccl" if torch.cuda.is_available() else "tcp")


def beat_for(timeout_s: float) -> float:
    """Seconds between keep-alives (tcp) or heartbeats (gloo/NCCL) for peers lost after ``timeout_s`` of silence."""
    return min(max(timeout_s / 4, MIN_BEAT_S), MAX_BEAT_S)


@dataclass(frozen=True)
class GroupSpec:
    """One rank's place and bounds in its AFD group (see the module docstring)."""

    role: str
    rank: int
    num_attention_ranks: int
    num_ffn_ranks: int
    global_rank: int
    world_size: int
    peers: tuple[int, ...]  # global ranks this rank exchanges with: its FFN rank, or the attention ranks it serves
    backend: str
    device: torch.device
    schedule: str
    host: str  # the configured name, resolved at each formation attempt
    port: int
    data_port: int
    advertise: tuple[str, int] | None
    micro_batches: int
    inline_bytes: int
    token_file: str | None  # else the token comes from ``auth.TOKEN_ENV``; read at each formation attempt
    allow_unauthenticated: bool
    timeout_s: float
    idle_timeout_s: float
    answer_s: float
    alive_s: float
    beat_s: float
    close_wait_s: float
    limits: Any  # ``wire.Limits`` of the headers this rank accepts

    @classmethod
    def of(cls, cfg: AfdConfig, identity: Mapping[str, Any] | None = None) -> GroupSpec:
        """The spec of ``cfg``'s rank (``identity``: the model's, bounds the headers); ``SpecError`` naming the
        value that cannot work. Pure: no file read, no name resolved."""
        a, f = cfg.num_attention_ranks, cfg.num_ffn_ranks
        opts = cfg.link
        try:
            topology.validate(a, f)
            global_rank = topology.global_rank(cfg.role, cfg.rank, a, f)
        except ValueError as e:
            raise SpecError(str(e)) from e
        if cfg.role == topology.ATTENTION:
            peers = (topology.global_rank(topology.FFN, topology.ffn_rank_of(cfg.rank, a, f), a, f),)
        else:
            peers = tuple(topology.global_rank(topology.ATTENTION, i, a, f)
                          for i in topology.attention_ranks_of(cfg.rank, a, f))
        backend = decide_backend(opts.backend)
        if opts.device:
            device = torch.device(opts.device)
        elif backend in HOST_BACKENDS:
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        inline = opts.inline_bytes if opts.inline_bytes is not None else (
            DEFAULT_INLINE_BYTES if backend == "gloo" else 0)
        timeout_s = float(cfg.timeout_s)
        ident = dict(identity or {})
        exchanges = ident.get("exchanges_per_step") or ident.get("num_hidden_layers")  # a header's layer bound
        limits = wire.Limits(exchanges, ident.get("hidden_size"), ident.get("dtype"),
                             ident.get("max_num_batched_tokens"), opts.micro_batches, inline)
        return cls(
            role=cfg.role, rank=cfg.rank, num_attention_ranks=a, num_ffn_ranks=f, global_rank=global_rank,
            world_size=a + f, peers=peers, backend=backend, device=device, schedule=opts.schedule, host=cfg.host,
            port=cfg.port, data_port=opts.data_port, advertise=opts.advertise, micro_batches=opts.micro_batches,
            inline_bytes=inline, token_file=cfg.token_file, allow_unauthenticated=cfg.allow_unauthenticated,
            timeout_s=timeout_s, idle_timeout_s=opts.idle_timeout_s,
            answer_s=timeout_s * (2 if opts.schedule == "batched" and a > f else 1),
            alive_s=timeout_s, beat_s=beat_for(timeout_s), close_wait_s=min(timeout_s, CLOSE_WAIT_S), limits=limits)

    # ---------------------------------------------------------------- derived
    @property
    def address(self) -> str:
        """The group's rendezvous as configured (``host:port``), for messages."""
        return f"{self.host}:{self.port}"

    @property
    def token_source(self) -> str:
        """Where the token is read from at each formation attempt."""
        return f"token_file {self.token_file!r}" if self.token_file else f"the environment variable {auth.TOKEN_ENV}"

    @property
    def takes_back(self) -> bool:
        """Whether this rank takes dropped attention ranks back into the live group (``rendezvous.Rejoins``): FFN
        rank 0 of a tcp group serving several attention ranks."""
        return self.global_rank == 0 and self.backend == "tcp" and len(self.peers) > 1

    def group_timeout_s(self, remaining_s: float) -> float:
        """The torch group's own timeout, ``remaining_s`` being what is left of the formation's bound: NCCL's
        watchdog would abort an idle FFN rank otherwise, so there it is at least ``idle_timeout_s``."""
        return remaining_s if self.backend == "gloo" else max(self.idle_timeout_s, self.timeout_s, remaining_s)

    def describe(self, peer: int) -> str:
        """``peer`` (a global rank) for messages: role, rank, global rank and the group's address."""
        role, rank = topology.role_of_global(peer, self.num_attention_ranks, self.num_ffn_ranks)
        return f"{role} rank {rank} (global rank {peer} of {self.world_size}, group at {self.address})"

    def me(self) -> str:
        return f"{self.role} rank {self.rank} (global rank {self.global_rank})"
