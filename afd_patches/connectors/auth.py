"""The AFD group's shared secret: where it comes from, when one is required, how strong it must be, and the keys
derived from it.

Token
    ``AFD_TOKEN`` (environment) or the file named by the config key
    ``token_file`` — never a command-line value, so it does not show in ``ps``.
    Both at once is an error (which one would win is not obvious to an
    operator). A token file is opened without following a symlink and without
    blocking on a FIFO, and must be a regular file owned by the effective user
    with no group/other permission bits, at most ``MAX_TOKEN_FILE_BYTES``.

Strength
    A token must carry at least ``MIN_TOKEN_BITS`` bits by a generous estimate
    (``estimated_bits``: its length times the bits of the smallest alphabet
    its characters come from: hex digits, digits and letters, base64, printable
    ASCII; a token that repeats a shorter piece counts as that piece). ``secrets.token_hex(16)``
    passes; ``passwordpassword`` does not. The error says how to make one.

Policy
    Without a token the group may form only on a loopback ``host``; any other
    host needs a token unless ``allow_unauthenticated`` is set. The host name is
    resolved once (``resolve``) and that address is what is checked, bound and
    connected to, so a name that resolves differently later cannot move the
    group off loopback.

Keys
    ``session_key``: HMAC-SHA256 under the token over both nonces of one
    session (``afd_patches.connectors.session``); ``group_key``: under the token
    over the group's id (the records the group keeps in a ``TCPStore``). Without
    a token the key is empty: the MACs then only check that nobody changed
    bytes by accident, which is all a loopback-only group without a token gets.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import math
import os
import secrets
import socket
import stat

TOKEN_ENV = "AFD_TOKEN"
MIN_TOKEN_BITS = 128
MAX_TOKEN_FILE_BYTES = 4096
NONCE_BYTES = 32
HOW_TO_MAKE = "make one with: python -c 'import secrets; print(secrets.token_hex(32))'"
HOW_TO_SET = (f"set the same secret on every engine of the group, in the environment variable {TOKEN_ENV} "
              "or in a file named by the config key token_file (mode 0600)")


class TokenError(ValueError):
    """The token is missing where required, unreadable, or too short; the message says how to fix it."""


def _read_token_file(path: str) -> bytes:
    """The file's bytes, refusing a symlink, a FIFO/device, a foreign owner or group/other access."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "is a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise TokenError(f"token_file {path!r}: cannot open: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"token_file {path!r}: not a regular file")
        if st.st_uid != os.geteuid():
            raise TokenError(f"token_file {path!r}: owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise TokenError(f"token_file {path!r}: mode {stat.S_IMODE(st.st_mode):04o} lets group/others access "
                             "it; chmod 600 it")
        if st.st_size > MAX_TOKEN_FILE_BYTES:
            raise TokenError(f"token_file {path!r}: {st.st_size} bytes, more than {MAX_TOKEN_FILE_BYTES}")
        return os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)


def load_token(token_file: str | None) -> bytes | None:
    """The group's secret, or ``None`` when neither ``AFD_TOKEN`` nor ``token_file`` is set.

    Raises ``TokenError`` when both are set, the file is refused, or the token
    is shorter than ``MIN_TOKEN_BYTES``.
    """
    env = os.environ.get(TOKEN_ENV)
    if env is not None and token_file:
        raise TokenError(f"both {TOKEN_ENV} and token_file ({token_file!r}) are set; use one")
    if token_file:
        token, source = _read_token_file(token_file).strip(), f"token_file {token_file!r}"
    elif env is not None:
        token, source = env.strip().encode(), TOKEN_ENV
    else:
        return None
    bits = estimated_bits(token)
    if bits < MIN_TOKEN_BITS:
        raise TokenError(f"{source}: the token carries about {bits} bits, fewer than {MIN_TOKEN_BITS}; {HOW_TO_MAKE}")
    return token


_ALPHABETS = (
    (16, frozenset(b"0123456789abcdef")),
    (16, frozenset(b"0123456789ABCDEF")),
    (62, frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")),
    (64, frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+/=-_")),
    (95, frozenset(range(32, 127))),
)


def estimated_bits(token: bytes) -> int:
    """Bits of ``token`` by a generous estimate (see "Strength"); 0 for an empty token."""
    unit = token
    for size in range(1, len(token) // 2 + 1):
        if len(token) % size == 0 and token[:size] * (len(token) // size) == token:
            unit = token[:size]
            break
    chars = set(unit)
    alphabet = next((size for size, letters in _ALPHABETS if chars <= letters), 256)
    return int(len(unit) * math.log2(alphabet)) if unit else 0


def resolve(host: str) -> str:
    """The address ``host`` names (the first ``getaddrinfo`` gives); ``OSError`` when it names none."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return str(infos[0][4][0]).split("%", 1)[0]


def is_loopback(address: str) -> bool:
    """True when ``address`` (an IP address, see ``resolve``) is a loopback address (``0.0.0.0``/``::`` are not)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_policy(address: str, token: bytes | None, allow_unauthenticated: bool) -> None:
    """``TokenError`` when ``address`` is not loopback, no token is set and unauthenticated use was not allowed."""
    if token is None and not allow_unauthenticated and not is_loopback(address):
        raise TokenError(f"host {address} is not a loopback address and no token is set: {HOW_TO_SET}; "
                         "or set allow_unauthenticated: true to accept anyone who can reach the port")


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def session_key(token: bytes | None, joiner_nonce: bytes, host_nonce: bytes) -> bytes:
    """The key of one session: HMAC-SHA256 under ``token`` (empty key when ``None``) of both nonces."""
    return hmac.new(token or b"", b"afd-session\0" + joiner_nonce + host_nonce, hashlib.sha256).digest()


def group_key(token: bytes | None, group: str) -> bytes:
    """The key of a group's store records: HMAC-SHA256 under ``token`` of the group's id."""
    return hmac.new(token or b"", b"afd-group\0" + group.encode(), hashlib.sha256).digest()
