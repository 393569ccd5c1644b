"""The command line's refusals: each is one line on stderr naming the problem and an exit code
(2: the command cannot run on this input; 1: it ran and failed), never a traceback, and a
refused ``export-tokenizer`` writes nothing."""

import asyncio
import json
import socket

import pytest
from aiohttp import web

from capture_proxy.cli import main

NOT_A_TARGET = "the target must be a new or empty directory (nothing is overwritten)"


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    return captured.err.rstrip("\n")


def test_export_tokenizer_refuses_an_existing_file_and_leaves_it_alone(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("hello\n")
    assert main(["export-tokenizer", str(target)]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy export-tokenizer: {target} exists and is not a directory: {NOT_A_TARGET}"
    )
    assert target.read_text() == "hello\n"


def test_export_tokenizer_refuses_a_directory_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["export-tokenizer", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy export-tokenizer: {tmp_path} is a directory that is not empty: "
        f"{NOT_A_TARGET}"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_export_tokenizer_writes_into_an_empty_directory(tmp_path, capsys):
    assert main(["export-tokenizer", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (
        f"wrote the scripted engine's Qwen tokenizer (keep_reasoning) to {tmp_path}\n"
    )
    assert {p.name for p in tmp_path.iterdir()} == {
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    }


@pytest.mark.parametrize(
    ("under", "reason"),
    [("afile", "Not a directory"), ("/proc", "No such file or directory")],
)
def test_export_tokenizer_to_a_path_that_cannot_be_made_says_so(tmp_path, capsys, under, reason):
    (tmp_path / "afile").write_text("hello\n")
    target = tmp_path / under / "x"
    assert main(["export-tokenizer", str(target)]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy export-tokenizer: cannot create {target}: {reason}"
    )
    assert (tmp_path / "afile").read_text() == "hello\n"


def test_export_tokenizer_with_a_missing_chat_template_writes_nothing(tmp_path, capsys):
    target = tmp_path / "tok"
    missing = tmp_path / "nope.jinja"
    assert main(["export-tokenizer", str(target), "--chat-template", str(missing)]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy export-tokenizer: cannot read --chat-template {missing}: "
        "No such file or directory"
    )
    assert not target.exists()


def test_export_tokenizer_help_says_what_it_refuses(capsys):
    with pytest.raises(SystemExit):
        main(["export-tokenizer", "--help"])
    assert "must not exist or be an empty directory" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("line", "kind"), [("[1, 2]", "an array"), ('"x"', "a string"), ("3", "a number")]
)
def test_replay_of_a_line_that_is_not_an_object_names_the_line(tmp_path, capsys, line, kind):
    recording = tmp_path / "bad.jsonl"
    # a blank line, then a request the replay skips (not a model call): the count still counts
    skipped = {"seq": 1, "path": "/v1/messages/count_tokens", "body": {}}
    recording.write_text("\n" + json.dumps(skipped) + "\n" + line + "\n")
    assert main(["replay", str(recording)]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy replay: {recording}:3: not a recorded request: {kind}, not a JSON object"
    )


def test_replay_of_a_line_whose_body_is_not_an_object_names_the_line(tmp_path, capsys):
    recording = tmp_path / "bad.jsonl"
    recording.write_text(json.dumps({"seq": 1, "body": [1], "response_raw": "{}"}) + "\n")
    assert main(["replay", str(recording)]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy replay: {recording}:1: not a recorded request: "
        "body is an array, not a JSON object"
    )


@pytest.mark.parametrize("rollout", ["../x", "a/b", ".hidden", ""])
def test_replay_refuses_a_rollout_id_the_proxy_would_refuse(fixtures_dir, capsys, rollout):
    log = fixtures_dir / "opencode" / "logs" / "02_step_limit_obeyed.jsonl"
    for proxy in ([], ["--proxy", "http://127.0.0.1:9"]):
        assert main(["replay", str(log), "--rollout", rollout, *proxy]) == 2
        reason = (
            "rollout id is empty"
            if not rollout
            else "rollout id must use only ASCII letters, digits, '.', '_', '-' and start "
            "with a letter or digit"
        )
        assert _one_error_line(capsys) == (
            f"capture-proxy replay: --rollout {rollout!r} is not a rollout id the proxy "
            f"accepts: {reason}"
        )


def test_replay_to_nothing_listening_says_it_cannot_reach_the_proxy(fixtures_dir, capsys):
    log = fixtures_dir / "opencode" / "logs" / "02_step_limit_obeyed.jsonl"
    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        assert main(["replay", str(log), "--proxy", url]) == 2
    error = _one_error_line(capsys)
    assert error.startswith(f"capture-proxy replay: cannot reach the proxy at {url}: ")
    assert "Connect call failed" in error


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "ftp://h/", "http://"])
def test_replay_refuses_a_proxy_that_is_not_an_http_url(fixtures_dir, capsys, url):
    log = fixtures_dir / "opencode" / "logs" / "02_step_limit_obeyed.jsonl"
    assert main(["replay", str(log), "--proxy", url]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy replay: --proxy {url!r} is not an http:// or https:// URL"
    )


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status)


async def test_replay_reports_the_proxys_error_answers_without_crashing(
    aiohttp_server, fixtures_dir, capsys
):
    # A proxy that refuses the rollout id (400 invalid_rollout_id) and then has no rollout to
    # read (404): the refusal is named, and the read's error answer is not read as a summary.
    async def refuse(request: web.Request) -> web.Response:
        return _error(400, "rollout id is odd", "invalid_rollout_id")

    async def missing(request: web.Request) -> web.Response:
        return _error(404, f"rollout {request.match_info['rid']} not found", "not_found")

    app = web.Application()
    app.router.add_post("/ng-rollout/{tail:.*}", refuse)
    app.router.add_get("/captures/rollouts/{rid}", missing)
    server = await aiohttp_server(app)
    log = fixtures_dir / "opencode" / "logs" / "02_step_limit_obeyed.jsonl"
    url = str(server.make_url("")).rstrip("/")
    # main runs its own event loop: in a thread, while this one serves the fake proxy
    argv = ["replay", str(log), "--proxy", url, "--rollout", "r1"]
    assert await asyncio.to_thread(main, argv) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.out == "replayed 7 requests: [400, 400, 400, 400, 400, 400, 400]\n"
    assert captured.err.splitlines() == [
        "capture-proxy replay: 7 of 7 requests were not answered 200; the first (seq 1): 400 "
        "invalid_rollout_id: rollout id is odd",
        "capture-proxy replay: GET /captures/rollouts/r1 answered 404 not_found: "
        "rollout r1 not found",
    ]


@pytest.mark.parametrize("flag", ["--policy", "--chat-template"])
def test_scripted_engine_with_a_missing_file_names_the_flag_and_file(tmp_path, capsys, flag):
    missing = tmp_path / "nope.json"
    assert main(["scripted-engine", flag, str(missing)]) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy scripted-engine: cannot read {flag} {missing}: No such file or directory"
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "root:x:0:0:root:/root:/bin/bash\n",
            "not JSON: Invalid JSON: expected value at line 1 column 1",
        ),
        ("[1, 2]", "not a policy: Input should be an object"),
        ('{"steps": 3}', "not a policy: steps: Input should be a valid array"),
        ('{"bogus": 1}', "not a policy: bogus: Extra inputs are not permitted"),
        (
            '{"a": 1, "b": 2, "c": 3, "d": 4}',
            "not a policy: a: Extra inputs are not permitted; b: Extra inputs are not "
            "permitted; c: Extra inputs are not permitted (and 1 more)",
        ),
    ],
)
def test_scripted_engine_with_a_bad_policy_names_the_file_and_the_problem(
    tmp_path, capsys, text, problem
):
    policy = tmp_path / "policy.json"
    policy.write_text(text)
    assert main(["scripted-engine", "--policy", str(policy)]) == 2
    assert _one_error_line(capsys) == f"capture-proxy scripted-engine: --policy {policy}: {problem}"


def test_demo_with_a_bad_policy_names_the_file(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    policy.write_text("[1, 2]")
    argv = ["demo", "--opencode", "no", "--store", str(tmp_path / "s"), "--policy", str(policy)]
    assert main(argv) == 2
    assert _one_error_line(capsys) == (
        f"capture-proxy demo: --policy {policy}: not a policy: Input should be an object"
    )
    assert not (tmp_path / "s").exists()


def test_scripted_engine_with_a_family_it_cannot_load_says_why(capsys):
    assert main(["scripted-engine", "--family", "llama3", "--port", "0"]) == 2
    assert _one_error_line(capsys).startswith(
        "capture-proxy scripted-engine: the llama3 family needs the model's tokenizer directory"
    )


def test_scripted_engine_on_a_busy_port_says_so(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["scripted-engine", "--port", str(port)]) == 2
    error = _one_error_line(capsys)
    assert error.startswith(f"capture-proxy scripted-engine: cannot listen on 127.0.0.1:{port}: ")
    assert error.endswith("address already in use")
