"""Tokens-in dialects of the scripted engine: vLLM /v1/completions, vLLM
/inference/v1/generate and SGLang /generate answer a token-id prompt with exactly the tokens
and log probs /v1/chat/completions gives for the same conversation."""

import json

import pytest

from capture_proxy.families.qwen_vocab import IM_END_ID
from capture_proxy.families.vllm_messages import normalise_tools
from capture_proxy.scripted_engine import (
    SENT_CALLS,
    ScriptedEngineConfig,
    build_scripted_engine_app,
)
from capture_proxy.scripted_engine.chatml import parse_chatml
from capture_proxy.scripted_engine.families import QWEN_SPECIAL_IDS as SPECIAL_IDS
from tests.scripted_engine.test_app import FIRST, POLICY, TOOLS, body, post

SECOND_TOOLS = [
    *FIRST,
    {
        "role": "assistant",
        "content": "Let me read it.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read", "arguments": '{"filePath": "café/é.txt"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "file text ꙮ"},
]


@pytest.fixture
def make_client(aiohttp_client, qwen_tokenizer):
    async def make(**kw):
        config = ScriptedEngineConfig(policy=POLICY, **kw)
        return await aiohttp_client(build_scripted_engine_app(config, tokenizer=qwen_tokenizer))

    return make


async def prompt_ids(client, messages, tools=TOOLS):
    payload = {"messages": messages, "add_generation_prompt": True}
    if tools:
        payload["tools"] = tools
    resp = await client.post("/tokenize", json=payload)
    assert resp.status == 200
    return (await resp.json())["tokens"]


async def chat_answer(client, messages):
    out = await post(client, body(messages))
    choice = out["choices"][0]
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    return out["prompt_token_ids"], choice["token_ids"], lps


async def sse(resp):
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    text = await resp.text()
    assert text.endswith("data: [DONE]\n\n")
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [json.loads(e) for e in events[:-1]]


def visible_text(tok, ids):
    return tok.decode([t for t in ids if t != IM_END_ID], skip_special_tokens=True)


def test_parse_chatml_recovers_roles_tools_and_calls(qwen_tokenizer):
    text = qwen_tokenizer.apply_chat_template(
        SECOND_TOOLS + [{"role": "tool", "content": "more"}],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    messages, tools = parse_chatml(text)
    assert tools == TOOLS
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Be brief." and messages[3]["content"] == "file text ꙮ"
    call = messages[2]["tool_calls"][0]["function"]
    assert call == {"name": "read", "arguments": '{"filePath": "café/é.txt"}'}
    assert messages[2]["content"] == "Let me read it."
    plain, no_tools = parse_chatml("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert plain == [{"role": "user", "content": "hi"}] and no_tools is None


@pytest.mark.parametrize("messages", [FIRST, SECOND_TOOLS], ids=["first", "after_tool"])
async def test_completions_match_chat(make_client, qwen_tokenizer, messages):
    client = await make_client()
    chat_prompt, chat_ids, chat_lps = await chat_answer(client, messages)
    prompt = await prompt_ids(client, messages)
    assert prompt == chat_prompt
    resp = await client.post(
        "/v1/completions",
        json={
            "model": "scripted-qwen",
            "prompt": prompt,
            "max_tokens": 1000,
            "logprobs": 0,
            "return_token_ids": True,
            "temperature": 1.0,
            "seed": 7,
        },
    )
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    choice = out["choices"][0]
    assert choice["token_ids"] == chat_ids and choice["token_ids"][-1] == IM_END_ID
    assert choice["prompt_token_ids"] == prompt
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == chat_lps
    assert lp["tokens"] == [qwen_tokenizer.decode([t]) for t in chat_ids]
    assert all(len(d) == 1 for d in lp["top_logprobs"])
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["text"] == visible_text(qwen_tokenizer, chat_ids)
    assert "<tool_call>" in choice["text"] or messages is SECOND_TOOLS
    assert out["usage"] == {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + len(chat_ids),
        "completion_tokens": len(chat_ids),
        "prompt_tokens_details": None,
    }
    sent = client.app[SENT_CALLS][-1]
    assert (sent.prompt_token_ids, sent.generation_token_ids) == (prompt, chat_ids)
    assert sent.generation_log_probs == chat_lps and sent.finish_reason == "stop"


async def test_completions_stream_concatenates_to_non_stream(make_client):
    client = await make_client()
    prompt = await prompt_ids(client, SECOND_TOOLS)
    req = {"prompt": prompt, "max_tokens": 500, "logprobs": 2, "return_token_ids": True}
    full = (await (await client.post("/v1/completions", json=req)).json())["choices"][0]
    chunks = await sse(
        await client.post(
            "/v1/completions",
            json={**req, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    *body_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(full["token_ids"])
    choices = [c["choices"][0] for c in body_chunks]
    assert all(c["object"] == "text_completion" for c in body_chunks)
    assert choices[0]["prompt_token_ids"] == prompt
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert sum((c["token_ids"] for c in choices), []) == full["token_ids"]
    assert "".join(c["text"] for c in choices) == full["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert sum((c["logprobs"][key] for c in choices), []) == full["logprobs"][key]
    # sampled + 1 alternative; decoded keys may collide (e.g. two partial UTF-8 tokens)
    assert {len(d) for d in full["logprobs"]["top_logprobs"]} == {1, 2}
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    assert choices[0]["logprobs"]["text_offset"] == [0]


async def test_completions_length_stop_strings_and_string_prompt(make_client, qwen_tokenizer):
    client = await make_client()
    prompt = await prompt_ids(client, FIRST)
    _, chat_ids, chat_lps = await chat_answer(client, FIRST)
    out = await (await client.post("/v1/completions", json={"prompt": prompt})).json()
    choice = out["choices"][0]  # default max_tokens is 16, as in vLLM
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 16
    assert choice["token_ids"] is None and choice["logprobs"] is None
    assert choice["text"] == qwen_tokenizer.decode(chat_ids[:16])
    req = {"prompt": prompt, "max_tokens": 3, "return_token_ids": True, "logprobs": 0}
    out = await (await client.post("/v1/completions", json=req)).json()
    assert out["choices"][0]["token_ids"] == chat_ids[:3]
    assert out["choices"][0]["logprobs"]["token_logprobs"] == chat_lps[:3]
    assert client.app[SENT_CALLS][-1].finish_reason == "length"
    # stop string: text cut before it, the token completing it is the last id
    stop = {"prompt": prompt, "max_tokens": 100, "stop": ["read it"], "return_token_ids": True}
    choice = (await (await client.post("/v1/completions", json=stop)).json())["choices"][0]
    assert choice["text"] == "Let me " and choice["stop_reason"] == "read it"
    assert (
        choice["finish_reason"] == "stop"
        and chat_ids[: len(choice["token_ids"])] == choice["token_ids"]
    )
    chunks = await sse(await client.post("/v1/completions", json={**stop, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Let me "
    # a string prompt is tokenized (special-token text included)
    text = qwen_tokenizer.decode(prompt)
    by_text = await (
        await client.post("/v1/completions", json={**req, "prompt": text, "max_tokens": 50})
    ).json()
    assert by_text["choices"][0]["prompt_token_ids"] == prompt


async def test_skip_special_tokens_false_keeps_no_stop_token_text(make_client, qwen_tokenizer):
    client = await make_client()
    prompt = await prompt_ids(client, FIRST)
    req = {"prompt": prompt, "max_tokens": 100, "skip_special_tokens": False}
    choice = (await (await client.post("/v1/completions", json=req)).json())["choices"][0]
    assert "<|im_end|>" not in choice["text"] and choice["text"].endswith("</tool_call>")
    assert IM_END_ID in SPECIAL_IDS and 151657 not in SPECIAL_IDS  # <tool_call> is not special


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 999999]}, "prompt"),
        ({"prompt": [[1, 2]]}, "prompt"),
        ({"prompt": [1, 2], "n": 2}, "n"),
        ({"prompt": [1, 2], "echo": True}, "echo"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "logprobs": True}, "logprobs"),
        ({"prompt": [1, 2], "logprobs": 21}, "logprobs"),
        ({"prompt": [1, 2], "stop": 3}, "stop"),
        ({"prompt": [1, 2], "max_tokens": 40000}, "max_tokens"),
    ],
)
async def test_completions_errors_are_openai_shaped(make_client, payload, param):
    client = await make_client()
    resp = await client.post("/v1/completions", json=payload)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"]
    assert client.app[SENT_CALLS] == []


async def test_inference_generate_needs_scale_out(make_client):
    client = await make_client()
    resp = await client.post("/inference/v1/generate", json={"token_ids": [1]})
    assert resp.status == 404


async def test_inference_generate_matches_chat(make_client):
    client = await make_client(enable_scale_out=True)
    _, chat_ids, chat_lps = await chat_answer(client, SECOND_TOOLS)
    prompt = await prompt_ids(client, SECOND_TOOLS)
    req = {"token_ids": prompt, "sampling_params": {"temperature": 0.7, "logprobs": 1}}
    resp = await client.post("/inference/v1/generate", json=req)
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    choice = out["choices"][0]
    assert choice["token_ids"] == chat_ids and choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert [e["logprob"] for e in content] == chat_lps
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat_ids]
    assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]
    assert out["usage"]["completion_tokens"] == len(chat_ids) and "request_id" in out
    chunks = await sse(
        await client.post(
            "/inference/v1/generate",
            json={**req, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    *parts, usage = chunks
    assert sum((c["choices"][0]["token_ids"] for c in parts), []) == chat_ids
    lps = [e["logprob"] for c in parts for e in c["choices"][0]["logprobs"]["content"]]
    assert (
        lps == chat_lps
        and usage["choices"] == []
        and usage["usage"]["prompt_tokens"] == len(prompt)
    )
    short = {"token_ids": prompt, "sampling_params": {"max_tokens": 2}}
    out = await (await client.post("/inference/v1/generate", json=short)).json()
    assert out["choices"][0]["token_ids"] == chat_ids[:2]
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["logprobs"] is None
    bad = await client.post("/inference/v1/generate", json={"token_ids": prompt})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "sampling_params"


async def test_sglang_generate_matches_chat(make_client, qwen_tokenizer):
    client = await make_client()
    _, chat_ids, chat_lps = await chat_answer(client, FIRST)
    prompt = await prompt_ids(client, FIRST)
    req = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 1000, "temperature": 1.0},
        "return_logprob": True,
        "rid": "r-1",
    }
    resp = await client.post("/generate", json=req)
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    assert out["output_ids"] == chat_ids and out["text"] == visible_text(qwen_tokenizer, chat_ids)
    meta = out["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "stop", "matched": IM_END_ID}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(chat_ids)
    assert meta["cached_tokens"] == 0 and meta["input_token_logprobs"] == []
    assert meta["output_token_logprobs"] == [
        [lp, t, None] for lp, t in zip(chat_lps, chat_ids, strict=True)
    ]
    # logprob_start_len and top logprobs; text in log probs
    detail = {**req, "logprob_start_len": len(prompt) - 2, "top_logprobs_num": 2}
    detail["return_text_in_logprobs"] = True
    meta = (await (await client.post("/generate", json=detail)).json())["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[-2:]
    assert meta["output_token_logprobs"][0][2] == qwen_tokenizer.decode([chat_ids[0]])
    assert len(meta["output_top_logprobs"]) == len(chat_ids)
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    # cumulative streaming (SGLang's default)
    chunks = await sse(await client.post("/generate", json={**req, "stream": True}))
    assert chunks[-1]["text"] == out["text"] and chunks[-1]["output_ids"] == chat_ids
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, len(chat_ids) + 1))
    assert all(chunks[i]["text"].startswith(chunks[i - 1]["text"]) for i in range(1, len(chunks)))
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert (
        chunks[-1]["meta_info"]["output_token_logprobs"]
        == out["meta_info"]["output_token_logprobs"]
    )
    sent = client.app[SENT_CALLS][-1]
    assert sent.stream and sent.generation_token_ids == chat_ids


async def test_sglang_incremental_stream_and_limits(make_client, qwen_tokenizer):
    client = await make_client(sglang_incremental_streaming=True)
    _, chat_ids, chat_lps = await chat_answer(client, FIRST)
    prompt = await prompt_ids(client, FIRST)
    req = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1000}, "return_logprob": True}
    full = await (await client.post("/generate", json=req)).json()
    chunks = await sse(await client.post("/generate", json={**req, "stream": True}))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == chat_ids
    lps = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert lps == full["meta_info"]["output_token_logprobs"]
    short = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
    out = await (await client.post("/generate", json=short)).json()
    assert out["output_ids"] == chat_ids[:4] and "output_token_logprobs" not in out["meta_info"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    stop = {"input_ids": prompt, "sampling_params": {"stop": "read", "max_new_tokens": 99}}
    out = await (await client.post("/generate", json=stop)).json()
    assert out["text"] == "Let me " and out["meta_info"]["finish_reason"]["matched"] == "read"
    stop["sampling_params"]["no_stop_trim"] = True
    out = await (await client.post("/generate", json=stop)).json()
    assert out["text"] == "Let me read"
    keep = {"input_ids": prompt, "sampling_params": {"no_stop_trim": True, "max_new_tokens": 99}}
    keep["sampling_params"]["skip_special_tokens"] = False
    out = await (await client.post("/generate", json=keep)).json()
    assert out["text"].endswith("</tool_call><|im_end|>")


@pytest.mark.parametrize(
    "payload",
    [
        {"sampling_params": {}},
        {"input_ids": [1, 2], "text": "hi"},
        {"input_ids": [1, 10**9]},
        {"input_ids": [1, 2], "logprob_start_len": 5, "return_logprob": True},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "x"}},
        {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": "x"}},
    ],
)
async def test_sglang_errors(make_client, payload):
    client = await make_client()
    resp = await client.post("/generate", json=payload)
    assert resp.status == 400
    err = await resp.json()
    assert set(err) == {"error"} and set(err["error"]) == {"message"} and err["error"]["message"]


async def test_responder_gets_parsed_messages(aiohttp_client, qwen_tokenizer):
    seen = []

    def responder(req):
        seen.append(req)
        return {"role": "assistant", "content": "Replayed."}

    config = ScriptedEngineConfig(responder=responder)
    client = await aiohttp_client(build_scripted_engine_app(config, tokenizer=qwen_tokenizer))
    prompt = await prompt_ids(client, SECOND_TOOLS)
    out = await (await client.post("/v1/completions", json={"prompt": prompt})).json()
    assert out["choices"][0]["text"] == "Replayed."
    assert [m["role"] for m in seen[0]["messages"]] == ["system", "user", "assistant", "tool"]
    # the tools as vLLM gives them to the template (missing description as null)
    assert seen[0]["tools"] == normalise_tools(TOOLS)
