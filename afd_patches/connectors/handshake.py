"""The AFD protocol's lines: what one rank says about itself (``Hello``), the proofs, and how a line is read.

Protocol (one JSON object per line, at most ``MAX_LINE`` bytes)
    1. joiner → host ``{"afd": PROTOCOL, "nonce": Nj}``
    2. host → joiner ``{"afd": PROTOCOL, "nonce": Nh}`` (nothing that depends on the token)
    3. joiner → host ``{"hello": "<H_j>", "proof": P_j}``, ``P_j = HMAC(K, "join" ‖ H_j)`` (``join_proof``)
    4. the host checks ``P_j`` (constant time) and only then parses ``H_j`` and answers
       ``{"hello": "<H_h>", "proof": P_h}``, ``P_h = HMAC(K, "host" ‖ H_h ‖ P_j)`` (``host_proof``); the joiner
       checks it.
    ``K = HMAC(token, "afd-session" ‖ Nj ‖ Nh)`` is the session key (``auth.session_key``). From here on
    every message is ``{"m": "<body>", "mac": HMAC(K, "msg" ‖ counter ‖ body)}`` with a counter per
    direction, so nothing can be injected, replayed or reordered on the session without the token
    (``afd_patches.connectors.session``). ``H_j``, ``H_h`` and ``body`` are JSON texts carried as strings: every
    MAC covers the bytes as they came over the wire, and nothing inside them is parsed before its MAC verified
    (no re-serialisation).

    The joiner proves first, so a caller without the token learns nothing it could test offline: all it ever
    sees is a random nonce. The hellos (role, rank, the settings both sides compare, where the rank's
    tensors live, the data address an FFN rank advertises) are inside the proofs; whatever a rank later acts
    on arrives as a MAC'd message of the session (``afd_patches.connectors.rendezvous``). The host's side of
    steps 1–4 is ``afd_patches.connectors.admission``, the joiner's ``afd_patches.connectors.session``.

Parsing (``parse_line``)
    A line is at most ``MAX_LINE`` bytes of strict UTF-8 (JSON's own encoding on the wire; a UTF-16 or UTF-32
    line, or one that starts with a byte order mark, is refused before anything else reads it) and its text
    nests at most ``MAX_DEPTH`` arrays/objects; all of this is checked on the very text ``json`` then parses.
    Anything else is ``ValueError`` (that connection is dropped).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

PROTOCOL = 4
MAX_LINE = 16 * 1024
MAX_DEPTH = 8  # nesting of arrays/objects in one line (a hello needs 3)


def canonical(obj: Any) -> bytes:
    """``obj`` as JSON with sorted keys and no spaces, UTF-8 (what a hello's proof covers)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Hello:
    """What one rank says about itself inside the proofs.

    ``fields`` are compared between peers (a field both have must be equal); ``device`` says where the
    rank's tensors live; ``purpose`` is ``group`` (the rendezvous at FFN rank 0) or ``data`` (an attention
    rank's link to an FFN rank other than 0), ``group`` the id of the group a ``data`` session belongs to,
    ``address`` the ``host:port`` an FFN rank other than 0 takes data sessions at.
    """

    role: str
    rank: int
    fields: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    purpose: str = "group"
    group: str = ""
    address: str = ""

    @property
    def who(self) -> str:
        return f"{self.role} rank {self.rank}"

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "fields": self.fields, "device": self.device,
                "purpose": self.purpose, "group": self.group, "address": self.address}

    @classmethod
    def parse(cls, obj: Any) -> Hello:
        """``ValueError`` unless ``obj`` is a well-formed hello."""
        if not isinstance(obj, dict):
            raise ValueError("hello is not an object")
        role, rank, fields = obj.get("role"), obj.get("rank"), obj.get("fields")
        if not isinstance(role, str) or isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(
                fields, dict):
            raise ValueError("malformed role/rank/fields")
        texts = [obj.get(k, default) for k, default in (("device", ""), ("purpose", "group"), ("group", ""),
                                                         ("address", ""))]
        if not all(isinstance(t, str) and len(t) <= 256 for t in texts):
            raise ValueError("malformed device/purpose/group/address")
        return cls(role, rank, fields, *texts)


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 under ``key`` of ``parts`` joined by NUL bytes (every proof and message MAC of the protocol)."""
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def join_proof(key: bytes, hello: bytes) -> bytes:
    """The joiner's proof (step 3) of the hello text ``hello`` under the session ``key`` (``auth.session_key``)."""
    return mac(key, b"join", hello)


def host_proof(key: bytes, hello: bytes, joiner_proof: bytes) -> bytes:
    """The host's proof (step 4) of its hello text ``hello``, bound to the joiner's proof ``joiner_proof``."""
    return mac(key, b"host", hello, joiner_proof)


def nesting_depth(text: str) -> int:
    """How deeply arrays/objects nest in the JSON text ``text`` (brackets inside strings do not count).

    Judged on the decoded text, the very characters ``json.loads`` reads (``parse_line``)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return MAX_DEPTH  # cannot nest deeper: no scan
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def parse_line(line: bytes) -> dict[str, Any]:
    """One protocol line as a JSON object; ``ValueError`` for anything else (see "Parsing": size, encoding and
    depth are judged first, the depth on the decoded text that ``json`` then parses)."""
    if len(line) > MAX_LINE:
        raise ValueError(f"line longer than {MAX_LINE} bytes")
    try:
        text = line.decode("utf-8")  # strict; json.loads(bytes) would also take UTF-16 and UTF-32
    except UnicodeDecodeError:
        raise ValueError("not JSON (not UTF-8)") from None
    if "\0" in text or text.startswith("\ufeff"):  # no JSON text holds a raw NUL; UTF-16/32 ASCII does
        raise ValueError("not JSON (UTF-16, UTF-32 or a byte order mark, not UTF-8)")
    if not text.lstrip().startswith("{"):
        raise ValueError("not JSON (not an object)")
    if nesting_depth(text) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ValueError("not JSON (not an object)")
    return obj


def text_field(obj: dict[str, Any], key: str) -> bytes:
    """The JSON text carried as the string ``obj[key]``, as bytes (what a MAC covers); ``ValueError`` if none."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise ValueError(f"no valid {key!r}")
    try:
        return value.encode()
    except UnicodeError:
        raise ValueError(f"no valid {key!r}") from None


def hex_field(obj: dict[str, Any], key: str, size: int) -> bytes:
    """The ``size`` bytes written as hex in the string ``obj[key]``; ``ValueError`` if none."""
    value = obj.get(key)
    if not isinstance(value, str) or len(value) != 2 * size:
        raise ValueError(f"no valid {key!r}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"no valid {key!r}") from None


def as_line(obj: dict[str, Any]) -> bytes:
    """``obj`` as one protocol line (canonical JSON and a newline)."""
    return canonical(obj) + b"\n"
