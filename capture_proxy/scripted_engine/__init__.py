"""A vLLM-dialect engine with a real Qwen tokenizer and a scripted policy, for tests and demos.

Modules: ``policy`` (the policy file and step choice; pure), ``generation`` (a scripted
message -> token ids, log probs and per-token stream events; pure), ``faults`` (injected
misbehaviour), ``chatml`` (a rendered prompt read back into messages; pure), ``families``
(each model family's rendering and output), ``moe`` (routed experts), ``state`` (the options,
the app's state keys, ``SentCall`` and ``RequestError``), ``chat_request`` (a chat body's
validation and rendering), ``chat`` (``/v1/chat/completions``), ``service`` (``/tokenize``,
``/detokenize``, ``/v1/models``, ``/health``), ``tokens_in`` (token-id endpoints), ``app``
(the app built and run).
Importing this package does not load the tokenizer.
"""

from capture_proxy.scripted_engine.app import build_scripted_engine_app, run_scripted_engine
from capture_proxy.scripted_engine.faults import Faults
from capture_proxy.scripted_engine.policy import Policy, Step, ToolCallSpec
from capture_proxy.scripted_engine.state import (
    CLIENT_GONE,
    SENT_CALLS,
    ScriptedEngineConfig,
    SentCall,
)

__all__ = [
    "CLIENT_GONE",
    "SENT_CALLS",
    "Faults",
    "Policy",
    "ScriptedEngineConfig",
    "SentCall",
    "Step",
    "ToolCallSpec",
    "build_scripted_engine_app",
    "run_scripted_engine",
]
