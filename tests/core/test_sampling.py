import pytest

from capture_proxy.core.sampling import SamplingError, sampling_from_chat


def test_fields_pass_through_by_name_and_budget_is_clamped():
    body = {
        "max_tokens": 100,
        "temperature": 0.0,
        "seed": 7,
        "stop": "END",
        "logit_bias": {"151657": 100},
        "structured_outputs": {"regex": "a+"},
        "tools": [],
        "messages": [],
    }
    s = sampling_from_chat(body, num_prompt_tokens=950, max_model_len=1000)
    assert s.max_tokens == 50 and s.clamped_from == 100
    assert s.stop == ["END"]
    assert s.extra == {
        "temperature": 0.0,
        "seed": 7,
        "logit_bias": {"151657": 100},
        "structured_outputs": {"regex": "a+"},
    }


def test_no_budget_means_the_rest_of_the_context():
    s = sampling_from_chat({"max_completion_tokens": 5}, num_prompt_tokens=10, max_model_len=100)
    assert (s.max_tokens, s.clamped_from) == (5, None)
    assert sampling_from_chat({}, num_prompt_tokens=10, max_model_len=100).max_tokens == 90


@pytest.mark.parametrize(
    ("body", "prompt", "param"),
    [({}, 100, "messages"), ({"max_tokens": 0}, 1, "max_tokens"), ({"stop": [1]}, 1, "stop")],
)
def test_errors_name_the_field(body, prompt, param):
    with pytest.raises(SamplingError) as info:
        sampling_from_chat(body, num_prompt_tokens=prompt, max_model_len=100)
    assert info.value.param == param
