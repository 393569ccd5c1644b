"""The index-load bench's two ways make the same entries (``benchmarks/index_load.py``)."""

from benchmarks.index_load import run


async def test_both_ways_file_every_call_and_the_rows_give_history_keys():
    _, _, keys = await run(5, 1)  # (``run`` asserts both indexes file the same calls)
    assert keys == 5  # every row's history key read from its message chain
