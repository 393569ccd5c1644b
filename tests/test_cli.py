"""The command line: demo and replay run end to end; serve refuses bad settings clearly."""

import re

from capture_proxy.cli import main


def test_demo_with_the_built_in_client(tmp_path, capsys):
    assert main(["demo", "--opencode", "no", "--store", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"rollout demo-\d+: 4 calls, 2 chains, incomplete=False", out)
    assert "child of #2" in out and (tmp_path / "store" / "captures.sqlite3").exists()


def test_replay_of_a_recording(fixtures_dir, capsys):
    log = fixtures_dir / "opencode" / "logs" / "02_step_limit_obeyed.jsonl"
    assert main(["replay", str(log), "--rollout", "rec-2"]) == 0
    out = capsys.readouterr().out
    assert "rollout rec-2: 7 calls, 3 chains, incomplete=False" in out
    assert "'links_refused': {'history_edited': 1}" in out


def test_serve_refuses_bad_settings(capsys):
    assert main(["serve", "--backend", "not a url"]) == 2
    assert "backend" in capsys.readouterr().err


def test_replay_of_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().out
