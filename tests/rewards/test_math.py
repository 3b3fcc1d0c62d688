"""Maths grader: extraction, normalisation, one-answer rule, GSM8K gold answers."""

import json
from fractions import Fraction

import pytest

from actloop.rewards import RewardError, RewardTerm, Rubric
from actloop.rewards.math import extract_final_answer, gold_value, grade_math, math_correct, numbers_in
from actloop.rewards.rubric import text_trajectory
from actloop.data.sources import data_dir
from actloop.tasks.gsm8k import gold_completion as gsm8k_gold_completion


@pytest.mark.parametrize("text,value", [
    ("#### 18", 18),
    ("so she makes $18.\n#### 18", 18),
    ("The answer is \\boxed{1,000}.", 1000),
    ("<answer>3/4</answer>", Fraction(3, 4)),
    ("**Final Answer:** 18 dollars", 18),
    ("### Final Answer\nJanet makes $18 every day.", 18),
    ("Final answer: \\frac{3}{4}", Fraction(3, 4)),
    ("\\boxed{\\dfrac{1}{2}}", Fraction(1, 2)),
    ("#### -5", -5),
    ("#### −5.0", -5),  # unicode minus, trailing zeros
    ("#### 18.00", 18),
    ("#### 2 1/2", Fraction(5, 2)),
    ("#### 25%", 25),
    ("#### 1e3", 1000),
    ("#### 9 * 2 = 18", 18),  # only what follows the last '='
    ("#### 18\n\\boxed{18}", 18),  # the same answer twice is one answer
    ("The answer is 42.", 42),
    ("We add them: 5 + 3 = 8 apples.\nSo 9 * 2 = $18 every day.", 18),  # no marker: the last line
    ("<think>maybe 17 or 19</think>\n#### 18", 18),  # reasoning blocks are left out
    ("The answer is 20. Let me check again...\n#### 18", 18),  # a marker beats a phrase
])
def test_extracts_and_normalises_one_final_answer(text, value):
    ex = extract_final_answer(text)
    assert ex.value == value and not ex.flags, ex


@pytest.mark.parametrize("text,flag", [
    ("#### 2 or 3", "hedged_answer"),
    ("#### 16-18", "hedged_answer"),
    ("\\boxed{18} or maybe \\boxed{19}", "conflicting_answers"),
    ("#### 18\n#### 20", "conflicting_answers"),
    ("<answer>18</answer> ... \\boxed{20}", "conflicting_answers"),
    ("#### 16, 17, 18, 19", "answer_spray"),
    ("#### 18,19,20,21", "answer_spray"),
    ("\\boxed{17,18}", "hedged_answer"),
    ("### Final Answer\n" + " ".join(str(i) for i in range(1, 40)), "answer_spray"),
    ("<thought>1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12</thought> #### 18", "answer_spray"),
    ("16 17 18 19", "answer_spray"),  # no marker: the last line holds four numbers
])
def test_hedging_spraying_and_conflicts_score_zero_with_a_flag(text, flag):
    g = grade_math(text, "#### 18")
    assert g.score == 0.0
    assert flag in g.flags and all(f.evidence for f in g.flags)


def test_wrong_or_missing_answers_score_zero_without_flags():
    assert grade_math("#### 17", "#### 18").score == 0.0
    g = grade_math("I don't know.", "#### 18")
    assert g.score == 0.0 and not g.flags
    assert grade_math("#### 180", 18).score == 0.0  # no substring matching
    assert grade_math("#### 1.8", 18).score == 0.0


def test_require_marker_ignores_a_bare_last_line():
    assert grade_math("so it is 18", 18).score == 1.0
    assert grade_math("so it is 18", 18, require_marker=True).score == 0.0


def test_numbers_in_keeps_thousands_apart_from_lists():
    assert numbers_in("1,234,567 and 1,2,3") == [1234567, 1, 2, 3]
    assert numbers_in("$1,000.50") == [Fraction("1000.5")]


def test_gold_values():
    assert gold_value("blah <<2*3=6>>6\n#### 1,200") == 1200
    assert gold_value(7) == 7 and gold_value("0.5") == Fraction(1, 2)
    with pytest.raises(RewardError):
        gold_value("#### 3 or 4")


def test_reward_function_in_a_rubric_returns_components_and_flags_with_evidence():
    rubric = Rubric([RewardTerm("correct", math_correct)])
    scored = rubric.score([text_trajectory("#### 18", {"answer": "#### 18"}),
                           text_trajectory("#### 17 or 18", {"answer": "#### 18"})])
    assert [s.reward for s in scored] == [1.0, 0.0]
    assert scored[0].flags == () and scored[0].components == {"correct": 1.0}
    (flag,) = scored[1].flags
    assert flag == "hedged_answer" and "17, 18" in flag.evidence and flag.source == "correct" and flag.action == "zero"
    assert rubric.flag_counts["hedged_answer"] == 1


def test_gsm8k_gold_solutions_score_full_marks():
    path = data_dir() / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K not found at {path} (set ACTLOOP_DATA_DIR)")
    rows = [json.loads(line) for line in path.open()]
    report = Rubric([RewardTerm("correct", math_correct)]).validate(rows, gsm8k_gold_completion, n=None)
    assert report.ok and report.checked == len(rows) == 1319, str(report)
    # and validate() does catch a grader that is wrong: require_marker on text without one
    bad = Rubric([RewardTerm("c", lambda prompts, completions, answer, **kw: [0.0] * len(completions))])
    assert not bad.validate(rows, gsm8k_gold_completion, n=5).ok
