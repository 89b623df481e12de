"""The AFD group's shared secret: where it comes from, when one is required, and the proofs.

Token
    ``AFD_TOKEN`` (environment) or the file named by the config key
    ``token_file`` — never a command-line value, so it does not show in ``ps``.
    Both at once is an error (which one would win is not obvious to an
    operator). At least ``MIN_TOKEN_BYTES`` bytes after stripping surrounding
    whitespace. A token file is opened without following a symlink and without
    blocking on a FIFO, and must be a regular file owned by the effective user
    with no group/other permission bits, at most ``MAX_TOKEN_FILE_BYTES``.

Policy
    Without a token the group may form only on a loopback ``host`` (every
    address the name resolves to is loopback); any other host needs a token
    unless ``allow_unauthenticated`` is set.

Proofs
    HMAC-SHA256 under the token over both sides' nonces, with a different
    label per direction (a host proof cannot be replayed as a joiner proof), and
    compared with ``hmac.compare_digest``. Without a token the key is empty: the
    proofs then only check that both sides agree there is no token.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat

TOKEN_ENV = "AFD_TOKEN"
MIN_TOKEN_BYTES = 16
MAX_TOKEN_FILE_BYTES = 4096
NONCE_BYTES = 32
HOST_LABEL = b"afd-host-proof\0"
JOIN_LABEL = b"afd-join-proof\0"
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
    if len(token) < MIN_TOKEN_BYTES:
        raise TokenError(f"{source}: the token has {len(token)} bytes, fewer than {MIN_TOKEN_BYTES} "
                         "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return token


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (``0.0.0.0``/``::`` are not)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addrs = {info[4][0].split("%", 1)[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def check_policy(host: str, token: bytes | None, allow_unauthenticated: bool) -> None:
    """``TokenError`` when ``host`` is not loopback, no token is set and unauthenticated use was not allowed."""
    if token is None and not allow_unauthenticated and not is_loopback(host):
        raise TokenError(f"host {host!r} is not a loopback address and no token is set: {HOW_TO_SET}; "
                         "or set allow_unauthenticated: true to accept anyone who can reach the port")


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes | None, label: bytes, joiner_nonce: bytes, host_nonce: bytes) -> bytes:
    """HMAC-SHA256 under ``token`` (empty key when ``None``) of ``label``, then both nonces."""
    return hmac.new(token or b"", label + joiner_nonce + host_nonce, hashlib.sha256).digest()


def verify(token: bytes | None, label: bytes, joiner_nonce: bytes, host_nonce: bytes, given: bytes) -> bool:
    """Constant-time check of a peer's proof."""
    return hmac.compare_digest(proof(token, label, joiner_nonce, host_nonce), given)
