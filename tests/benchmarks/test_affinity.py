"""The affinity bench's figures: moves per session, sessions and rollouts on more than one
engine, calls matched to engines by call id, engines' mean requests in flight."""

from benchmarks.affinity import ClientCall, ServedCall, count_moves, figures, mean_in_flight


def _call(rollout, session, step, call_id, error=None, t=0.0):
    return ClientCall(rollout, session, step, call_id, error, t, t + 1.0)


def _served(engine, call_id, key, t0=0.0, t1=1.0):
    return ServedCall(engine, call_id, key, t0, t1, 200, False)


def test_a_move_is_a_step_on_another_engine_than_the_step_before_it():
    assert count_moves({0: 1, 1: 1, 2: 0, 3: 0, 4: 1}) == (4, 2)
    # a step whose previous step was not served (an error) is no continuation
    assert count_moves({0: 1, 2: 0, 3: 0}) == (1, 0)
    assert count_moves({}) == (0, 0)


def test_figures_match_calls_to_engines_by_call_id():
    calls = [
        _call("r1", 0, 0, "a"),
        _call("r1", 0, 1, "b"),
        _call("r1", 1, 0, "c"),
        _call("r1", 1, 1, "d"),
        _call("r2", 0, 0, "e"),
        _call("r2", 0, 1, "f", error="http 502"),
        _call("r2", 0, 2, "g"),
    ]
    served = {
        "a": _served(0, "a", "r1"),
        "b": _served(0, "b", "r1"),
        "c": _served(0, "c", "r1"),
        "d": _served(1, "d", "r1"),
        "e": _served(2, "e", "r2"),
        "g": _served(2, "g", "other"),
    }
    f = figures(calls, served, engines=3, expected=9)
    assert (f.calls, f.errors, f.not_sent, f.unmatched, f.wrong_key) == (7, 1, 2, 0, 1)
    assert (f.continuations, f.moved) == (2, 1)  # r2's step 2 follows an error
    assert f.moved_from == [1, 0, 0]
    assert (f.sessions, f.sessions_multi, f.rollouts, f.rollouts_multi) == (3, 1, 2, 1)
    assert f.engine_calls == [3, 1, 2]
    assert f.busiest_over_mean == 1.5


def test_an_answered_call_no_engine_logged_is_counted():
    f = figures([_call("r1", 0, 0, "a")], {}, engines=2, expected=1)
    assert (f.unmatched, f.continuations, f.engine_calls) == (1, 0, [0, 0])


def test_mean_in_flight_is_busy_time_over_the_window():
    served = [_served(0, "a", "r", 0.0, 2.0), _served(0, "b", "r", 1.0, 5.0), _served(1, "c", "r")]
    assert mean_in_flight(served, 2, 0.0, 4.0) == [1.25, 0.25]
