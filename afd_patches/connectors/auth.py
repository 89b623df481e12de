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
    A token the project did not generate is a guess at its entropy: no check can read back how a string was
    chosen. So the rule (``estimated_bits``) has two sides, and a token needs ``MIN_TOKEN_BITS`` (128) by one:

    - generated: a token with the shape of what the project tells users to make (``HOW_TO_MAKE``:
      ``secrets.token_hex(32)``), i.e. 64 or more hex digits of one case, is credited its nominal 4 bits a
      digit unless a structure finder (``_described_bits``) describes it in at least ``_CHANCE_BITS`` (32)
      fewer: segments of a prefix code, each naming its kind, that are a literal character, a word (lower
      case, UPPER or Capitalized, its letters at English frequencies, leetspeak stand-ins at about literal
      cost), a digit run, a walk (along a keyboard row or column, the alphabet or the digits,
      either way and either case) or a repeat of what came at most 64 characters before; lengths Elias-gamma
      coded. By Kraft's inequality at most one uniformly random token in 2**32 is that compressible, so
      ``secrets.token_hex(n)``, n >= 32, is refused with probability below 2**-32; ``'0'*64`` and
      ``'deadbeef'*8`` are refused.
    - anything else (a shorter hex token, ``token_urlsafe``, a phrase, a password): a conservative guessing
      estimate (``guess_bits``), zxcvbn-like but without a dictionary: the cheapest description found of the
      token as literal characters (log2 of its alphabet each) and low-entropy runs, each run 1 bit plus its
      content. A run of 3–16 letters that could be a word (all lower case, UPPER or Capitalized; a vowel in
      every five characters, no five consonants in a row; at most 3 leetspeak stand-ins such as ``4@`` a, ``3``
      e, ``1!|`` i/l, ``0`` o, ``5$`` s, ``7+`` t) is taken for one of a 65,536-word list: 16 bits whatever its
      length, +1 for its case, +1 for leetspeak and +1 a stand-in; a digit run costs 3.32 bits a digit, a year
      (1900–2099) 7.6 bits in all; a walk or a repeat log2 of the walks (or of its distance) and of its length.
      Two words with numbers stay far below 128 (``sunshine2024monkey1234dragon99``: 67, the deterministic
      4,000-entry guess list of tests/afd/test_token_strength.py: at most 120). Random text pays for the words
      it seems to hold: of 100,000 ``secrets.token_urlsafe(32)`` (258 nominal bits) 3 were refused (lowest 121
      bits, mean 213); ``token_hex(n)`` for n < 32: never at 16 bytes, 66 % pass at 20, 99 % at 24.

    Limits: a floor against accidents and lazy choices, not a strength meter. Any estimate for a token a person
    made is a guess: this one knows no dictionary (a letter run that could be a word counts as a common one),
    no dates other than years, no shifted keys; many words, or words with long digit strings, can clear it
    (``correct-horse-battery-staple-orbit-lemon``: 131; three leetspeak words with four numbers and separators:
    153). 64 hex digits a person typed without repeats, walks or long digit runs are taken as generated. A
    token longer than ``MAX_TOKEN_BYTES`` is refused before it is estimated (the time is linear in its length,
    about 0.5 s for the worst 4 KB). Make tokens as ``HOW_TO_MAKE`` says: they always pass.

Policy
    Without a token the group may form only on a loopback ``host``; any other
    host needs a token unless ``allow_unauthenticated`` is set. The host name is
    resolved once per formation attempt (``resolve``) and that address is what
    the attempt checks, binds and connects to, so a name that resolves
    differently later cannot move a formed group off loopback; the next group
    is judged again by its own answer.

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
import re
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
_KIND_BITS = math.log2(5)  # each segment of the structure finder names its kind: literal, word, digits, walk, repeat
_CASE_BITS = math.log2(3)  # and a word its case: lower, UPPER or Capitalized
_ROWS = ("0123456789", "abcdefghijklmnopqrstuvwxyz", "1234567890qwertyuiopasdfghjklzxcvbnm",
         "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.0p;/", "qazwsxedcrfvtgbyhnujmik,ol.p;/")
_WALKS = [dict(itertools.pairwise(walk))  # each: character -> the next one along a row, one way, one case
          for walk in sorted({w.encode() for row in _ROWS for c in (row, row.upper()) for w in (c, c[::-1])})]
_PERCENT = dict(zip(b"etaoinshrdlcumwfgypbvkjxqz", (12.70, 9.06, 8.17, 7.51, 6.97, 6.75, 6.33, 6.09, 5.99, 4.25, 4.03,
                                                    2.78, 2.76, 2.41, 2.36, 2.23, 2.02, 1.97, 1.93, 1.29, 0.98, 0.77,
                                                    0.15, 0.15, 0.10, 0.07), strict=True))
_LETTER_BITS = {c: -math.log2(p / sum(_PERCENT.values())) for c, p in _PERCENT.items()}  # English letter frequency


_GENERATED = re.compile(rb"[0-9a-f]{64,}|[0-9A-F]{64,}")  # what secrets.token_hex(n >= 32) prints (either case)
_DIGITS = frozenset(b"0123456789")
_LETTERS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_LEET = frozenset(b"4@8369!|1025$7+")  # stand-ins for letters: a a b e g g i l l/i o z s s t t
_LEET_SHARE = 0.25  # in the structure finder's words a character is a stand-in with this chance
_WORD_BITS = 16.0  # the guessing estimate's words: one of a 65,536-word list, what any run of letters is taken for
_MAX_WORD, _MAX_LEET = 16, 3  # the longest run taken for one word; the most stand-ins in it
_VOWELS = frozenset(b"aeiouyAEIOUY43@10!|")  # a word has one in five characters, and no 5 other letters in a row
_MAX_CONSONANTS = 4
_RUN_BITS = 1.0  # each run of the guessing estimate (word, digits, walk, repeat) says it is one
_YEAR_BITS = math.log2(200)  # 1900-2099
_DIGIT_BITS = math.log2(10)


def estimated_bits(token: bytes) -> int:
    """Bits credited to ``token`` by the rule in "Strength": its nominal bits when it has the generated shape
    and no structure worth ``_CHANCE_BITS``, else ``guess_bits``; 0 for an empty token."""
    if not token:
        return 0
    size, letters = next((size, letters) for size, letters in _ALPHABETS if letters.issuperset(token))
    if _GENERATED.fullmatch(token):
        nominal = len(token) * math.log2(size)
        described = math.log2(len(_ALPHABETS)) + _described_bits(token, math.log2(len(letters)))
        if described > nominal - _CHANCE_BITS:
            return int(nominal)
    return int(guess_bits(token))


def _runs(token: bytes) -> tuple[list[int], list[int], list[int]]:
    """For each position i of ``token``: the longest repeat of what came at most ``_REACH`` before, the
    longest walk continuing from ``token[i - 1]``, and the digits from i on."""
    n = len(token)
    copies, steps = [0] * (_REACH + 1), [0] * len(_WALKS)  # how far each rule holds from i on
    repeat, walk, digits = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        reach = min(i, _REACH)
        for d in range(1, reach + 1):
            copies[d] = copies[d] + 1 if token[i] == token[i - d] else 0
        for k, nxt in enumerate(_WALKS):
            steps[k] = steps[k] + 1 if i and nxt.get(token[i - 1]) == token[i] else 0
        repeat[i], walk[i] = max(copies[1:reach + 1], default=0), max(steps)
        digits[i] = digits[i + 1] + 1 if token[i] in _DIGITS else 0
    return repeat, walk, digits


def _lengths(longest: int) -> set[int]:
    """The segment lengths tried where a rule holds for ``longest`` characters: up to ``_REACH``, and all."""
    return {*range(1, min(longest, _REACH) + 1), longest} - {0}


def guess_bits(token: bytes) -> float:
    """The conservative guessing estimate of "Strength": the cheapest description of ``token`` found as
    literal characters and low-entropy runs (words, digits and years, walks, repeats), in bits."""
    n = len(token)
    literal = math.log2(next(size for size, letters in _ALPHABETS if letters.issuperset(token))) if n else 0.0
    repeat, walk, digits = _runs(token)
    best = [0.0] + [math.inf] * n
    for i in range(n):
        start = best[i] + _RUN_BITS
        best[i + 1] = min(best[i + 1], best[i] + literal)
        for length, extra in _words(token, i):
            best[i + length] = min(best[i + length], start + _WORD_BITS + extra)
        for length in _lengths(digits[i]):
            year = length == 4 and 1900 <= int(token[i:i + 4]) <= 2099
            best[i + length] = min(best[i + length], start + (_YEAR_BITS if year else length * _DIGIT_BITS))
        for longest, fixed in ((walk[i], math.log2(len(_WALKS))), (repeat[i], math.log2(max(1, min(i, _REACH))))):
            for length in _lengths(longest):
                best[i + length] = min(best[i + length], start + fixed + math.log2(length + 1))
    return best[n]


def _words(token: bytes, i: int) -> list[tuple[int, float]]:
    """(length, bits beyond ``_WORD_BITS``) of each run from ``i`` that ``guess_bits`` takes for a word: 3 to
    ``_MAX_WORD`` letters and stand-ins, at least 3 letters, at most ``_MAX_LEET`` (and no more than letters)
    stand-ins, all lower case (+0), Capitalized or UPPER (+1); leetspeak +1 and +1 a stand-in."""
    found: list[tuple[int, float]] = []
    letters = upper = leet = vowels = consonants = 0
    for j in range(i, min(len(token), i + _MAX_WORD)):
        c = token[j]
        if c in _LETTERS:
            letters += 1
            upper += c < 0x61  # A-Z sort before a-z
            consonants = 0 if c in _VOWELS else consonants + 1
        elif c in _LEET:
            leet += 1
            consonants = 0 if c in _VOWELS else consonants + 1
        else:
            break
        vowels += c in _VOWELS
        if consonants > _MAX_CONSONANTS:
            break
        if letters < 3 or leet > min(_MAX_LEET, letters) or 5 * vowels < j - i + 1:
            continue
        if upper == 0:
            case = 0.0
        elif upper == letters or (upper == 1 and token[i] < 0x61 and token[i] in _LETTERS):
            case = 1.0
        else:
            continue
        found.append((j - i + 1, case + (1.0 + leet if leet else 0.0)))
    return found


def _described_bits(token: bytes, literal_bits: float) -> float:
    """The structure finder of "Strength": the cheapest description of ``token`` found as segments (literal,
    word, digits, walk, repeat) of a prefix code, in bits."""
    n = len(token)
    repeat, walk, digits = _runs(token)
    leet_bits = math.log2(1 / _LEET_SHARE) + math.log2(len(_LEET))
    letter_bits = {c: bits - math.log2(1 - _LEET_SHARE) for c, bits in _LETTER_BITS.items()}
    modes = []  # per case mode (lower, UPPER): the longest word from i on, and the bits of token[i:] in that mode
    for shift in (0, 0x20):
        longest, cum = [0] * (n + 1), [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            c = token[i]
            bits = leet_bits if c in _LEET else letter_bits.get(c + shift) if c in _LETTERS else None
            longest[i], cum[i] = (longest[i + 1] + 1, cum[i + 1] + bits) if bits is not None else (0, cum[i + 1])
        modes.append((longest, cum))
    (low, low_cum), (up, up_cum) = modes
    best = [0.0] + [math.inf] * n
    for i in range(n):
        start = best[i] + _KIND_BITS
        best[i + 1] = min(best[i + 1], start + literal_bits)
        words = [(low[i], 0.0, low_cum, 0), (up[i], 0.0, up_cum, 0)]  # longest, first letter's bits, bits, from
        if token[i] in _LETTERS and token[i] < 0x61:  # Capitalized: an upper-case letter, then lower case
            words.append((1 + low[i + 1], up_cum[i] - up_cum[i + 1], low_cum, 1))
        for longest, head, cum, skip in words:
            for length in _lengths(longest):
                content = head + cum[i + skip] - cum[i + length]
                best[i + length] = min(best[i + length], start + _CASE_BITS + _gamma(length) + content)
        for length in _lengths(digits[i]):
            best[i + length] = min(best[i + length], start + _gamma(length) + length * _DIGIT_BITS)
        for longest, fixed in ((walk[i], math.log2(len(_WALKS))), (repeat[i], math.log2(max(1, min(i, _REACH))))):
            for length in _lengths(longest):
                best[i + length] = min(best[i + length], start + fixed + _gamma(length))
    return best[n]


def _gamma(length: int) -> int:
    """Bits of ``length`` in Elias-gamma code."""
    return 2 * length.bit_length() - 1


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
