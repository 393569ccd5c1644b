"""Parse generated texts exactly as vLLM's chat serving does: the output-parser goldens' oracle.

Run with the Python of a vLLM install (``scripts/parser-goldens`` uses ``.cache/vllm-venv``):

    python tests/support/vllm_parser_oracle.py CASES.json TOKENIZERS.json OUT_DIR

``CASES.json``: ``tests.support.parser_cases`` output (``{"servings", "cases"}``).
``TOKENIZERS.json``: ``{tokenizer name: HF tokenizer directory}`` for the servings' tokenizers.

For each serving (a tool-call parser and a reasoning parser, as ``vllm serve
--enable-auto-tool-choice --tool-call-parser T [--reasoning-parser R]`` composes them) and each
case, it runs vLLM's own parser objects in process, the way
``entrypoints/openai/chat_completion/serving.py`` does:

- whole: ``ParserManager.get_parser(...)`` composed class, one instance per request made with
  the request's tools and chat template kwargs, ``set_prompt_token_ids``, then
  ``parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)`` (the ids are the
  tokenizer's encoding of the text); the message is the serving's for ``tool_choice`` auto:
  content, reasoning and the tool calls' names and argument strings;
- streamed: a fresh instance fed one token at a time through ``parse_delta`` (delta text as an
  incremental detokenizer gives it: the decoded text's growth, held while it ends in an
  incomplete character), with the prompt ids of a one-user-message conversation
  (``<think>\\n`` appended when the case's prompt opened reasoning, Qwen3-2507 Thinking), and
  the deltas joined as a client joins them.

Writes ``OUT_DIR/<serving>.json``: ``{"vllm_version", "tool_parser", "reasoning_parser",
"families", "served_as", "cases": {name: {"text", "chat_template_kwargs", "in_reasoning",
"whole", "streamed", "deviation"?}}}`` with each answer as ``{"content", "reasoning",
"tool_calls": [{"name", "arguments"}]}`` (content and reasoning as vLLM sets them: a string or
null). Tools are not repeated per case: every case uses ``tests.support.parser_cases.AGENT_TOOLS``,
kept once as ``tools``. Imports nothing of capture_proxy (vLLM's venv does not have it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import vllm
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager

#: the prompt before the generation, per tokenizer: one user message and the generation prompt
PROMPTS = {
    "qwen3": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "qwen2_5": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def _request(case: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=case["tools"],
        chat_template_kwargs=case.get("chat_template_kwargs"),
    )


def _answer(content: Any, reasoning: Any, calls: list[dict[str, str]]) -> dict[str, Any]:
    return {"content": content, "reasoning": reasoning, "tool_calls": calls}


def whole(parser_cls: Any, tok: Any, case: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    request = _request(case)
    parser = parser_cls(tok, request.tools, chat_template_kwargs=request.chat_template_kwargs or {})
    parser.set_prompt_token_ids(prompt)
    ids = tok.encode(case["text"], add_special_tokens=False)
    reasoning, content, calls = parser.parse(
        case["text"], request, enable_auto_tools=True, model_output_token_ids=ids
    )
    return _answer(
        content, reasoning, [{"name": c.name, "arguments": c.arguments} for c in calls or []]
    )


def _pieces(tok: Any, ids: list[int]) -> list[tuple[str, list[int]]]:
    """(delta text, its token ids) as an incremental detokenizer emits them."""
    out: list[tuple[str, list[int]]] = []
    sent, pending = "", []
    for i, tid in enumerate(ids):
        pending.append(tid)
        text = tok.decode(ids[: i + 1], skip_special_tokens=False)
        if text.endswith("\ufffd") and i < len(ids) - 1:
            continue
        out.append((text[len(sent) :], pending))
        sent, pending = text, []
    return out


def streamed(parser_cls: Any, tok: Any, case: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    request = _request(case)
    parser = parser_cls(tok, request.tools, chat_template_kwargs=request.chat_template_kwargs or {})
    ids = tok.encode(case["text"], add_special_tokens=False)
    pieces = _pieces(tok, ids) or [("", [])]
    content, reasoning = "", None
    calls: dict[int, dict[str, str]] = {}
    for n, (text, piece_ids) in enumerate(pieces):
        delta = parser.parse_delta(
            text, piece_ids, request, prompt_token_ids=prompt, finished=n == len(pieces) - 1
        )
        if delta is None:
            continue
        content += delta.content or ""
        if delta.reasoning:
            reasoning = (reasoning or "") + delta.reasoning
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    return _answer(content, reasoning, [calls[i] for i in sorted(calls)])


def main(argv: list[str]) -> None:
    data = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    tokenizers = json.loads(Path(argv[2]).read_text(encoding="utf-8"))
    out_dir = Path(argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    for serving, spec in data["servings"].items():
        tok = AutoTokenizer.from_pretrained(tokenizers[spec["tokenizer"]])
        parser_cls = ParserManager.get_parser(
            tool_parser_name=spec["tool_parser"],
            reasoning_parser_name=spec["reasoning_parser"],
            enable_auto_tools=True,
            tokenizer=tok,
        )
        cases: dict[str, Any] = {}
        tools = None
        for name, case in data["cases"][serving].items():
            tools = case["tools"]
            prompt_text = PROMPTS[spec["tokenizer"]]
            if case.get("in_reasoning"):
                prompt_text += "<think>\n"
            elif (case.get("chat_template_kwargs") or {}).get("enable_thinking") is False:
                prompt_text += "<think>\n\n</think>\n\n"
            prompt = tok.encode(prompt_text, add_special_tokens=False)
            entry: dict[str, Any] = {
                "text": case["text"],
                "chat_template_kwargs": case.get("chat_template_kwargs"),
                "in_reasoning": bool(case.get("in_reasoning")),
                "whole": whole(parser_cls, tok, case, prompt),
                "streamed": streamed(parser_cls, tok, case, prompt),
            }
            if "deviation" in case:
                entry["deviation"] = case["deviation"]
            cases[name] = entry
        golden = {
            "vllm_version": vllm.__version__,
            "tool_parser": spec["tool_parser"],
            "reasoning_parser": spec["reasoning_parser"],
            "families": spec["families"],
            "served_as": spec["served_as"],
            "tools": tools,
            "cases": cases,
        }
        path = out_dir / f"{serving}.json"
        path.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"{path}: {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
