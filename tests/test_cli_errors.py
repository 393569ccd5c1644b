"""The command line's refusals: each is one line on stderr naming the problem and an exit code
(2: the command cannot run on this input; 1: it ran and failed), never a traceback, and a
refused ``export-tokenizer`` writes nothing."""

import pytest

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
