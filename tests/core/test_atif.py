from capture_proxy.core.atif import gaps
from capture_proxy.core.records import Diagnostic, DiagnosticKind
from tests.factories import record


def test_tools_left_out_of_the_prompt_are_no_gap():
    # The prompt ids are what the engine saw; the diagnostic only says what it was not shown.
    left_out = Diagnostic(DiagnosticKind.TOOLS_NOT_RENDERED, {"tools": [{"type": "web_search"}]})
    nan = Diagnostic(DiagnosticKind.NON_FINITE_LOGPROB, {"positions": [0]})
    a = record("call-a", [1, 2], [3]).replace(diagnostics=[left_out])
    b = record("call-b", [1, 2, 3, 4], [5]).replace(diagnostics=[left_out, nan])
    assert gaps([a, b], [], incomplete=False) == [
        {"call_id": "call-b", "kind": "non_finite_logprob"}
    ]
