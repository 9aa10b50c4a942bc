"""The verifiable rewards of issue 53: answers extracted and normalised as a grader would, the format and length
rewards, and the registry of a user's own rewards (names checked, built-ins protected)."""

from __future__ import annotations

import pytest

from olmo.exceptions import OLMoConfigurationError
from olmo.rl.rewards import (
    Completion,
    exact_answer,
    extract_answer,
    format_reward,
    length_reward,
    normalise_answer,
    register_reward,
    registered_reward,
    registered_rewards,
)


def _completion(text: str, truth: str = "", tokens: int = 1) -> Completion:
    return Completion(prompt="What is it?", text=text, ground_truth=truth, num_tokens=tokens, truncated=False)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("So 3 + 4 = 7. The answer is 7.", "7"),
        ("We get 1,234 apples and 5 pears, so 1,239.", "1,239"),
        ("The values are 1,2,3", "3"),
        ("x2 is not a number, but -12.5 is", "-12.5"),
        ("half: 1/2", "1/2"),
        ("first \\boxed{4}, then finally \\boxed{\\frac{1}{2}} and 9", "\\frac{1}{2}"),
        ("\\fbox{yes}", "yes"),
        ("unbalanced \\boxed{3 and 8", "8"),
        ("no answer here", None),
    ],
)
def test_the_answer_is_the_last_boxed_content_or_else_the_last_number(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "a, b",
    [
        ("1,000", "1000"),
        ("1000.0", "1000"),
        ("0.5", "1/2"),
        ("$42$", "42"),
        ("42.", "42"),
        ("-0", "0"),
        ("\\text{Yes}", "yes"),
        ("New  York", "new york"),
    ],
)
def test_equal_answers_normalise_alike(a, b):
    assert normalise_answer(a) == normalise_answer(b)


@pytest.mark.parametrize("a, b", [("1000", "100"), ("0.33", "1/3"), ("yes", "no"), ("1,2", "12"), ("-3", "3")])
def test_different_answers_stay_different(a, b):
    assert normalise_answer(a) != normalise_answer(b)


def test_exact_answer_scores_one_for_the_right_answer_only():
    assert exact_answer(_completion("Adding, 12 + 30 = 42. Answer: 42", "42")) == 1.0
    assert exact_answer(_completion("\\boxed{1,000}", "1000")) == 1.0
    assert exact_answer(_completion("It is 1000.0", "\\boxed{1000}")) == 1.0  # a boxed ground truth is opened
    assert exact_answer(_completion("The answer is 42, or maybe 41", "42")) == 0.0  # the last number counts
    assert exact_answer(_completion("I do not know", "42")) == 0.0


def test_format_matches_the_whole_completion_across_lines():
    reward = format_reward(r"<think>.*</think>\s*<answer>.*</answer>")
    assert reward(_completion("<think>a\nb</think>\n<answer>3</answer>\n")) == 1.0
    assert reward(_completion("<answer>3</answer>")) == 0.0
    assert reward(_completion("<think>a</think><answer>3</answer> and more")) == 0.0


def test_a_pattern_that_does_not_compile_is_refused_naming_its_key():
    with pytest.raises(OLMoConfigurationError, match=r"rl\.rewards\[format\]\.pattern='\(unclosed'"):
        format_reward("(unclosed")


def test_length_penalty_is_zero_then_linear_then_minus_one():
    reward = length_reward(max_tokens=10, buffer=4)
    scores = [reward(_completion("x", tokens=n)) for n in (1, 6, 7, 8, 10, 11, 500)]
    assert scores == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    step = length_reward(max_tokens=10, buffer=0)
    assert [step(_completion("x", tokens=n)) for n in (10, 11)] == [0.0, -1.0]


@pytest.mark.parametrize("max_tokens, buffer", [(10, 10), (10, -1), (0, 0), (10.0, 2), (10, 2.5)])
def test_absurd_length_settings_are_refused(max_tokens, buffer):
    with pytest.raises(OLMoConfigurationError, match="0 <= buffer < max_tokens"):
        length_reward(max_tokens, buffer)


def test_a_registered_reward_is_found_by_name_and_names_are_checked():
    def shouting(completion: Completion) -> float:
        return float(completion.text.isupper())

    try:
        register_reward("shouting", shouting)
        assert registered_reward("shouting") is shouting
        assert registered_reward("whispering") is None
        with pytest.raises(OLMoConfigurationError, match="registered already"):
            register_reward("shouting", shouting)
    finally:
        registered_rewards().pop("shouting", None)
    with pytest.raises(OLMoConfigurationError, match="is a built-in reward"):
        register_reward("exact_answer", shouting)
    for bad in ("", "has space", "x" * 65, "9lives", "a/b"):
        with pytest.raises(OLMoConfigurationError, match="is not a reward name"):
            register_reward(bad, shouting)
    with pytest.raises(OLMoConfigurationError, match="must be callable"):
        register_reward("not_callable", 3.0)  # type: ignore[arg-type]
    assert "not_callable" not in registered_rewards()
