"""A vLLM-dialect engine with a real Qwen tokenizer and a scripted policy, for tests and demos.

Modules: ``policy`` (the policy file and step choice; pure), ``generation`` (a scripted
message -> token ids, log probs and per-token stream events; pure), ``app`` (the aiohttp app).
Importing this package does not load the tokenizer.
"""

from capture_proxy.scripted_engine.app import (
    SENT_CALLS,
    ScriptedEngineConfig,
    SentCall,
    build_scripted_engine_app,
    run_scripted_engine,
)
from capture_proxy.scripted_engine.policy import Policy, Step, ToolCallSpec

__all__ = [
    "SENT_CALLS",
    "Policy",
    "ScriptedEngineConfig",
    "SentCall",
    "Step",
    "ToolCallSpec",
    "build_scripted_engine_app",
    "run_scripted_engine",
]
