"""The episode outline: chains under the chain their lineage edge comes from, with the edge's
kind and the arrival number of the call it starts at."""

from __future__ import annotations

from capture_proxy.core.chains import build_chains
from capture_proxy.core.lineage import find_lineage
from capture_proxy.core.view.episode import EpisodeEdge, EpisodeRow, episode_rows
from tests.core.lineage.test_find import SUB_PROMPT, assistant, call, main_turn, user


def test_sub_agents_are_drawn_under_the_chain_that_spawned_them() -> None:
    m1 = main_turn()
    m2 = call(
        "m2",
        4.0,
        [1, 2, 3, 4, 5, 6],
        [7],
        [user("task"), m1.response_message, {"role": "tool", "tool_call_id": "toolu_1"}],  # type: ignore[list-item]
        assistant("done"),
    )
    subs = [
        call(f"s{i}", 1.0 + i, [100 + 10 * i], [101, 102], [user(SUB_PROMPT)], assistant("r"))
        for i in (1, 2)
    ]
    other = call("o1", 5.0, [900], [901], [user("unrelated")], assistant("y"))
    records = [m1, m2, *subs, other]
    chains = build_chains("r1", records)
    rows = episode_rows(records, chains, find_lineage(chains))
    edge = EpisodeEdge("spawned_by", "m1", "m1", 1, "claude_code.spawn_tool")
    assert rows == [
        EpisodeRow("m1", 1, 2, 3, 0, (), ()),
        EpisodeRow("s1", 2, 1, 2, 1, ("├─",), (edge,)),
        EpisodeRow("s2", 3, 1, 2, 1, ("└─",), (edge,)),
        EpisodeRow("o1", 5, 1, 1, 0, (), ()),
    ]
