"""``core.redact``: what a recorded request's headers and query keep of a credential."""

from __future__ import annotations

import pytest

from capture_proxy.core.redact import redact_headers, redact_query, secret_name


@pytest.mark.parametrize(
    "name",
    [
        "Authorization",
        "Proxy-Authorization",
        "x-api-key",
        "api-key",
        "X-Goog-Api-Key",
        "Cookie",
        "X-Custom-Token",
        "X-Amz-Security-Token",
        "X-Client-Secret",
        "X-Password",
        "x-my-credentials",
        "key",
        "api_key",
        "apikey",
        "token",
        "access_token",
        "refresh_token",
        "id_token",
        "client_secret",
        "password",
        "passwd",
        "pwd",
        "sig",
        "X-Amz-Signature",
        "AUTH",
    ],
)
def test_names_that_say_they_hold_a_credential(name):
    assert secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "Content-Type",
        "User-Agent",
        "anthropic-version",
        "anthropic-beta",
        "x-session-id",
        "session_id",
        "originator",
        "x-stainless-retry-count",
        "beta",
        "Host",
        "signal",  # not "sig": whole names only
    ],
)
def test_names_that_do_not(name):
    assert not secret_name(name)


def test_headers_keep_names_and_order_and_mask_credential_values():
    headers = [
        ("Host", "127.0.0.1:8000"),
        ("X-Custom-Token", "SECRETR3"),
        ("x-api-key", "sk-ant-SECRETR8"),
        ("anthropic-version", "2023-06-01"),
        ("Authorization", "Bearer sk-SECRET"),
        ("Cookie", "session=SECRET"),
    ]
    assert redact_headers(headers) == [
        ["Host", "127.0.0.1:8000"],
        ["X-Custom-Token", "<redacted>"],
        ["x-api-key", "<redacted>"],
        ["anthropic-version", "2023-06-01"],
        ["Authorization", "<redacted>"],
        ["Cookie", "<redacted>"],
    ]


BASE = "/ng-rollout/rec1/training-token-capture/v1/messages"


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        # the trial's case: Gemini-style ?key= next to Claude Code's ?beta=true
        (f"{BASE}?beta=true&key=SECRETR7", f"{BASE}?beta=true&key=%3Credacted%3E"),
        (
            f"{BASE}?api_key=S1&token=S2&access_token=S3&x=1",
            f"{BASE}?api_key=%3Credacted%3E&token=%3Credacted%3E&access_token=%3Credacted%3E&x=1",
        ),
        # a percent-encoded name is read decoded; its spelling is kept
        (f"{BASE}?api%5Fkey=S1", f"{BASE}?api%5Fkey=%3Credacted%3E"),
        (f"{BASE}?sig=S1&sv=2024", f"{BASE}?sig=%3Credacted%3E&sv=2024"),
        (f"{BASE}?KEY=S1#frag", f"{BASE}?KEY=%3Credacted%3E#frag"),
        # nothing to mask: byte for byte
        (f"{BASE}?beta=true", f"{BASE}?beta=true"),
        (f"{BASE}?token&key=&&a=%20b", f"{BASE}?token&key=&&a=%20b"),
        (BASE, BASE),
        (f"{BASE}?", f"{BASE}?"),
    ],
)
def test_query_credentials_are_masked_and_the_rest_kept(target, expected):
    assert redact_query(target) == expected
