"""The scripted engine over HTTP: vLLM-shaped answers whose token data is exact."""

import json

import pytest

from capture_proxy.families.qwen_vocab import IM_END_ID
from capture_proxy.scripted_engine import (
    SENT_CALLS,
    Policy,
    ScriptedEngineConfig,
    build_scripted_engine_app,
)

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
POLICY = Policy.model_validate(
    {
        "title": "A title",
        "steps": [
            {
                "content": "Let me read it.",
                "tool_calls": [{"name": "read", "arguments": {"filePath": "café/é.txt"}}],
            },
            {
                "reasoning": "Two files: 𝔘𝔫𝔦.",
                "tool_calls": [
                    {"name": "read", "arguments": {"filePath": "a"}},
                    {"name": "bash", "arguments": {"command": "ls -la"}},
                ],
            },
            {"content": "Done: ꙮ café."},
        ],
        "final": "Nothing else.",
    }
)
FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read it"}]
FULL = {
    "return_token_ids": True,
    "logprobs": True,
    "top_logprobs": 0,
    "stream_options": {"include_usage": True},
}


@pytest.fixture
def make_client(aiohttp_client, qwen_tokenizer):
    async def make(**kw):
        config = ScriptedEngineConfig(policy=POLICY, **kw)
        return await aiohttp_client(build_scripted_engine_app(config, tokenizer=qwen_tokenizer))

    return make


def body(messages, stream=False, **extra):
    return {
        "model": "scripted-qwen",
        "messages": messages,
        "tools": TOOLS,
        "stream": stream,
        **FULL,
        **extra,
    }


async def post(client, payload):
    resp = await client.post("/v1/chat/completions", json=payload)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def stream_events(client, payload):
    resp = await client.post("/v1/chat/completions", json=payload)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    text = await resp.text()
    assert text.endswith("data: [DONE]\n\n")
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [json.loads(e) for e in events[:-1]]


def assemble(chunks):
    """Token ids, log-prob entries and the message spelled by a vLLM-style stream."""
    msg = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
    ids, lps, finish = [], [], None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            msg["tool_calls"] += [
                {k: v for k, v in t.items() if k != "index"} for t in d.get("tool_calls", [])
            ]
            ids += ch.get("token_ids") or []
            lps += (ch["logprobs"] or {}).get("content", [])
            finish = ch["finish_reason"] or finish
    return ids, lps, msg, finish


def same_message(streamed, message):
    return (
        streamed["content"] == (message["content"] or "")
        and streamed["reasoning_content"] == message.get("reasoning_content", "")
        and streamed["tool_calls"] == message["tool_calls"]
    )


async def test_non_streaming_answer_is_exact(make_client, qwen_tokenizer):
    client = await make_client()
    out = await post(client, body(FIRST))
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    choice = out["choices"][0]
    msg = choice["message"]
    assert msg["content"] == "Let me read it." and "reasoning_content" not in msg
    assert msg["tool_calls"][0]["function"] == {
        "name": "read",
        "arguments": '{"filePath": "café/é.txt"}',
    }
    assert msg["tool_calls"][0]["type"] == "function"
    assert choice["finish_reason"] == "tool_calls"
    ids = choice["token_ids"]
    assert ids[-1] == IM_END_ID and IM_END_ID not in ids[:-1]
    assert qwen_tokenizer.decode(ids).startswith("Let me read it.\n<tool_call>\n")
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert len(lps) == len(ids) and all(-5 < lp <= 0 for lp in lps)
    assert all(e["top_logprobs"] == [] for e in choice["logprobs"]["content"])
    tok = await (await client.post("/tokenize", json={"messages": FIRST, "tools": TOOLS})).json()
    assert out["prompt_token_ids"] == tok["tokens"] and tok["count"] == len(tok["tokens"])
    assert out["usage"] == {
        "prompt_tokens": tok["count"],
        "completion_tokens": len(ids),
        "total_tokens": tok["count"] + len(ids),
    }
    [sent] = client.app[SENT_CALLS]
    assert (sent.prompt_token_ids, sent.generation_token_ids) == (tok["tokens"], ids)
    assert sent.generation_log_probs == lps and sent.finish_reason == "tool_calls"
    assert not sent.stream


@pytest.mark.parametrize("step", [0, 1, 2])
async def test_stream_matches_non_stream(make_client, step):
    client = await make_client()
    history = [*FIRST] + [
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": "r"},
    ] * step
    whole = await post(client, body(history))
    chunks = await stream_events(client, body(history, stream=True))
    first, usage = chunks[0], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["prompt_token_ids"] == whole["prompt_token_ids"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    ids, lps, msg, finish = assemble(chunks[1:-1])
    choice = whole["choices"][0]
    assert ids == choice["token_ids"] == client.app[SENT_CALLS][1].generation_token_ids
    assert lps == choice["logprobs"]["content"]
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks[1:-1])
    assert same_message(msg, choice["message"]) and finish == choice["finish_reason"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]].count(finish) == 1
    assert client.app[SENT_CALLS][1].stream


async def test_stream_holds_back_partial_utf8_and_hides_tool_call_text(make_client):
    client = await make_client()
    history = [*FIRST, {"role": "assistant", "content": ""}, {"role": "tool", "content": "r"}]
    chunks = (await stream_events(client, body(history, stream=True)))[1:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all("\ufffd" not in json.dumps(d, ensure_ascii=False) for d in deltas)
    assert any(d == {} for d in deltas[2:10])  # a partial character: nothing shown yet
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [[t["index"] for t in c] for c in calls] == [[0], [1]]
    assert not any("content" in d for d in deltas)


async def test_prefix_property_end_to_end(make_client):
    """Each request's prompt starts with the previous prompt + generation (OpenCode-style
    history: content "" instead of null, arguments as strings, reasoning sent back)."""
    client = await make_client()
    messages, prev = [*FIRST], None
    for i in range(4):
        if i % 2 == 0:
            out = await post(client, body(messages))
            prompt, ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
            msg = out["choices"][0]["message"]
        else:
            chunks = await stream_events(client, body(messages, stream=True))
            ids, _, msg, _ = assemble(chunks[1:-1])
            prompt = chunks[0]["prompt_token_ids"]
        if prev is not None:
            assert prompt[: len(prev)] == prev
        prev = prompt + ids
        back = {"role": "assistant", "content": msg["content"] or ""}
        if msg.get("reasoning_content"):
            back["reasoning_content"] = msg["reasoning_content"]
        if msg["tool_calls"]:
            back["tool_calls"] = msg["tool_calls"]
        messages += [back] + [
            {"role": "tool", "tool_call_id": c["id"], "content": "ok é"} for c in msg["tool_calls"]
        ]
        if not msg["tool_calls"]:
            messages.append({"role": "user", "content": "Thanks"})
    finishes = [c.finish_reason for c in client.app[SENT_CALLS]]
    assert finishes == ["tool_calls", "tool_calls", "stop", "tool_calls"]


async def test_sse_fragments_reassemble(make_client):
    plain = await make_client()
    split = await make_client(sse_fragment_bytes=7)
    expected = await stream_events(plain, body(FIRST, stream=True))
    resp = await split.post("/v1/chat/completions", json=body(FIRST, stream=True))
    pieces = [data async for data, _ in resp.content.iter_chunks()]
    assert max(len(p) for p in pieces) <= 7 and len(pieces) > 10
    events = [e.removeprefix("data: ") for e in b"".join(pieces).decode().split("\n\n") if e]
    got = [json.loads(e) for e in events[:-1]]
    strip = [{k: v for k, v in c.items() if k not in ("id", "created")} for c in got]
    assert strip == [{k: v for k, v in c.items() if k not in ("id", "created")} for c in expected]


async def test_omit_token_ids_acts_like_plain_openai(make_client):
    client = await make_client(omit_token_ids=True)
    out = await post(client, body(FIRST))
    assert "prompt_token_ids" not in out and "token_ids" not in out["choices"][0]
    assert out["choices"][0]["logprobs"] is None
    chunks = await stream_events(client, body(FIRST, stream=True))
    assert all("prompt_token_ids" not in c for c in chunks)
    assert all(
        "token_ids" not in ch and ch["logprobs"] is None for c in chunks for ch in c["choices"]
    )
    assert chunks[-1]["usage"]["completion_tokens"] > 0  # usage is still honoured


async def test_max_tokens_truncates_with_length(make_client):
    client = await make_client()
    out = await post(client, body(FIRST, max_tokens=3))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 3
    assert choice["message"]["content"] == "Let me read" and choice["message"]["tool_calls"] == []
    ids, _, msg, finish = assemble(
        (await stream_events(client, body(FIRST, True, max_tokens=3)))[1:-1]
    )
    assert (ids, finish, msg["content"]) == (choice["token_ids"], "length", "Let me read")


async def test_top_logprobs_and_tokens_as_ids(make_client):
    client = await make_client()
    out = await post(client, body(FIRST, top_logprobs=2, return_tokens_as_token_ids=True))
    entries = out["choices"][0]["logprobs"]["content"]
    for tid, e in zip(out["choices"][0]["token_ids"], entries, strict=True):
        assert e["token"] == f"token_id:{tid}" and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]
    out = await post(client, body(FIRST, top_logprobs=None))
    assert out["choices"][0]["logprobs"] is None  # explicit null turns log probs off (vLLM)


async def test_side_request_gets_title_and_user_turn_restarts(make_client):
    client = await make_client()
    out = await post(client, {**body(FIRST), "tools": None})
    assert out["choices"][0]["message"]["content"] == "A title"
    assert out["choices"][0]["finish_reason"] == "stop"
    done = [*FIRST] + [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "r"}] * 3
    assert (await post(client, body(done)))["choices"][0]["message"]["content"] == "Nothing else."
    again = [*done, {"role": "user", "content": "more"}]
    assert (await post(client, body(again)))["choices"][0]["message"]["content"] == (
        "Let me read it."
    )


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": FIRST, "n": 2}, "n"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0"),
        ({"messages": FIRST, "max_tokens": 0}, "max_tokens"),
    ],
)
async def test_bad_requests_get_openai_errors(make_client, payload, param):
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=payload)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    resp = await client.post("/v1/chat/completions", data=b"{not json")
    assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]
    assert client.app[SENT_CALLS] == []


async def test_fail_status(make_client):
    client = await make_client(fail_status=503)
    resp = await client.post("/v1/chat/completions", json=body(FIRST))
    assert resp.status == 503
    assert (await resp.json())["error"]["type"] == "server_error"


async def test_tokenize_detokenize_models_health(make_client, qwen_tokenizer):
    client = await make_client()
    tok = await (await client.post("/tokenize", json={"prompt": "café 日本"})).json()
    assert tok["tokens"] == qwen_tokenizer.encode("café 日本") and tok["max_model_len"] == 32768
    detok = await (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
    assert detok == {"prompt": "café 日本"}
    chat = await (
        await client.post("/tokenize", json={"messages": FIRST, "add_generation_prompt": False})
    ).json()
    assert qwen_tokenizer.decode(chat["tokens"]).endswith("Read it<|im_end|>\n")
    assert chat["token_strs"][0] == "<|im_start|>"
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "scripted-qwen"
    assert (await client.get("/health")).status == 200
    assert (await client.post("/detokenize", json={"tokens": [-1]})).status == 400


@pytest.mark.parametrize("flags", [[], ["--enable-scale-out", "--dev-mode"]])
async def test_the_cli_flags_serve_generate_and_the_weight_endpoints(
    aiohttp_client, qwen_tokenizer, flags
):
    from capture_proxy.cli.engine import engine_config
    from capture_proxy.cli.parser import build_parser

    config = engine_config(build_parser().parse_args(["scripted-engine", *flags]))
    assert (config.enable_scale_out, config.dev_mode) == (bool(flags), bool(flags))
    client = await aiohttp_client(build_scripted_engine_app(config, tokenizer=qwen_tokenizer))
    generate = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    resp = await client.post("/inference/v1/generate", json=generate)
    weights = await client.get("/weight_info")
    if not flags:
        assert (resp.status, weights.status) == (404, 404)
        return
    assert (resp.status, weights.status) == (200, 200)
    choice = (await resp.json())["choices"][0]
    assert (choice["finish_reason"], len(choice["token_ids"])) == ("length", 2)
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 2}]
    assert await weights.json() == {"weight_version": "default"}
