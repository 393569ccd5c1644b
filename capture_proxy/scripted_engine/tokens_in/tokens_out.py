"""One tokens-in generation: the scripted answer to a prompt of token ids, cut by an engine's
stop rules (stop ids, stop strings, ``max_tokens``), with its cumulative texts.

Owns replaying the chat endpoint's scripted generation for the same conversation (decode the
prompt, the family reads it back) so chat and tokens-in answers agree, and the record of the
call in ``SENT_CALLS``. Must not: know any dialect's wire shape.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from capture_proxy.families.qwen_vocab import SPECIAL_START_ID
from capture_proxy.scripted_engine.continuations import continued_generation, remember_generation
from capture_proxy.scripted_engine.generation import Generation
from capture_proxy.scripted_engine.state import CONFIG, FAMILY, SENT_CALLS, SentCall


@dataclass(frozen=True)
class TokensOut:
    """One tokens-in generation after the engine's stop rules. ``texts[k]``: the output text
    after token ``k`` (cumulative, before stop-string trimming; incomplete UTF-8 held back);
    ``text``: the final text. ``matched``: the stop token id or string that ended it."""

    prompt: list[int]
    ids: list[int]
    log_probs: list[float]
    texts: list[str]
    text: str
    finish: str  # "stop" | "length" | "abort"
    matched: int | str | None

    def aborted(self, num_tokens: int) -> TokensOut:
        """The first ``num_tokens`` tokens only, finish ``"abort"`` (a pause in abort mode:
        vLLM ends the request with what it has)."""
        texts = self.texts[:num_tokens]
        return TokensOut(
            self.prompt,
            self.ids[:num_tokens],
            self.log_probs[:num_tokens],
            texts,
            texts[-1] if texts else "",
            "abort",
            None,
        )


def scripted_generation(app: web.Application, prompt: list[int]) -> Generation:
    """The full (untruncated) generation the chat endpoint would give for this prompt (the
    rest of an earlier one when ``prompt`` continues it)."""
    continued = continued_generation(app, prompt)
    if continued is not None:
        return continued
    gen = _fresh_generation(app, prompt)
    remember_generation(app, prompt, gen)
    return gen


def _fresh_generation(app: web.Application, prompt: list[int]) -> Generation:
    cfg, family = app[CONFIG], app[FAMILY]
    messages, tools = family.read_prompt(prompt)
    seed = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
    if cfg.responder is not None:
        body: dict[str, Any] = {"model": cfg.model_name, "messages": messages}
        if tools is not None:
            body["tools"] = tools
        return family.generate(cfg.responder(body), None, id_seed=seed, prompt=prompt)
    step = cfg.policy.choose(messages, tools is not None)
    return family.generate(
        step.assistant_message(seed),
        None,
        token_split=step.token_split,
        id_seed=seed,
        prompt=prompt,
    )


def run_generation(
    app: web.Application,
    prompt: list[int],
    *,
    max_tokens: int,
    stop: list[str],
    stop_token_ids: list[int],
    skip_special_tokens: bool,
    keep_stop: bool,
) -> TokensOut:
    """Sample (replay) the scripted tokens until ``<|im_end|>``, a stop token id, a stop string
    or ``max_tokens``. ``keep_stop``: keep the matched stop string / token text in the text
    (vLLM ``include_stop_str_in_output``, SGLang ``no_stop_trim``)."""
    family = app[FAMILY]
    gen = scripted_generation(app, prompt)
    special_ids, stop_ids = family.special_ids, family.stop_ids
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    ids: list[int] = []
    lps: list[float] = []
    texts: list[str] = []
    text, finish = "", "length"
    matched: int | str | None = None
    for e in gen.events:
        tid = e.token_id
        ids.append(tid)
        bare = app[CONFIG].faults.bare_logprob_at
        lps.append(bare[1] if bare is not None and bare[0] == len(ids) - 1 else e.logprob)
        shown = not (skip_special_tokens and tid in special_ids)
        if tid in stop_ids or tid in stop_token_ids:
            finish, matched = "stop", tid
            if keep_stop and shown:
                text += decoder.decode(family.token_bytes(tid))
            texts.append(text)
            break
        piece = decoder.decode(family.token_bytes(tid)) if shown else ""
        text += piece
        hit = _find_stop(text, len(text) - len(piece), stop)
        texts.append(text)
        if hit is not None:
            pos, s = hit
            finish, matched = "stop", s
            text = text[: pos + len(s)] if keep_stop else text[:pos]
            break
        if len(ids) >= max_tokens:
            text += decoder.decode(b"", final=True)
            texts[-1] = text
            break
    return TokensOut(prompt, ids, lps, texts, text, finish, matched)


def _find_stop(text: str, new_from: int, stop: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stop:
        pos = text.find(s, max(0, new_from - len(s) + 1))
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def record_call(app: web.Application, body: dict[str, Any], out: TokensOut, stream: bool) -> int:
    """Append the call to the app's ``SENT_CALLS`` (what tests compare against); its index."""
    app[SENT_CALLS].append(SentCall(body, out.prompt, out.ids, out.log_probs, stream, out.finish))
    return len(app[SENT_CALLS]) - 1


def record_abort(app: web.Application, index: int, cut: TokensOut) -> TokensOut:
    """The call at ``index`` of ``SENT_CALLS`` was aborted: it holds what was sent (``cut``)."""
    sent = app[SENT_CALLS][index]
    app[SENT_CALLS][index] = dataclasses.replace(
        sent,
        generation_token_ids=cut.ids,
        generation_log_probs=cut.log_probs,
        finish_reason=cut.finish,
    )
    return cut


def alternates(token_id: int, logprob: float, n: int) -> list[tuple[int, float]]:
    """The sampled token (ranked first, as the scripted model is greedy-like) and ``n - 1``
    deterministic alternatives, as the chat endpoint does."""
    return [(token_id, logprob)] + [
        ((token_id + j) % SPECIAL_START_ID, logprob - j) for j in range(1, n)
    ]
