"""The index-memory bench's linker holds what its bound lets it (``benchmarks/index_memory.py``)."""

from benchmarks.index_memory import measure
from benchmarks.put_cost import workload


async def test_the_call_bound_keeps_the_latest_rollouts_and_no_more_calls():
    records = workload(6, 4, experts=False)  # six rollouts of four calls, one after another
    bounded = await measure(records, max_calls=8, every=4)
    assert [(n, indexes, held) for n, indexes, held, _ in bounded] == [
        (4, 1, 4),
        (8, 2, 8),
        *((n, 2, 8) for n in range(12, 25, 4)),
    ]
    unbounded = await measure(records, max_calls=1 << 62, every=4)
    assert [(n, indexes, held) for n, indexes, held, _ in unbounded] == [
        (n, n // 4, n) for n in range(4, 25, 4)
    ]
    assert all(used > 0 for *_, used in bounded + unbounded)
    assert unbounded[-1][3] > bounded[-1][3]  # three times the calls held
