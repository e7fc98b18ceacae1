"""One request plan, one error vocabulary: the CLI, the library and the server refuse a bad request with the
same check and the same words (`stagedspec.request_plan`)."""

from __future__ import annotations

import pytest

from stagedspec.errors import StagedSpecError
from stagedspec.request_plan import PlanError, check_options, plan_request


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(max_new_tokens=0), "max_tokens", "must be >= 1"),
    (dict(temperature=-1.0), "temperature", "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p", "top-p must be in (0, 1]"),
    (dict(top_k=-2), "top_k", "top-k must be >= 0"),
    (dict(stop=["a", ""]), "stop", "must not be empty"),
    (dict(max_new_tokens=60), "max_tokens", "context_length_exceeded"),
])
def test_each_bad_field_is_named_with_its_api_param(kwargs: dict, param: str, words: str) -> None:
    args = dict(max_new_tokens=4, context=64) | kwargs
    with pytest.raises(PlanError) as caught:
        plan_request(list(range(10)), **args)
    err = caught.value
    assert err.param == param and (words in str(err) or words == err.code), (str(err), err.param, err.code)
    assert isinstance(err, StagedSpecError)  # the CLI prints it as its one line, exit status 2


def test_a_prompt_that_fills_the_context_is_named_before_the_length_it_leaves() -> None:
    with pytest.raises(PlanError, match="the prompt has 64") as caught:
        plan_request(list(range(64)), max_new_tokens=0, context=64)
    assert caught.value.param == "prompt" and caught.value.code == "context_length_exceeded"
    with pytest.raises(PlanError, match="the prompt is empty"):
        plan_request([], max_new_tokens=4, context=64)


def test_a_plan_holds_what_passed_the_checks() -> None:
    plan = plan_request([1, 2, 3], max_new_tokens=5, context=64, temperature=0.7, top_k=5, seed=3, stop=["\n\n"])
    assert plan.prompt_ids == (1, 2, 3) and plan.max_new_tokens == 5 and plan.seed == 3
    assert plan.sampling.temperature == 0.7 and plan.sampling.top_k == 5 and plan.stop == ("\n\n",)
    assert plan.speculation.method == "auto"
    sampling, stops = check_options(max_new_tokens=1, stop=("x",))
    assert sampling.greedy and stops == ("x",)
