"""The concurrency sweep's tools: the fixed-length answer, chains of sessions sharing a rollout,
and the proxy's threads by role."""

import subprocess
import sys
import threading
from pathlib import Path

from benchmarks.cpu_sweep import answer_text, write_policy
from benchmarks.services import thread_cpu_s
from benchmarks.sessions import CallResult
from benchmarks.verification import chain_problems, session_chains
from capture_proxy.families.qwen_vocab import load_qwen_tokenizer
from capture_proxy.scripted_engine.generation import generate
from capture_proxy.scripted_engine.policy import Policy

ROOT = Path(__file__).resolve().parents[2]


def test_the_answer_is_exactly_the_asked_number_of_generation_tokens(tmp_path):
    tokenizer = load_qwen_tokenizer()
    for tokens in (3, 32, 40):
        gen = generate(tokenizer, {"role": "assistant", "content": answer_text(tokens)})
        assert len(gen.token_ids) == tokens
        assert gen.finish_reason == "stop"
    policy = Policy.load(write_policy(tmp_path, 32))
    messages = [{"role": "user", "content": "Task 1."}]
    assert policy.choose(messages, has_tools=True).content == answer_text(32)
    messages += [
        {"role": "assistant", "content": answer_text(32)},
        {"role": "user", "content": "Continue."},
    ]
    assert policy.choose(messages, has_tools=True).content == answer_text(32)


def _call(rollout: str, session: str, step: int, call_id: str, done: bool = True) -> CallResult:
    return CallResult(rollout, step, done=done, call_id=call_id, session_id=session)


def test_sessions_sharing_a_rollout_are_one_chain_each():
    results = [
        _call("r", "s1", 1, "b"),
        _call("r", "s2", 0, "c"),
        _call("r", "s1", 0, "a"),
        _call("r", "s2", 1, "d"),
        _call("q", "s3", 0, "e"),
        _call("q", "s3", 1, "f", done=False),
    ]
    want = session_chains(results, steps=2)
    assert want == {"r": [["c", "d"], ["a", "b"]]}  # in the order the sessions began

    def chain(*ids: str) -> dict:
        parents = [None, *ids[:-1]]
        return {
            "calls": [
                {"call_id": i, "parent_call_id": p} for i, p in zip(ids, parents, strict=True)
            ]
        }

    body = {"chains": [chain("c", "d"), chain("a", "b")], "unlinked_calls": []}
    assert chain_problems("r", want["r"], body) == []
    body = {"chains": [chain("a", "b", "c", "d")], "unlinked_calls": []}
    assert chain_problems("r", want["r"], body) == ["r: 1 chains are not the 2 sessions"]
    body = {"chains": [chain("a"), chain("c", "d")], "unlinked_calls": [{"call_id": "b"}]}
    assert chain_problems("r", want["r"], body) == [
        "r: 2 chains are not the 2 sessions",
        "r: 1 unlinked calls",
    ]


def test_named_threads_gives_python_thread_names_to_the_os_threads():
    code = (
        "import sys, threading, time, pathlib, os\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "import named_threads\n"
        "named_threads._name_os_threads()\n"
        "go = threading.Event()\n"
        "t = threading.Thread(target=go.wait, name='capture-store-writer'); t.start()\n"
        "tasks = pathlib.Path(f'/proc/{os.getpid()}/task').glob('*/comm')\n"
        "print(sorted(p.read_text().strip() for p in tasks)[0])\n"
        "go.set(); t.join()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "capture-store-w\n"


def test_thread_cpu_by_role_names_the_main_thread_and_the_others():
    go = threading.Event()
    t = threading.Thread(target=go.wait)
    t.start()
    try:
        roles = thread_cpu_s(__import__("os").getpid())
    finally:
        go.set()
        t.join()
    assert set(roles) == {"main", "other"}
    assert all(u >= 0 and s >= 0 for u, s in roles.values())
