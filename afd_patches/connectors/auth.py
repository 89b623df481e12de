"""The AFD group's shared secret: where it comes from, when one is required, how strong it must be, and the keys
derived from it.

Token
    ``AFD_TOKEN`` (environment) or the file named by the config key
    ``token_file`` — never a command-line value, so it does not show in ``ps``.
    Both at once is an error (which one would win is not obvious to an
    operator). A token file is opened without following a symlink and without
    blocking on a FIFO, and must be a regular file owned by the effective user
    with no group/other permission bits, at most ``MAX_TOKEN_BYTES``.

Strength
    A token must carry at least ``MIN_TOKEN_BITS`` bits by ``estimated_bits``, which counts two ways:

    - nominal: its length times log2 of the smallest alphabet its characters come from (hex digits, digits and
      letters, base64, printable ASCII, bytes): what a generator drawing from that alphabet gives;
    - described: the bits of the cheapest description found of the token as segments, each 2 bits for its kind
      plus a literal character (uniform over the alphabet), a lowercase word (English letter frequencies), a walk
      (along a keyboard row or column, the alphabet or the digits, either way and either case) or a repeat of
      what came at most 64 characters before (runs and periodic tokens); lengths are Elias-gamma coded.

    The described count is used when it is at least ``_CHANCE_BITS`` (32) below the nominal one. The description
    is a prefix code, so by Kraft's inequality at most one uniformly random token in 2**32 is that compressible:
    a token from ``secrets.token_hex(n)`` or ``secrets.token_urlsafe(n)`` with n >= 16 (128 and >= 131 nominal
    bits) is refused with probability below 2**-32 (plus about 2**-43 that a urlsafe one is all hex digits).
    ``'a'*31+'b'``, ``passwordpassword``, ``password1password2password3``, ``correcthorsebatterystaple`` and
    keyboard walks (``qwertyuiop...``, ``1qaz2wsx...``) are refused. The error says how to make a token.

    Limits: a floor against accidents and lazy choices, not a strength meter. It knows no dictionary: distinct
    words count at English letter frequencies (about 4.1 bits a letter, where a dictionary attack pays much
    less), so a long phrase of different words and digits (``sunshine2024monkey1234dragon99``) passes; structure
    worth less than 32 bits is not counted (``'8f3a'*4 + 'c0de9b1e'*2`` keeps its nominal 128); no leetspeak,
    dates or shifted keys. A token longer than ``MAX_TOKEN_BYTES`` is refused before it is estimated (the time is
    linear in its length, about 0.7 s for the worst 4 KB).

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
import itertools
import math
import os
import secrets
import socket
import stat

TOKEN_ENV = "AFD_TOKEN"
MIN_TOKEN_BITS = 128
MAX_TOKEN_BYTES = 4096
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
        if st.st_size > MAX_TOKEN_BYTES:
            raise TokenError(f"token_file {path!r}: {st.st_size} bytes, more than {MAX_TOKEN_BYTES}")
        return os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)


def load_token(token_file: str | None) -> bytes | None:
    """The group's secret, or ``None`` when neither ``AFD_TOKEN`` nor ``token_file`` is set.

    Raises ``TokenError`` when both are set, the file is refused, or the token is longer than
    ``MAX_TOKEN_BYTES`` or carries fewer than ``MIN_TOKEN_BITS`` bits (``estimated_bits``).
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
    if len(token) > MAX_TOKEN_BYTES:
        raise TokenError(f"{source}: the token is {len(token)} bytes, more than {MAX_TOKEN_BYTES}; {HOW_TO_MAKE}")
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
    (256, frozenset(range(256))),
)
_CHANCE_BITS = 32  # structure worth less than this is not counted: one random token in 2**32 shows that much
_REACH = 64  # a repeat copies from at most this far back; segment lengths are tried up to this, and the longest
_KIND_BITS = 2.0  # each segment names its kind: literal, word, walk or repeat
_ROWS = ("0123456789", "abcdefghijklmnopqrstuvwxyz", "1234567890qwertyuiopasdfghjklzxcvbnm",
         "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.0p;/", "qazwsxedcrfvtgbyhnujmik,ol.p;/")
_WALKS = [dict(itertools.pairwise(walk))  # each: character -> the next one along a row, one way, one case
          for walk in sorted({w.encode() for row in _ROWS for c in (row, row.upper()) for w in (c, c[::-1])})]
_PERCENT = dict(zip(b"etaoinshrdlcumwfgypbvkjxqz", (12.70, 9.06, 8.17, 7.51, 6.97, 6.75, 6.33, 6.09, 5.99, 4.25, 4.03,
                                                    2.78, 2.76, 2.41, 2.36, 2.23, 2.02, 1.97, 1.93, 1.29, 0.98, 0.77,
                                                    0.15, 0.15, 0.10, 0.07), strict=True))
_LETTER_BITS = {c: -math.log2(p / sum(_PERCENT.values())) for c, p in _PERCENT.items()}  # English letter frequency


def estimated_bits(token: bytes) -> int:
    """Bits of ``token`` by the estimate in "Strength": the described bits where structure saves at least
    ``_CHANCE_BITS`` over the nominal bits, else the nominal bits; 0 for an empty token."""
    if not token:
        return 0
    size, letters = next((size, letters) for size, letters in _ALPHABETS if letters.issuperset(token))
    nominal = len(token) * math.log2(size)
    described = math.log2(len(_ALPHABETS)) + _described_bits(token, math.log2(len(letters)))
    return int(described if described <= nominal - _CHANCE_BITS else nominal)


def _described_bits(token: bytes, literal_bits: float) -> float:
    """The cheapest description of ``token`` found as segments (literal, word, walk, repeat), in bits."""
    n = len(token)
    copies, steps = [0] * (_REACH + 1), [0] * len(_WALKS)  # how far each rule holds from i on
    repeat, walk, lower, english = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1), [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        reach = min(i, _REACH)
        for d in range(1, reach + 1):
            copies[d] = copies[d] + 1 if token[i] == token[i - d] else 0
        for k, nxt in enumerate(_WALKS):
            steps[k] = steps[k] + 1 if i and nxt.get(token[i - 1]) == token[i] else 0
        repeat[i], walk[i] = max(copies[1:reach + 1], default=0), max(steps)
        lower[i] = lower[i + 1] + 1 if token[i] in _LETTER_BITS else 0
        english[i] = english[i + 1] + _LETTER_BITS.get(token[i], 0.0)  # English bits of token[i:], letters only
    best = [0.0] + [math.inf] * n
    for i in range(n):
        start = best[i] + _KIND_BITS
        best[i + 1] = min(best[i + 1], start + literal_bits)
        for longest, fixed, content in ((lower[i], 0.0, True), (walk[i], math.log2(len(_WALKS)), False),
                                        (repeat[i], math.log2(max(1, min(i, _REACH))), False)):
            for length in {*range(1, min(longest, _REACH) + 1), longest} - {0}:
                bits = fixed + 2 * length.bit_length() - 1 + (english[i] - english[i + length] if content else 0.0)
                best[i + length] = min(best[i + length], start + bits)
    return best[n]


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
