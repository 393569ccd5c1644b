"""Renderers: a local tokenizer directory renders exactly as the (scripted) engine's template."""

import pytest

from capture_proxy.cli import main
from capture_proxy.families.base import RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.qwen_vocab import load_chat_template
from capture_proxy.families.vllm_messages import normalise_messages

MESSAGES = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command":"ls"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
]
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def test_exported_tokenizer_directory_renders_like_the_template(tmp_path, qwen_tokenizer):
    assert main(["export-tokenizer", str(tmp_path / "tok"), "--template", "drop_reasoning"]) == 0
    local = LocalRenderer.from_directory(tmp_path / "tok")
    reference = LocalRenderer(qwen_tokenizer, load_chat_template("drop_reasoning"))
    for gen in (True, False):
        ids = local.render_sync(MESSAGES, TOOLS, add_generation_prompt=gen)
        assert ids == reference.render_sync(MESSAGES, TOOLS, add_generation_prompt=gen)
    text = qwen_tokenizer.decode(local.render_sync(MESSAGES, TOOLS, add_generation_prompt=True))
    # vLLM parses argument strings before the template runs: tojson re-renders them.
    assert '{"name": "bash", "arguments": {"command": "ls"}}' in text


def test_missing_directory_is_a_render_error(tmp_path):
    with pytest.raises(RenderError, match="cannot load tokenizer"):
        LocalRenderer.from_directory(tmp_path / "nope")


def test_argument_strings_that_are_not_json_become_an_empty_object_as_in_vllm():
    # vLLM 0.32 coerces them (chat_utils._postprocess_messages) so the turn still renders.
    bad = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{"}}],
        }
    ]
    assert normalise_messages(bad)[0]["tool_calls"] == [
        {"id": "x", "function": {"name": "f", "arguments": {}}}
    ]


async def test_engine_renderer_sends_reasoning_as_vllm_reads_it(aiohttp_server):
    import aiohttp
    from aiohttp import web

    from capture_proxy.proxy.engine_render import EngineRenderer

    seen = []

    async def tokenize(request):
        seen.append(await request.json())
        return web.json_response({"tokens": [1, 2, 3]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        renderer = EngineRenderer(session, str(server.make_url("")).rstrip("/"))
        messages = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
        ]
        assert await renderer.render(messages, None, add_generation_prompt=False) == [1, 2, 3]
    assert seen == [
        {
            "messages": [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a", "reasoning": "r"},
            ],
            "add_generation_prompt": False,
        }
    ]
