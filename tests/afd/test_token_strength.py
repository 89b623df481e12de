"""The token strength check (``afd_patches.connectors.auth``, "Strength"): what ``secrets`` makes passes,
guessable strings are refused, saying how to make a token."""

from __future__ import annotations

import base64
import itertools
import math
import random
import secrets
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_patches.connectors import auth

GUESSABLE = [
    "correcthorsebatterystaple",
    "password1password2password3",
    "a" * 31 + "b",
    "passwordpassword",
    "qwertyuiopasdfghjklzxcvbnm",  # keyboard rows
    "QWERTYUIOPASDFGHJKLZXCVBNM",
    "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.",  # keyboard columns
    "qazwsxedcrfvtgbyhnujmikolp",
    "abcdefghijklmnopqrstuvwxyz0123456789",
    "zyxwvutsrqponmlkjihgfedcba9876543210",
    "monkey123monkey123monkey123",  # words with digits
    "iloveyou1234567890iloveyou",
    "Password12345678901234567890",
    "summer2024summer2025summer2026",
    "0" * 64,
    "ab" * 40,
]


@settings(max_examples=2000, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), nbytes=st.integers(16, 48), urlsafe=st.booleans())
def test_random_tokens_always_pass(seed: int, nbytes: int, urlsafe: bool) -> None:
    """Tokens as ``secrets.token_hex(n)`` / ``secrets.token_urlsafe(n)`` encode n random bytes (a seeded PRNG
    stands in for the OS source, so that every example differs and a failure replays; hypothesis-shaped bytes,
    with their zeros and repeats, would rightly be refused). The module bounds a refusal at 2**-32 a draw."""
    data = random.Random(seed).randbytes(nbytes)
    token = base64.urlsafe_b64encode(data).rstrip(b"=") if urlsafe else data.hex().encode()
    assert auth.estimated_bits(token) >= auth.MIN_TOKEN_BITS, token


@pytest.mark.parametrize("make", [secrets.token_hex, secrets.token_urlsafe])
def test_load_token_accepts_what_secrets_makes(monkeypatch: pytest.MonkeyPatch, make: Callable[[int], str]) -> None:
    for nbytes in (16, 17, 24, 32, 64):
        token = make(nbytes)
        monkeypatch.setenv(auth.TOKEN_ENV, token)
        assert auth.load_token(None) == token.encode()


@pytest.mark.parametrize("token", GUESSABLE)
def test_guessable_tokens_are_refused_saying_how_to_make_one(monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, token)
    with pytest.raises(auth.TokenError) as e:
        auth.load_token(None)
    assert f"fewer than {auth.MIN_TOKEN_BITS}" in str(e.value) and auth.HOW_TO_MAKE in str(e.value)
    assert auth.estimated_bits(token.encode()) < auth.MIN_TOKEN_BITS


def test_the_description_is_a_prefix_code() -> None:
    """The 2**-32 bound rests on Kraft's inequality: summed over every string of one length and alphabet,
    2**-(described bits) is at most 1, so at most a 2**-s share of random strings is compressible by s bits."""
    hex_digits = b"0123456789abcdef"
    bits = [auth._described_bits(bytes(t), math.log2(16)) for t in itertools.product(hex_digits, repeat=3)]
    assert sum(2.0 ** -b for b in bits) <= 1.0
    for saved in (4, 8):
        assert sum(b <= 12 - saved for b in bits) <= len(bits) * 2.0 ** -saved


def test_an_oversized_token_is_refused_before_it_is_estimated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, secrets.token_hex(auth.MAX_TOKEN_BYTES))
    with pytest.raises(auth.TokenError, match=rf"{2 * auth.MAX_TOKEN_BYTES} bytes, more than {auth.MAX_TOKEN_BYTES}"):
        auth.load_token(None)
