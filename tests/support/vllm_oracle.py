"""Render conversations exactly as vLLM renders a chat-completions request: the goldens' oracle.

Run with the Python of a vLLM install (``scripts/render-goldens`` uses ``.cache/vllm-venv``):

    python tests/support/vllm_oracle.py CASES.json TEMPLATES.json OUT_DIR

``CASES.json``: ``tests.support.golden_cases`` output. ``TEMPLATES.json``: a list of
``{"name", "template", "tokenizer_dir", "end_of_turn_token"}`` (the jinja file and an HF
tokenizer directory), or ``{"name", "harmony": true}`` for gpt-oss, which vLLM renders with
openai-harmony, not with a template (below).
For each template and case it runs vLLM's own path, in process: ``ChatCompletionRequest``
validation (its message normalisation), ``tool.model_dump()`` for the tools,
``renderers.chat_utils.parse_chat_messages`` with the content format vLLM detects for the
template, ``renderers.hf.safe_apply_chat_template`` with the request's chat template kwargs,
then the tokenizer's encoding without added special tokens (vLLM's default for chat). A case
whose render vLLM refuses is written with its error. For a case that continues an assistant
turn (``turn_index``), the ids after that turn are kept too: after the n-th end-of-turn token,
n being the number of end-of-turn tokens in the render of the messages through the turn.

gpt-oss runs vLLM's harmony path in process, as its chat serving does for a model of type
``gpt_oss`` (``OnlineRenderer._make_request_with_harmony``): ``maybe_serialize_tool_calls``,
``extract_instructions_from_messages``, ``build_harmony_preamble`` (system message with the
conversation start date, developer message with the instructions and tools),
``parse_chat_inputs_to_harmony_messages`` and ``render_for_completion`` (analysis before the
last final message dropped, legacy tool-call headers). Its vocabulary, o200k_base, is read
from ``$TIKTOKEN_ENCODINGS_BASE`` (the copy capture-proxy converts from quicktok-v1; nothing
is downloaded), and the date is pinned with vLLM's own ``VLLM_SYSTEM_START_DATE``. The tail
after a continued turn starts after the turn's last harmony message (each rendered harmony
message ends with one of ``<|end|>``, ``<|call|>``, ``<|return|>``).

Writes ``OUT_DIR/<name>.json``: ``{"vllm_version", "template_sha256", "cases": {name:
{"prompt_sha256", "prompt_len", "prompt_text_sha256" (the template's text before
tokenizing), "prompt_token_ids" (small cases only), "tail_token_ids", "error"}}}``. It imports
nothing of capture_proxy (vLLM's venv does not have it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import vllm
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.renderers.chat_utils import parse_chat_messages
from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

#: cases at most this many tokens keep their whole ids in the golden
KEEP_IDS_UP_TO = 2048


def _model_config(model_type: str) -> Any:
    """What the render path reads of vLLM's ModelConfig for a text-only model."""
    return SimpleNamespace(
        multimodal_config=None,
        enable_prompt_embeds=False,
        hf_config=SimpleNamespace(model_type=model_type, use_unified_vision_chunk=False),
        revision=None,
        code_revision=None,
        tokenizer_revision=None,
        trust_remote_code=False,
        tokenizer="",
        model="",
    )


def _sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def render(
    tokenizer: Any,
    template: str,
    case: dict[str, Any],
    messages: list[Any],
    add_generation_prompt: bool,
) -> list[int]:
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if case.get("tools"):
        body["tools"] = case["tools"]
    request = ChatCompletionRequest.model_validate(body)
    tools = [t.model_dump() for t in request.tools] if request.tools else None
    config = _model_config("qwen3")
    content_format = resolve_chat_template_content_format(
        template, tools, "auto", tokenizer, model_config=config
    )
    conversation, _, _ = parse_chat_messages(request.messages, config, content_format)
    text = safe_apply_chat_template(
        config,
        tokenizer,
        conversation,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(case.get("chat_template_kwargs") or {}),
    )
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def golden(tokenizer: Any, template: str, case: dict[str, Any], eot_id: int) -> dict[str, Any]:
    try:
        text, ids = render(tokenizer, template, case, case["messages"], True)
    except Exception as exc:  # vLLM refuses: the golden says so
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {
        "prompt_sha256": _sha(ids),
        "prompt_len": len(ids),
        "prompt_text_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    if len(ids) <= KEEP_IDS_UP_TO:
        out["prompt_token_ids"] = ids
    j = case.get("turn_index")
    if j is not None:
        _, through = render(tokenizer, template, case, case["messages"][: j + 1], False)
        n = through.count(eot_id)
        seen = 0
        for pos, tid in enumerate(ids):
            if tid == eot_id:
                seen += 1
                if seen == n:
                    out["tail_token_ids"] = ids[pos + 1 :]
                    break
    return out


HARMONY_CLOSERS = ("<|end|>", "<|call|>", "<|return|>")


def harmony_messages(case: dict[str, Any], messages: list[Any]) -> tuple[list[Any], list[int]]:
    """vLLM's harmony messages for a chat request, and per message the index of the chat
    message it came from (-1: the preamble)."""
    from vllm.entrypoints.openai.parser import harmony_utils as hu
    from vllm.utils.mistral import mt

    body: dict[str, Any] = {"model": "m", "messages": messages}
    if case.get("tools"):
        body["tools"] = case["tools"]
    request = ChatCompletionRequest.model_validate(body)
    mt.maybe_serialize_tool_calls(request)
    chat = list(request.messages)
    instructions, rest = hu.extract_instructions_from_messages(chat)
    out = hu.build_harmony_preamble(
        instructions=instructions,
        tools=request.tools,
        reasoning_effort=request.reasoning_effort,
        with_custom_tools=True,
    )
    origin = [-1] * len(out)
    names: dict[str, str] = {}
    for m in rest:
        for call in m.get("tool_calls", []):
            names[call.get("id")] = call.get("function", {}).get("name")
    first = len(chat) - len(rest)
    for k, m in enumerate(rest):
        parsed = hu.parse_chat_input_to_harmony_message(m, names)
        out += parsed
        origin += [first + k] * len(parsed)
    return out, origin


def harmony_golden(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.parser import harmony_utils as hu

    try:
        msgs, origin = harmony_messages(case, case["messages"])
        ids = hu.render_for_completion(msgs)
    except Exception as exc:  # vLLM refuses: the golden says so
        return {"error": f"{type(exc).__name__}: {exc}"}
    text = hu.get_encoding().decode_utf8(ids)
    out: dict[str, Any] = {
        "prompt_sha256": _sha(ids),
        "prompt_len": len(ids),
        "prompt_text_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    if len(ids) <= KEEP_IDS_UP_TO:
        out["prompt_token_ids"] = ids
    j = case.get("turn_index")
    if j is not None:
        kept = {id(m) for m in hu.auto_drop_analysis_messages(msgs)}
        n = sum(1 for m, o in zip(msgs, origin, strict=True) if id(m) in kept and o <= j)
        enc = hu.get_encoding()
        closers = {enc.encode(t, allowed_special="all")[0] for t in HARMONY_CLOSERS}
        seen = 0
        for pos, tid in enumerate(ids):
            if tid in closers:
                seen += 1
                if seen == n:
                    out["tail_token_ids"] = ids[pos + 1 :]
                    break
    return out


def main_harmony(spec: dict[str, Any], cases: list[dict[str, Any]], out: Path) -> None:
    result = {
        "vllm_version": vllm.__version__,
        "renderer": f"vLLM's harmony path ({_version()})",
        "start_date": os.environ.get("VLLM_SYSTEM_START_DATE"),
        "end_of_turn_token": list(HARMONY_CLOSERS),
        "cases": {c["name"]: harmony_golden(c) for c in cases},
    }
    (out / f"{spec['name']}.json").write_text(
        json.dumps(result, ensure_ascii=False, indent=0), encoding="utf-8"
    )
    bad = sum("error" in g for g in result["cases"].values())
    print(f"vllm_oracle: {spec['name']}: {len(cases)} cases, {bad} refused", file=sys.stderr)


def _version() -> str:
    from importlib import metadata

    for dist in ("oss-harmony", "openai-harmony"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def main(cases_path: str, templates_path: str, out_dir: str) -> None:
    cases = json.loads(Path(cases_path).read_text(encoding="utf-8"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in json.loads(Path(templates_path).read_text(encoding="utf-8")):
        if spec.get("harmony"):
            main_harmony(spec, cases, out)
            continue
        template = Path(spec["template"]).read_text(encoding="utf-8")
        tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"], local_files_only=True)
        eot_id = tokenizer.convert_tokens_to_ids(spec["end_of_turn_token"])
        result = {
            "vllm_version": vllm.__version__,
            "template": Path(spec["template"]).name,
            "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            "end_of_turn_token": spec["end_of_turn_token"],
            "cases": {c["name"]: golden(tokenizer, template, c, eot_id) for c in cases},
        }
        (out / f"{spec['name']}.json").write_text(
            json.dumps(result, ensure_ascii=False, indent=0), encoding="utf-8"
        )
        bad = sum("error" in g for g in result["cases"].values())
        print(f"vllm_oracle: {spec['name']}: {len(cases)} cases, {bad} refused", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:4])
