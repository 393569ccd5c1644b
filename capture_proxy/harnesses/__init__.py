"""Drivers of agent sessions through the proxy, used by the demo, ``replay`` and the tests.

- ``opencode``, ``codex``, ``claude_code``: the real harnesses' CLIs (``_process``: running one).
- ``recorded``: a recorded harness session (the ``--record-dir`` format): read it, answer like
  it (for the scripted engine), replay it through a proxy.
"""
