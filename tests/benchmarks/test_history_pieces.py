"""``benchmarks/history_pieces.py`` runs, and each piece it times gives the same value both
ways (its own checks), on a short session."""

from benchmarks import history_pieces


def test_the_pieces_run_and_agree(capsys):
    assert history_pieces.main(["--turn", "6", "--repeat", "3", "--prompt-ids", "3000"]) == 0
    out = capsys.readouterr().out
    for piece in ("parse", "facts", "request digest", "block states"):
        assert f"  {piece} " in out
