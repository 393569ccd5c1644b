"""Tier 2: lineage edges in the read API. An OpenCode-style session hands a sub-agent its task
through the ``task`` tool; the sub-agent's session (first user message = the tool input's
``prompt``) is its own chain, joined to the main chain by a ``spawned_by`` edge in
``GET .../chains``, the summary's counts, the Arrow export's ``lineage`` column, the npz
manifest, ATIF's ``subagent_trajectory_ref`` and the viewer's episode outline; both stores,
both prompt modes."""

from __future__ import annotations

import io
import json
import zipfile

import pyarrow as pa
import pytest

from capture_proxy.core.export import MANIFEST_KEY
from capture_proxy.core.lineage.messages import text_sha256
from capture_proxy.scripted_engine import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import ON_BOTH_STORES, MakeStack, Stack
from tests.proxy.test_capture import TOOLS
from tests.proxy.test_chains_rest import _echo

SUB_PROMPT = "Find every caller of parse_config and list them with file and line; edit nothing."
TASK_TOOL = {
    "type": "function",
    "function": {
        "name": "task",
        "description": "Start a sub-agent.",
        "parameters": {
            "type": "object",
            "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
        },
    },
}
POLICY = Policy.model_validate(
    {
        "steps": [
            {
                "content": "Delegating.",
                "tool_calls": [
                    {"name": "task", "arguments": {"description": "callers", "prompt": SUB_PROMPT}}
                ],
            },
            {"content": "The sub-agent found two callers."},
        ],
        "rules": [
            {
                "when_first_user_message_contains": "Find every caller of parse_config",
                "step": {"content": "src/a.py:3 and src/b.py:9."},
            }
        ],
    }
)


def _body(messages: list[dict]) -> dict:
    return {"model": "scripted-qwen", "messages": messages, "tools": [*TOOLS, TASK_TOOL]}


async def _episode(stack: Stack, rollout: str) -> tuple[list[str], str, str]:
    """Main call 1 (task tool), the sub-agent's call, main call 2. Returns (main call ids,
    the sub-agent's call id, the task tool call id)."""
    main = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Who calls it?"}]
    first = await stack.chat(rollout, _body(main))
    assert first.status == 200
    answer = (await first.json())["choices"][0]["message"]
    (tool_call,) = answer["tool_calls"]
    sub = await stack.chat(
        rollout,
        _body([{"role": "system", "content": "Sub."}, {"role": "user", "content": SUB_PROMPT}]),
    )
    assert sub.status == 200
    report = (await sub.json())["choices"][0]["message"]["content"]
    main += [_echo(answer), {"role": "tool", "tool_call_id": tool_call["id"], "content": report}]
    second = await stack.chat(rollout, _body(main))
    assert second.status == 200
    ids = [first.headers["X-Capture-Call-Id"], second.headers["X-Capture-Call-Id"]]
    return ids, sub.headers["X-Capture-Call-Id"], tool_call["id"]


@ON_BOTH_STORES
@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_a_sub_agent_chain_is_spawned_by_the_main_chains_call(
    make_stack: MakeStack, prompt_mode: str
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode=prompt_mode
    )
    (main_1, main_2), sub, tool_call_id = await _episode(stack, "ep")
    edge = {
        "kind": "spawned_by",
        "chain_id": main_1,
        "from_call_id": main_1,
        "evidence": {
            "rule": "opencode.spawn_tool",
            "tool_name": "task",
            "tool_call_id": tool_call_id,
            "field": "prompt",
            "message_index": 1,  # request_messages[1]: after the system message
            "text_sha256": text_sha256(SUB_PROMPT),
            "num_chars": len(SUB_PROMPT),
        },
    }
    chains = await stack.get_json("/captures/rollouts/ep/chains")
    assert [
        (c["chain_id"], [x["call_id"] for x in c["calls"]], c["lineage"]) for c in chains["chains"]
    ] == [(main_1, [main_1, main_2], []), (sub, [sub], [edge])]
    summary = await stack.get_json("/captures/rollouts/ep")
    assert summary["lineage"] == {
        "spawned_by": 1,
        "forked_from": 0,
        "compacted_from": 0,
        "resumed_from": 0,
        "resumed_after_interrupt": 0,
        "retried_from": 0,
    }

    npz = await stack.client.get("/captures/rollouts/ep/chains?format=npz")
    with zipfile.ZipFile(io.BytesIO(await npz.read())) as archive:
        manifest = json.loads(archive.read("manifest.json"))
    assert manifest["lineage"] == {sub: [edge]}

    atif = await stack.get_json("/captures/rollouts/ep/atif")
    assert atif["extra"]["chain_id"] == main_1
    assert atif["extra"]["lineage"] == [{**edge, "to_chain_id": sub}]
    (result,) = atif["steps"][2]["observation"]["results"]
    assert result["source_call_id"] == tool_call_id
    assert result["subagent_trajectory_ref"] == [
        {
            "session_id": f"ep/{sub}",
            "extra": {"chain_id": sub, "kind": "spawned_by", "evidence": edge["evidence"]},
        }
    ]

    page = await stack.client.get("/captures/ui/rollouts/ep")
    html = await page.text()
    assert page.status == 200 and '<table class="grid tree" id="episode">' in html
    assert f'<tr data-chain="{sub}" data-depth="1">' in html
    assert f'<tr data-chain="{main_1}" data-depth="0">' in html
    assert 'data-kind="spawned_by" title="opencode.spawn_tool"' in html

    assert (await stack.client.post("/captures/rollouts/ep/freeze")).status == 200
    resp = await stack.client.get("/captures/export")
    reader = pa.ipc.open_stream(io.BytesIO(await resp.read()))
    item = reader.read_next_batch_with_custom_metadata()
    rows = item.batch.to_pylist()
    assert json.loads(item.custom_metadata[MANIFEST_KEY.encode()])["lineage"] == {sub: [edge]}
    assert {r["chain_id"]: json.loads(r["lineage"]) for r in rows} == {main_1: [], sub: [edge]}
