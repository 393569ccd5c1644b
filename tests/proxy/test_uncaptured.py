"""Generation calls outside a capture path, and misspelt capture paths (issue 34)."""

from __future__ import annotations

import logging

import pytest

from tests.proxy.conftest import MakeStack, Stack

CHAT = {"model": "scripted-qwen", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {
    "model": "scripted-qwen",
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "hi"}],
}
FORM = "/ng-rollout/<rollout_id>/training-token-capture/v1/..."


def _uncaptured_count(text: str, path: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'capture_proxy_uncaptured_generation_calls_total{{path="{path}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_plain_generation_call_is_forwarded_warned_once_and_counted(stack: Stack, caplog):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    for _ in range(3):
        resp = await stack.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200, await resp.text()
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "outside a capture path" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("POST /v1/chat/completions is a generation call outside")
    assert FORM in warnings[0]
    metrics = await (await stack.client.get("/metrics")).text()
    assert _uncaptured_count(metrics, "/v1/chat/completions") == 3
    assert _uncaptured_count(metrics, "/v1/responses") == 0
    # Not a generation call: neither warned nor counted.
    assert (await stack.client.get("/v1/models")).status == 200
    metrics = await (await stack.client.get("/metrics")).text()
    assert "/v1/models" not in metrics


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/chat/completions", CHAT, "openai"),
        ("/v1/responses", {"model": "scripted-qwen", "input": "hi"}, "openai"),
        ("/v1/messages", MESSAGES, "anthropic"),
        ("/v1/completions", {"model": "scripted-qwen", "prompt": "hi"}, "openai"),
        ("/inference/v1/generate", {"token_ids": [1, 2]}, "openai"),
    ],
)
async def test_refuse_setting_answers_400_in_the_apis_shape(
    make_stack: MakeStack, path, body, shape
):
    stack = await make_stack(uncaptured_generation="refuse")
    resp = await stack.client.post(path, json=body)
    assert resp.status == 400
    answer = await resp.json()
    if shape == "anthropic":
        assert answer["type"] == "error"
        assert answer["error"]["type"] == "invalid_request_error"
        message = answer["error"]["message"]
    else:
        assert answer["error"]["code"] == "capture_path_required"
        assert answer["error"]["param"] == "path"
        message = answer["error"]["message"]
    assert f"POST {path} is outside a capture path" in message
    assert FORM in message
    assert stack.sent == []  # never reached the engine
    metrics = await (await stack.client.get("/metrics")).text()
    assert _uncaptured_count(metrics, path) == 1
    # The capture path still works.
    if path == "/v1/chat/completions":
        assert (await stack.chat("r1", CHAT)).status == 200


@pytest.mark.parametrize(
    ("tail", "shape"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/responses", "openai"),
        ("/v1/messages", "anthropic"),
    ],
)
@pytest.mark.parametrize(
    "segment", ["training-tokens-capture", "capture", "training_token_capture"]
)
async def test_a_misspelt_capture_segment_is_a_404_in_the_apis_shape(
    stack: Stack, segment, tail, shape
):
    resp = await stack.client.post(f"/ng-rollout/r1/{segment}{tail}", json=CHAT)
    assert resp.status == 404
    assert resp.content_type == "application/json"
    answer = await resp.json()
    if shape == "anthropic":
        assert answer["type"] == "error"
        assert answer["error"]["type"] == "not_found_error"
    else:
        assert answer["error"]["code"] == "capture_path_not_found"
        assert answer["error"]["param"] == "path"
    message = answer["error"]["message"]
    assert f"'{segment}' is not 'training-token-capture'" in message
    assert FORM in message
    assert stack.sent == []


def _uncaptured_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "outside a capture path" in r.getMessage()
    ]


async def test_a_generation_call_on_the_correlation_path_is_warned_once_and_counted(
    stack: Stack, caplog
):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    for rollout in ("r1", "r2", "r1"):
        resp = await stack.client.post(f"/ng-rollout/{rollout}/v1/chat/completions", json=CHAT)
        assert resp.status == 200, await resp.text()
    assert len(stack.sent) == 3
    assert stack.sent[0].request_headers["X-NG-Rollout-Id"] == "r1"
    warnings = _uncaptured_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "POST /ng-rollout/<rollout_id>/v1/chat/completions (the correlation path) is a "
        "generation call outside a capture path: forwarded uncaptured"
    )
    assert FORM in warnings[0]
    metrics = await (await stack.client.get("/metrics")).text()
    assert _uncaptured_count(metrics, "/v1/chat/completions") == 3
    # The plain path's warning is its own.
    assert (await stack.client.post("/v1/chat/completions", json=CHAT)).status == 200
    assert len(_uncaptured_warnings(caplog)) == 2
    # Not a generation call: correlated, neither warned nor counted.
    resp = await stack.client.get("/ng-rollout/r1/v1/models")
    assert resp.status == 200
    resp = await stack.client.post("/ng-rollout/r1/tokenize", json={"prompt": "hi"})
    assert resp.status == 200
    assert len(_uncaptured_warnings(caplog)) == 2
    metrics = await (await stack.client.get("/metrics")).text()
    assert _uncaptured_count(metrics, "/v1/chat/completions") == 4
    assert "/v1/models" not in metrics and "/tokenize" not in metrics
    assert (await stack.get_json("/captures/rollouts"))["rollouts"] == []


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/ng-rollout/r1/v1/chat/completions", CHAT, "openai"),
        ("/ng-rollout/r1/v1/responses", {"model": "scripted-qwen", "input": "hi"}, "openai"),
        ("/ng-rollout/r1/v1/messages", MESSAGES, "anthropic"),
        ("/ng-rollout/r1/v1/completions", {"model": "scripted-qwen", "prompt": "hi"}, "openai"),
        ("/ng-rollout/r1/generate", {"token_ids": [1, 2]}, "openai"),
    ],
)
async def test_refuse_setting_refuses_the_correlation_paths_generation_calls(
    make_stack: MakeStack, path, body, shape
):
    stack = await make_stack(uncaptured_generation="refuse")
    resp = await stack.client.post(path, json=body)
    assert resp.status == 400
    answer = await resp.json()
    if shape == "anthropic":
        assert answer["type"] == "error"
    else:
        assert answer["error"]["code"] == "capture_path_required"
    message = answer["error"]["message"]
    assert f"POST {path} is outside a capture path (the correlation path" in message
    assert FORM in message
    assert stack.sent == []
    metrics = await (await stack.client.get("/metrics")).text()
    assert _uncaptured_count(metrics, path.removeprefix("/ng-rollout/r1")) == 1
    # Non-generation requests on the correlation path are still forwarded.
    assert (await stack.client.get("/ng-rollout/r1/v1/models")).status == 200


@pytest.mark.parametrize("refuse", [False, True])
async def test_a_base_url_without_its_rollout_id_says_so(make_stack: MakeStack, caplog, refuse):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    stack = await make_stack(uncaptured_generation="refuse" if refuse else "forward")
    path = "/ng-rollout/training-token-capture/v1/chat/completions"
    resp = await stack.client.post(path, json=CHAT)
    (warning,) = _uncaptured_warnings(caplog)
    assert warning.startswith(
        f"POST {path} (the path has no rollout id before training-token-capture) is a "
        "generation call outside a capture path"
    )
    metrics = await (await stack.client.get("/metrics")).text()
    assert _uncaptured_count(metrics, "/v1/chat/completions") == 1
    if not refuse:
        assert resp.status == 200, await resp.text()
        return
    assert resp.status == 400
    message = (await resp.json())["error"]["message"]
    assert "the path has no rollout id before training-token-capture" in message
    assert FORM in message
    assert stack.sent == []


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/ng-rollout/r1/training-token-capture/v1/chat/completions", "openai"),
        ("/ng-rollout/r1/training-token-capture/v1/messages", "anthropic"),
        ("/ng-rollout/r1/v1/responses", "openai"),
    ],
)
async def test_a_read_only_server_says_it_is_read_only_on_a_rollout_path(
    tmp_path, aiohttp_client, path, shape
):
    from capture_proxy.app import build_read_only_app
    from capture_proxy.config import Settings
    from capture_proxy.store.sqlite import SQLiteStore

    settings = Settings(backend="http://no-backend.invalid", store=tmp_path / "ro")
    client = await aiohttp_client(build_read_only_app(settings, SQLiteStore(tmp_path / "ro")))
    resp = await client.post(path, json=CHAT)
    assert resp.status == 403
    answer = await resp.json()
    if shape == "anthropic":
        assert answer["type"] == "error"
        assert answer["error"]["type"] == "permission_error"
    else:
        assert answer["error"]["code"] == "read_only"
        assert answer["error"]["param"] == "path"
    message = answer["error"]["message"]
    assert f"POST {path}: this server is read-only (serve --read-only)" in message
    assert "capture-proxy serve --backend ENGINE_URL --store DIR" in message
