"""The tokens-in endpoints' routes on the scripted engine's app.

Must not: handle a request (``vllm`` and ``sglang`` do).
"""

from __future__ import annotations

from aiohttp import web

from capture_proxy.scripted_engine.tokens_in.sglang import sglang_generate
from capture_proxy.scripted_engine.tokens_in.vllm import completions
from capture_proxy.scripted_engine.tokens_in.vllm_generate import inference_generate


def add_tokens_in_routes(app: web.Application, enable_scale_out: bool) -> None:
    """Register ``/v1/completions``, SGLang ``/generate`` and, with ``enable_scale_out``
    (vLLM's ``--enable-scale-out``), ``/inference/v1/generate`` (else 404, like vLLM)."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/generate", sglang_generate)
    if enable_scale_out:
        app.router.add_post("/inference/v1/generate", inference_generate)
