"""Why tokens do not chain: first difference and mismatch classes (``core.linking.mismatch``)."""

import numpy as np
import pytest

from capture_proxy.core.linking.mismatch import (
    DecodedTexts,
    MismatchClass,
    classify_mismatch,
    first_difference,
)


def test_first_difference():
    a = np.array([1, 2, 3], dtype=np.uint32)
    assert first_difference(a, np.array([1, 2, 3, 4], dtype=np.uint32)) is None
    assert first_difference(a, np.array([1, 9, 3, 4], dtype=np.uint32)) == 1
    assert first_difference(a, np.array([1, 2], dtype=np.uint32)) == 2


P = np.array([10, 11, 12], dtype=np.uint32)


G = np.array([20, 21, 99], dtype=np.uint32)


@pytest.mark.parametrize(
    ("child", "texts", "reasoning", "expected"),
    [
        ([10, 11, 12, 20, 21, 99, 5], None, None, None),
        ([10, 13, 12, 20, 21, 99, 5], None, None, (1, MismatchClass.HISTORY_EDITED)),
        # Same text "p" + "ab" + "<e>", split differently: 20 21 -> 22.
        (
            [10, 11, 12, 22, 99, 5],
            DecodedTexts("p", "pab<e>", "pab<e>\nx"),
            None,
            (3, MismatchClass.RETOKENIZED),
        ),
        # Reasoning dropped by the template.
        (
            [10, 11, 12, 21, 99, 5],
            DecodedTexts("p", "p<think>r</think>ab<e>", "pab<e>\nx"),
            "r",
            (3, MismatchClass.TEMPLATE_RERENDERED),
        ),
        # Arguments re-serialised: text differs, no reasoning involved.
        (
            [10, 11, 12, 20, 23, 5],
            DecodedTexts("p", 'p{"a" : 1}', 'p{"a":1}'),
            None,
            (4, MismatchClass.TEMPLATE_RERENDERED),
        ),
        ([10, 11, 12, 20, 23, 5], None, None, (4, MismatchClass.TEMPLATE_RERENDERED)),
    ],
    ids=[
        "chains",
        "history-edited",
        "retokenized",
        "reasoning-dropped",
        "args-rerendered",
        "no-text",
    ],
)
def test_mismatch_classes(child, texts, reasoning, expected):
    got = classify_mismatch(
        P, G, np.array(child, dtype=np.uint32), texts=texts, parent_reasoning=reasoning
    )
    if expected is None:
        assert got is None
    else:
        assert (got.position, got.mismatch_class) == expected


def test_other_stop_token_at_the_end_is_named():
    # The parent stopped on <|endoftext|> (151643); the template closes turns with 151645.
    prompt = np.array([1, 2], dtype=np.uint32)
    gen = np.array([5, 151643], dtype=np.uint32)
    child = np.array([1, 2, 5, 151645, 198], dtype=np.uint32)
    got = classify_mismatch(prompt, gen, child)
    assert (got.position, got.mismatch_class) == (3, MismatchClass.TEMPLATE_RERENDERED)
    assert got.explanation == (
        "the parent stopped on token 151643; the template closes the turn with 151645"
    )


def test_a_changed_system_prompt_is_named():
    child = np.array([10, 13, 12, 20, 21, 99, 5], dtype=np.uint32)
    got = classify_mismatch(P, G, child, system_changed=True)
    assert (got.position, got.mismatch_class) == (1, MismatchClass.SYSTEM_CHANGED)
    assert got.explanation == (
        "differs inside the parent's prompt, where the request's system messages are not the "
        "parent's; the rest of the history is the parent's (a changed system prompt, e.g. a "
        "Responses request's instructions, which previous_response_id does not carry over)"
    )
    # A history sent unchanged (the template's doing) is named so first.
    got = classify_mismatch(P, G, child, history_unchanged=True, system_changed=True)
    assert got.mismatch_class is MismatchClass.TEMPLATE_RERENDERED
    # Inside the parent's output it is no system message's doing.
    got = classify_mismatch(P, G, np.array([10, 11, 12, 20, 23, 5]), system_changed=True)
    assert got.mismatch_class is MismatchClass.TEMPLATE_RERENDERED


def test_a_prefill_and_its_continuation_that_re_encode_as_one_text_are_retokenized():
    # the parent's prompt ends with its prefill " " (12), the model wrote "b" (20): the child
    # renders the merged text " b" as one token (23), inside the parent's prompt
    child = np.array([10, 11, 23, 99, 5], dtype=np.uint32)
    texts = DecodedTexts("p ", "p b<e>", "p b<e>\nx")
    got = classify_mismatch(P, G, child, texts=texts, history_unchanged=True, parent_prefilled=True)
    assert got is not None and (got.position, got.mismatch_class) == (2, MismatchClass.RETOKENIZED)
    # not prefilled: a difference inside the prompt is the template's (or the harness's)
    got = classify_mismatch(P, G, child, texts=texts, history_unchanged=True)
    assert got is not None and got.mismatch_class is MismatchClass.TEMPLATE_RERENDERED
    # other text: not a re-encoding
    other = DecodedTexts("p ", "p b<e>", "p c<e>\nx")
    got = classify_mismatch(P, G, child, texts=other, history_unchanged=True, parent_prefilled=True)
    assert got is not None and got.mismatch_class is MismatchClass.TEMPLATE_RERENDERED
