"""Tokens-in endpoints of the scripted engine: vLLM ``/v1/completions`` (token-id prompts),
vLLM ``/inference/v1/generate`` (only with ``enable_scale_out``) and SGLang ``/generate``.

Owns: the wire shapes of those three dialects, turning a prompt of token ids back into a
conversation (decode, then the family reads it: ``chatml`` for our ChatML + Hermes layout) so
the same policy / responder as ``/v1/chat/completions`` answers it, and the stop / length /
detokenisation rules of each engine. The generated ids and log probs are those of
``generation.generate`` for the same conversation, so chat and tokens-in answers agree.
Must not: render chat templates (the prompt is given) or load the tokenizer.

- ``tokens_out``: one generation cut by an engine's stop rules (``TokensOut``);
- ``wire``: the shared field reads, errors, JSON and SSE responses;
- ``vllm``: ``/v1/completions`` and ``/inference/v1/generate``; ``sglang``: ``/generate``;
- ``routes``: ``add_tokens_in_routes``.
"""
