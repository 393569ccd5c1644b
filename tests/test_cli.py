"""The command line: demo and replay run end to end; serve refuses bad settings clearly."""

import re

import pytest

from capture_proxy.cli import main


def test_demo_with_the_built_in_client(tmp_path, capsys):
    store = str(tmp_path / "store")
    assert main(["demo", "--opencode", "no", "--store", store]) == 0
    out = capsys.readouterr().out
    assert re.search(r"rollout demo-\d+: 4 calls, 2 chains, incomplete=False", out)
    assert "child of #2" in out and (tmp_path / "store" / "captures.sqlite3").exists()
    # The closing hint names commands that work without the demo's engine, which is gone.
    rollout = re.search(r"rollout (demo-\d+):", out)[1]
    assert f"capture-proxy show --store {store} {rollout}\n" in out
    assert f"capture-proxy serve --read-only --store {store}\n" in out
    assert "--backend" not in out
    assert main(["show", "--store", store, rollout]) == 0
    assert f"{rollout} complete  calls 4 · chains 2" in capsys.readouterr().out


def test_replay_of_a_recording(fixtures_dir, capsys):
    log = fixtures_dir / "opencode" / "logs" / "02_step_limit_obeyed.jsonl"
    assert main(["replay", str(log), "--rollout", "rec-2"]) == 0
    out = capsys.readouterr().out
    # The call after the step-limit note is refused by digest and linked to its deepest
    # token-exact ancestor: one agent chain beside the title root.
    assert "rollout rec-2: 7 calls, 2 chains, incomplete=False" in out
    assert "'links_refused': {'history_edited': 1}" in out


def test_serve_refuses_bad_settings(capsys):
    assert main(["serve", "--backend", "not a url"]) == 2
    assert "backend" in capsys.readouterr().err


def test_replay_of_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err == (
        f"capture-proxy replay: [Errno 2] No such file or directory: '{tmp_path}/nope.jsonl'\n"
    )


def test_serve_refuses_settings_that_cannot_run(tmp_path, capsys):
    base = ["serve", "--backend", "http://127.0.0.1:9", "--store", str(tmp_path / "s")]
    assert main([*base, "--log-level", "LOUD"]) == 2
    assert "log_level" in capsys.readouterr().err
    assert main([*base, "--tokenizer", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main([*base, "--prompt-mode", "exact_tokens", "--tokens-in", "vllm_generate"]) == 2
    assert "vllm_generate answers carry no text" in capsys.readouterr().err


def test_serve_on_a_busy_port_says_so_and_exits(tmp_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(
            [
                "serve",
                "--backend",
                "http://127.0.0.1:9",
                "--port",
                str(port),
                "--store",
                str(tmp_path / "s"),
            ]
        )
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_replay_of_an_empty_recording_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["replay", str(empty)]) == 2
    assert capsys.readouterr().err == f"capture-proxy replay: {empty} holds no recorded requests\n"


def test_serve_takes_backend_repeated_and_the_routing_key_flags(monkeypatch, tmp_path):
    from capture_proxy.cli.parser import build_parser
    from capture_proxy.cli.serve import settings_from_args

    monkeypatch.delenv("CAPTURE_PROXY_BACKEND", raising=False)
    args = build_parser().parse_args(
        ["serve", "--backend", "http://e0:8000", "--backend", "http://e1:8000/",
         "--backend", "http://e2:8000", "--store", str(tmp_path / "s"),
         "--routing-key", "episode", "--routing-key-header", "X-Session-ID"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert settings.backend_bases == ["http://e0:8000", "http://e1:8000", "http://e2:8000"]
    assert (settings.routing_key, settings.routing_key_header) == ("episode", "X-Session-ID")
    one = settings_from_args(build_parser().parse_args(["serve", "--backend", "http://e0:8000"]))
    assert one.backend_bases == ["http://e0:8000"]
    assert (one.routing_key, one.routing_key_header) == ("rollout", "x-smg-routing-key")


def test_extra_backends_may_not_carry_their_own_credential(tmp_path):
    import pytest

    from capture_proxy.config import Settings

    with pytest.raises(ValueError, match="extra backend URLs must not carry"):
        Settings(backend="http://e0:8000", extra_backends=["http://u:p@e1:8000"])
    with pytest.raises(ValueError, match="routing_key_header"):
        Settings(backend="http://e0:8000", routing_key_header="bad header")


def _serve_parser():
    import argparse

    from capture_proxy.cli.parser import build_parser

    (subcommands,) = (
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return subcommands.choices["serve"]


def test_every_serve_flag_is_a_setting_or_known_not_to_be_one():
    from capture_proxy.cli.serve import SERVE_FLAGS_NOT_SETTINGS, SETTING_FLAGS
    from capture_proxy.config import Settings

    dests = {a.dest for a in _serve_parser()._actions if a.dest != "help"}
    assert set(SETTING_FLAGS.values()) | SERVE_FLAGS_NOT_SETTINGS == dests
    assert not set(SETTING_FLAGS.values()) & SERVE_FLAGS_NOT_SETTINGS
    assert set(SETTING_FLAGS) <= set(Settings.model_fields)


def test_serve_timing_flags_reach_the_settings(monkeypatch, tmp_path):
    from capture_proxy.cli.parser import build_parser
    from capture_proxy.cli.serve import settings_from_args

    monkeypatch.delenv("CAPTURE_PROXY_ENGINE_PAUSE_WAIT_S", raising=False)
    monkeypatch.delenv("CAPTURE_PROXY_WEIGHT_VERSION_POLL_S", raising=False)
    args = build_parser().parse_args(
        ["serve", "--backend", "http://e0:8000", "--store", str(tmp_path / "s"),
         "--engine-pause-wait", "3", "--weight-version-poll", "0.5"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert (settings.engine_pause_wait_s, settings.weight_version_poll_s) == (3.0, 0.5)


def test_serve_refuses_bad_timing_flags_as_it_refuses_the_environment(monkeypatch, tmp_path):
    import pytest

    from capture_proxy.cli.errors import ServeExit
    from capture_proxy.cli.parser import build_parser
    from capture_proxy.cli.serve import settings_from_args

    base = ["serve", "--backend", "http://127.0.0.1:9", "--store", str(tmp_path / "s")]
    refusal = (
        "invalid settings: weight_version_poll_s: Input should be greater than 0; "
        "engine_pause_wait_s: Input should be greater than 0"
    )
    flags = [*base, "--engine-pause-wait", "-5", "--weight-version-poll", "-1"]
    with pytest.raises(ServeExit) as from_flags:
        settings_from_args(build_parser().parse_args(flags))
    assert str(from_flags.value) == refusal
    monkeypatch.setenv("CAPTURE_PROXY_ENGINE_PAUSE_WAIT_S", "-5")
    monkeypatch.setenv("CAPTURE_PROXY_WEIGHT_VERSION_POLL_S", "-1")
    with pytest.raises(ServeExit) as from_environment:
        settings_from_args(build_parser().parse_args(base))
    assert str(from_environment.value) == refusal


@pytest.mark.parametrize("second", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/"])
def test_serve_refuses_a_repeated_backend_as_an_invalid_setting(tmp_path, second):
    """A repeated engine was found only by the engine pool at start-up: a traceback (with
    workers, "worker 1 exited during start-up") and exit 1, not the one line and exit 2."""
    from capture_proxy.cli import main
    from capture_proxy.cli.errors import ServeExit
    from capture_proxy.cli.parser import build_parser
    from capture_proxy.cli.serve import settings_from_args

    flags = ["serve", "--backend", "http://127.0.0.1:8000", "--backend", second,
             "--store", str(tmp_path / "s")]  # fmt: skip
    with pytest.raises(ServeExit) as refused:
        settings_from_args(build_parser().parse_args(flags))
    assert str(refused.value) == (
        "invalid settings: settings: backend URLs repeat: http://127.0.0.1:8000 given more "
        "than once (backend and extra_backends, serve --backend repeated; a trailing / is the "
        "same URL): give each engine once"
    )
    assert main(flags) == 2


def _flags_without_help() -> list[str]:
    """Every option of every command whose ``--help`` says nothing, or names no default
    though the flag has one (the command's own; ``serve``'s defaults are the settings')."""
    import argparse

    from capture_proxy.cli.parser import build_parser

    found: list[str] = []

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif action.dest == "help":
                continue
            elif not action.help:
                found.append(f"{command} {'/'.join(action.option_strings) or action.dest}")
            elif (
                action.option_strings
                and action.default not in (None, False)
                and "default" not in action.help
            ):
                found.append(f"{command} {'/'.join(action.option_strings)}: no default")

    walk(build_parser(), "")
    return found


def test_every_flag_has_help_naming_its_default():
    """A new-user trial: scripted-engine --host/--port and serve --max-request-body-bytes,
    --log-level and --max-model-len said nothing in --help."""
    assert _flags_without_help() == []


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("--max-request-body-bytes", "(default 67108864: 64 MiB)"),
        ("--log-level", "(default INFO)"),
        ("--max-model-len", "(default: the engine's /v1/models)"),
    ],
)
def test_serve_help_names_the_settings_defaults(capsys, flag, words):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    options = " ".join(capsys.readouterr().out.split()).split(" options: ", 1)[1]
    after = options.split(f" {flag} ", 1)[1].split(" --", 1)[0]
    assert words in after, after
