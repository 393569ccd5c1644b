"""Answer generated texts and build constraints exactly as vLLM's chat serving does, per
``tool_choice``: the tool-choice goldens' oracle.

Run with the Python of a vLLM install (``scripts/parser-goldens`` uses ``.cache/vllm-venv``):

    python tests/support/vllm_tool_choice_oracle.py CASES.json TOKENIZERS.json OUT_DIR

``CASES.json``: ``tests.support.tool_choice_cases`` output. ``TOKENIZERS.json``: ``{tokenizer
name: HF tokenizer directory}``.

Answers: for each serving (``vllm serve --enable-auto-tool-choice --tool-call-parser T
[--reasoning-parser R]``), generated text and request shape, vLLM's own
``OpenAIServingChat.chat_completion_full_generator`` and ``chat_completion_stream_generator``
(``entrypoints/openai/chat_completion/serving.py``) run on an engine output made of the text
(finish reason ``stop``), on a serving object holding only what those two read (the composed
parser class, ``enable_auto_tools``, the response role; no engine, no model config: tool-call
ids ``random``). The stream is fed one token at a time, as an incremental detokenizer gives
the text (``vllm_parser_oracle._pieces``), and joined as a client joins it. Each answer is
``{"content", "reasoning", "tool_calls": [{"name", "arguments"}], "finish_reason"}``.

Constraints: the request after ``Parser.adjust_request`` (which
``renderers/online_renderer.py`` calls when the request's ``tool_choice`` is not ``none`` or
the serving has a reasoning parser): its ``structured_outputs`` (the dataclass's set fields),
for every tool list and request shape (the request asks for no structured output itself).

Writes ``OUT_DIR/<serving>.json`` (``{"vllm_version", "tool_parser", "reasoning_parser",
"families", "tools", "choices", "cases": {name: {"text", "chat_template_kwargs",
"in_reasoning", "answers": {choice: {"whole", "streamed"}}}}}``) and
``OUT_DIR/constraints.json`` (``{"vllm_version", "servings": {serving: {tools name: {choice:
structured_outputs}}}, "tools", "choices"}``). Imports nothing of
capture_proxy (vLLM's venv does not have it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import vllm
from transformers import AutoTokenizer
from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.parser.parser_manager import ParserManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_parser_oracle import PROMPTS, _pieces  # noqa: E402


def _serving(parser_cls: Any, reasoning_parser: str | None) -> OpenAIServingChat:
    """A chat serving holding only what its two answer generators read."""
    s = object.__new__(OpenAIServingChat)
    s.parser_cls = parser_cls
    s.enable_auto_tools = True
    s.response_role = "assistant"
    s.model_config = None
    s.system_fingerprint = None
    s._include_reasoning_tokens_details = bool(reasoning_parser)
    s.enable_prompt_tokens_details = False
    s.enable_per_request_metrics = False
    s.enable_force_include_usage = False
    s.enable_log_outputs = False
    s.enable_log_deltas = False
    s.request_logger = None
    s.chat_template = None
    s.chat_template_content_format = "auto"
    s.default_chat_template_kwargs = {}
    return s


def _request(fields: dict[str, Any], tools: Any, kwargs: Any, stream: bool) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body.update({k: v for k, v in fields.items() if k != "tools"})
    if fields.get("tools"):
        body["tools"] = tools
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return ChatCompletionRequest(**body)


def _output(text: str, ids: list[int], finish: str | None) -> CompletionOutput:
    return CompletionOutput(
        index=0,
        text=text,
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish,
        stop_reason=None,
    )


def _result(prompt: list[int], output: CompletionOutput, finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=prompt,
        prompt_logprobs=None,
        outputs=[output],
        finished=finished,
    )


async def _gen(items: list[RequestOutput]) -> Any:
    for item in items:
        yield item


def whole(serving: Any, tok: Any, request: Any, text: str, prompt: list[int]) -> dict[str, Any]:
    ids = tok.encode(text, add_special_tokens=False)
    kwargs = request.chat_template_kwargs or {}
    parser = serving._make_parser(request, tok, kwargs)
    response = asyncio.run(
        serving.chat_completion_full_generator(
            request,
            _gen([_result(prompt, _output(text, ids, "stop"), True)]),
            "r",
            "m",
            [],
            tok,
            RequestResponseMetadata(request_id="r"),
            parser=parser,
        )
    )
    choice = response.choices[0]
    msg = choice.message
    return {
        "content": msg.content,
        "reasoning": msg.reasoning,
        "tool_calls": [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in msg.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
    }


def streamed(serving: Any, tok: Any, request: Any, text: str, prompt: list[int]) -> dict[str, Any]:
    ids = tok.encode(text, add_special_tokens=False)
    pieces = _pieces(tok, ids) or [("", [])]
    results = [
        _result(prompt, _output(t, i, "stop" if n == len(pieces) - 1 else None), False)
        for n, (t, i) in enumerate(pieces)
    ]

    async def run() -> list[str]:
        out = []
        async for event in serving.chat_completion_stream_generator(
            request,
            _gen(results),
            "r",
            "m",
            [],
            tok,
            RequestResponseMetadata(request_id="r"),
            chat_template_kwargs=request.chat_template_kwargs or {},
        ):
            out.append(event)
        return out

    content, reasoning, finish = "", None, None
    calls: dict[int, dict[str, str]] = {}
    for event in asyncio.run(run()):
        data = event.removeprefix("data: ").strip()
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            if delta.get("reasoning"):
                reasoning = (reasoning or "") + delta["reasoning"]
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
    }


def constraint(parser_cls: Any, tok: Any, request: Any, has_reasoning: bool) -> Any:
    """The engine request's ``structured_outputs`` after the serving's ``adjust_request``
    (its set fields; None: none)."""
    if request.tool_choice != "none" or has_reasoning:
        request = parser_cls(tok, request.tools, chat_template_kwargs={}).adjust_request(request)
    so = request.structured_outputs
    fields = None
    if so is not None:
        fields = {
            k: getattr(so, k)
            for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(so, k) is not None
        }
    return fields


def _parser_cls(spec: dict[str, Any], tok: Any) -> Any:
    return ParserManager.get_parser(
        tool_parser_name=spec["tool_parser"],
        reasoning_parser_name=spec["reasoning_parser"],
        enable_auto_tools=True,
        tokenizer=tok,
    )


def main(argv: list[str]) -> None:
    data = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    tokenizers = json.loads(Path(argv[2]).read_text(encoding="utf-8"))
    out_dir = Path(argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    choices: dict[str, Any] = data["choices"]
    constraints: dict[str, Any] = {}
    for serving_name, spec in data["servings"].items():
        tok = AutoTokenizer.from_pretrained(tokenizers[spec["tokenizer"]])
        parser_cls = _parser_cls(spec, tok)
        serving = _serving(parser_cls, spec["reasoning_parser"])
        cases: dict[str, Any] = {}
        tools = None
        for name, case in data["cases"][serving_name].items():
            tools = case["tools"]
            kwargs = case.get("chat_template_kwargs")
            prompt_text = PROMPTS[spec["tokenizer"]]
            if case.get("in_reasoning"):
                prompt_text += "<think>\n"
            elif (kwargs or {}).get("enable_thinking") is False:
                prompt_text += "<think>\n\n</think>\n\n"
            prompt = tok.encode(prompt_text, add_special_tokens=False)
            answers = {}
            for choice, fields in choices.items():
                answers[choice] = {
                    "whole": whole(
                        serving, tok, _request(fields, tools, kwargs, False), case["text"], prompt
                    ),
                    "streamed": streamed(
                        serving, tok, _request(fields, tools, kwargs, True), case["text"], prompt
                    ),
                }
            cases[name] = {
                "text": case["text"],
                "chat_template_kwargs": kwargs,
                "in_reasoning": bool(case.get("in_reasoning")),
                "answers": answers,
            }
        golden = {
            "vllm_version": vllm.__version__,
            "tool_parser": spec["tool_parser"],
            "reasoning_parser": spec["reasoning_parser"],
            "families": spec["families"],
            "served_as": spec["served_as"],
            "tools": tools,
            "choices": choices,
            "cases": cases,
        }
        path = out_dir / f"{serving_name}.json"
        path.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"{path}: {len(cases)} cases x {len(choices)} request shapes", file=sys.stderr)
        constraints[serving_name] = {
            tools_name: {
                choice: constraint(
                    parser_cls,
                    tok,
                    _request(fields, tool_list, None, False),
                    spec["reasoning_parser"] is not None,
                )
                for choice, fields in choices.items()
                if fields.get("tools")
            }
            for tools_name, tool_list in data["constraint_tools"].items()
        }
    path = out_dir / "constraints.json"
    path.write_text(
        json.dumps(
            {
                "vllm_version": vllm.__version__,
                "servings": constraints,
                "tools": data["constraint_tools"],
                "choices": choices,
            },
            ensure_ascii=False,
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"{path}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
