"""The AFD message header: its words, its encoding, and the checks a receiver makes before it allocates.

Every message between the roles starts with ``HEADER_LEN`` signed 64-bit words in native byte order
(both roles run the same build on the same kind of host): ``MAGIC``, ``kind``, ``layer``, ``step``,
``microbatch``, dtype code, ``ndim``, inline flag, then ``MAX_NDIM`` shape words. ``kind`` is
``KIND_DATA`` (a tensor follows, unless it has no elements), ``KIND_CLOSE`` (the sender leaves the group
on purpose), ``KIND_PING`` (the sender is alive; ``tcp`` only, see ``afd_patches.connectors.tcp``) or
``KIND_DROP`` (FFN to attention: this rank was dropped from the batched step it missed; ``layer``, ``step``
and ``microbatch`` name that step in the rank's own numbering; see ``afd_patches.connectors.schedule``).

``Limits.check`` is the one place a received header is judged: every field is checked against what this
side knows (layer count, micro-batch count, hidden size, dtype, token bound, byte bound) before a byte of
payload is allocated, and a violation raises ``BadMessage`` naming each problem. A field added later gets
its check here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

from afd_patches.connectors.base import ConnectorError

MAGIC = 0xAFD0_0003  # the last digit is the wire version
MAX_NDIM = 8
HEADER_LEN = 8 + MAX_NDIM
HEADER_BYTES = HEADER_LEN * 8
HEADER = struct.Struct(f"={HEADER_LEN}q")
KIND_DATA, KIND_CLOSE, KIND_PING, KIND_DROP = 1, 2, 3, 4
MAX_MESSAGE_BYTES = 1 << 30  # bound on one tensor when the model's identity gives no tighter one

# Stable wire codes; a dtype missing from this torch build is simply not offered.
DTYPE_CODES: dict[str, int] = {
    "float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "int8": 5, "uint8": 6, "int16": 7, "int32": 8,
    "int64": 9, "bool": 10, "float8_e4m3fn": 11, "float8_e5m2": 12, "float8_e4m3fnuz": 13, "float8_e5m2fnuz": 14,
}
_CODE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
ITEMSIZE = {name: getattr(torch, name).itemsize for name in DTYPE_CODES if hasattr(torch, name)}


class BadMessage(ConnectorError):
    """A header that is malformed or outside what this side accepts; nothing was allocated for it."""


class Header(NamedTuple):
    kind: int
    layer: int
    step: int
    microbatch: int
    shape: tuple[int, ...]
    dtype: str
    inline: bool


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (the form used in ``Meta.dtype``)."""
    return str(dtype).removeprefix("torch.")


def words(kind: int, layer: int = -1, step: int = -1, tensor: torch.Tensor | None = None, inline: bool = False,
          microbatch: int = 0) -> list[int]:
    """The ``HEADER_LEN`` words describing ``tensor`` (or a bare ``CLOSE``/``PING``/``DROP`` header)."""
    out = [MAGIC, kind, layer, step, microbatch, 0, 0, int(inline)] + [0] * MAX_NDIM
    if tensor is not None:
        name = dtype_name(tensor.dtype)
        if name not in DTYPE_CODES:
            raise ConnectorError(f"dtype {name} cannot be sent (supported: {', '.join(DTYPE_CODES)})")
        if tensor.dim() > MAX_NDIM:
            raise ConnectorError(f"tensor has {tensor.dim()} dimensions; at most {MAX_NDIM} can be sent")
        out[5], out[6] = DTYPE_CODES[name], tensor.dim()
        out[8 : 8 + tensor.dim()] = list(tensor.shape)
    return out


def pack(kind: int, layer: int = -1, step: int = -1, tensor: torch.Tensor | None = None, microbatch: int = 0) -> bytes:
    """The header as bytes (no inline payload: the form ``tcp`` sends)."""
    return HEADER.pack(*words(kind, layer, step, tensor, microbatch=microbatch))


def encode(header_words: list[int], device: torch.device) -> torch.Tensor:
    """The header ``header_words`` (``words``) as an ``int64`` tensor on ``device`` (the form gloo and NCCL
    send)."""
    return torch.tensor(header_words, dtype=torch.int64, device=device)


def decode(message: torch.Tensor | bytes | bytearray | memoryview) -> Header:
    """Parse a header (bytes, or the start of a ``uint8``/``int64`` tensor); ``BadMessage`` on garbage."""
    if isinstance(message, torch.Tensor):
        if message.dtype == torch.uint8:
            message = message[:HEADER_BYTES].view(torch.int64)
        w = message.tolist()
    else:
        w = list(HEADER.unpack_from(message))
    if len(w) != HEADER_LEN or w[0] != MAGIC or w[1] not in (KIND_DATA, KIND_CLOSE, KIND_PING, KIND_DROP):
        raise BadMessage(f"malformed AFD header {w[:8]}… (the peer speaks another protocol or version)")
    kind, layer, step, microbatch, code, ndim, inline = w[1:8]
    if kind != KIND_DATA:
        return Header(kind, layer, step, microbatch, (), "", False)
    if code not in _CODE_NAMES or not 0 <= ndim <= MAX_NDIM:
        raise BadMessage(f"malformed AFD header: dtype code {code}, ndim {ndim}")
    return Header(kind, layer, step, microbatch, tuple(w[8 : 8 + ndim]), _CODE_NAMES[code], bool(inline))


@dataclass(frozen=True)
class Limits:
    """What this side accepts in a ``KIND_DATA`` header; ``None``/0 means "not known, not checked"
    (the byte bound always applies)."""

    num_layers: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    max_tokens: int | None = None
    micro_batches: int = 1
    inline_bytes: int = 0

    def check(self, header: Header) -> int:
        """The payload's size in bytes, or ``BadMessage`` naming every problem of ``header``."""
        shape = header.shape
        if (len(shape) == 2 and shape[1] == self.hidden_size and header.dtype == self.dtype and not header.inline
                and self.max_tokens is not None and 0 <= shape[0] <= self.max_tokens and header.step >= 0
                and self.num_layers is not None and 0 <= header.layer < self.num_layers
                and 0 <= header.microbatch < self.micro_batches):
            return shape[0] * shape[1] * ITEMSIZE[header.dtype]  # the usual header, judged in a few comparisons
        return self._judge(header)

    def _judge(self, header: Header) -> int:
        problems = []
        if self.num_layers is not None and not 0 <= header.layer < self.num_layers:
            problems.append(f"layer {header.layer} outside 0..{self.num_layers - 1}")
        elif header.layer < 0:
            problems.append(f"layer {header.layer} is negative")
        if not 0 <= header.microbatch < self.micro_batches:
            problems.append(f"micro-batch {header.microbatch} outside 0..{self.micro_batches - 1}")
        if header.step < 0:
            problems.append(f"step {header.step} is negative")
        shape, size = header.shape, ITEMSIZE.get(header.dtype, 0)
        if not size:
            problems.append(f"dtype {header.dtype} is missing from this torch build")
        if any(dim < 0 for dim in shape):
            problems.append("a negative dimension")
        if self.dtype and header.dtype != self.dtype:
            problems.append(f"dtype {header.dtype}, expected {self.dtype}")
        if self.hidden_size and (len(shape) != 2 or shape[1] != self.hidden_size):
            problems.append(f"shape {list(shape)} is not (tokens, {self.hidden_size})")
        if self.max_tokens and shape and shape[0] > self.max_tokens:
            problems.append(f"{shape[0]} tokens, more than max_num_batched_tokens={self.max_tokens}")
        nbytes = size
        for dim in shape:
            nbytes *= max(dim, 0)
        if nbytes > MAX_MESSAGE_BYTES:
            problems.append(f"{nbytes} bytes, more than {MAX_MESSAGE_BYTES}")
        if header.inline and nbytes > self.inline_bytes:
            problems.append(f"{nbytes} inline bytes, more than inline_bytes={self.inline_bytes}")
        if problems:
            raise BadMessage(f"a header announced {header.dtype}{list(shape)} for layer {header.layer} step "
                             f"{header.step}: {'; '.join(problems)}; refused before anything was allocated")
        return nbytes
