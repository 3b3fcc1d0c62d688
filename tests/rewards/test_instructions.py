"""Instruction following: verifiable constraints, IFEval ids, fraction vs all-or-nothing."""

import pytest

from actloop.rewards import RewardError, RewardTerm, Rubric
from actloop.rewards.instructions import CHECKS, constraints_of, grade_instructions, instructions_reward
from actloop.rewards.rubric import text_trajectory

GOOD = "Rust is fast. It is also safe.\n\n* memory safety\n* zero-cost abstractions\n\nAny other questions?"


@pytest.mark.parametrize("spec,ok_text,bad_text", [
    ({"type": "word_count", "min": 3, "max": 5}, "one two three four", "one two"),
    ({"type": "sentence_count", "n": 2}, "It works. It is fast!", "It works."),
    ({"type": "paragraph_count", "n": 2}, "a\n\nb", "a\nb"),
    ({"type": "paragraph_count", "n": 2, "separator": "***"}, "a *** b", "a\n\nb"),
    ({"type": "forbidden_words", "words": ["very", "really"]}, "Everyone is fine.", "It is Very good."),
    ({"type": "required_words", "words": ["rust", "safe"]}, "Rust is safe.", "Rust is fast."),
    ({"type": "keyword_frequency", "word": "go", "min": 2}, "go, go!", "go away, gopher"),
    ({"type": "json_format"}, '```json\n{"a": 1}\n```', "{'a': 1}"),
    ({"type": "bullet_count", "n": 2}, "* one\n- two", "* one\n**bold** line"),
    ({"type": "lowercase"}, "all small letters, 42.", "Not all small."),
    ({"type": "uppercase"}, "LOUD AND CLEAR!", "LOUD and clear"),
    ({"type": "ends_with", "phrase": "Any other questions?"}, "Done. Any other questions?", "Any other questions? Bye."),
    ({"type": "starts_with", "phrase": "Dear team"}, "Dear team, hello.", "Hello, dear team."),
    ({"type": "no_commas"}, "No commas here.", "One, two."),
    ({"type": "title"}, "<<My Poem>>\nroses", "My Poem\nroses"),
    ({"type": "quotation"}, '"quoted answer"', 'quoted "answer"'),
    ({"type": "placeholders", "min": 2}, "Dear [name], at [address].", "Dear [name]."),
    ({"type": "postscript", "marker": "P.S."}, "Hi.\nP.S. bye", "Hi. bye"),
])
def test_each_check_passes_and_fails(spec, ok_text, bad_text):
    assert grade_instructions(ok_text, [spec]).score == 1.0
    assert grade_instructions(bad_text, [spec]).score == 0.0


def test_several_constraints_fraction_or_all_or_nothing():
    specs = [{"type": "word_count", "max": 30}, {"type": "bullet_count", "n": 2},
             {"type": "ends_with", "phrase": "Any other questions?"}, {"type": "no_commas"}, {"type": "uppercase"}]
    g = grade_instructions(GOOD, specs)
    assert g.score == pytest.approx(4 / 5) and g.info["passed"] == 4
    assert [c["ok"] for c in g.info["constraints"]] == [True, True, True, True, False]
    assert grade_instructions(GOOD, specs, mode="all").score == 0.0
    assert grade_instructions(GOOD, specs[:4], mode="all").score == 1.0


def test_ifeval_rows_map_onto_the_same_checks():
    row = {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words",
                                   "startend:end_checker", "keywords:forbidden_words", "detectable_format:number_bullet_lists"],
           "kwargs": [{}, {"relation": "less than", "num_words": 30, "num_sentences": None},
                      {"end_phrase": "Any other questions?"}, {"forbidden_words": ["slow"]}, {"num_bullets": 2}]}
    specs = constraints_of(row)
    assert [s["type"] for s in specs] == ["no_commas", "word_count", "ends_with", "forbidden_words", "bullet_count"]
    assert specs[1]["max"] == 29
    assert grade_instructions(GOOD, specs).score == 1.0


def test_empty_answers_do_not_satisfy_constraints_vacuously():
    g = grade_instructions("   ", [{"type": "no_commas"}, {"type": "forbidden_words", "words": ["x"]}])
    assert g.score == 0.0 and "empty_response" in g.flags


def test_unknown_constraints_fail_loudly_and_the_rubric_masks():
    with pytest.raises(RewardError, match="unknown constraint type"):
        constraints_of({"constraints": [{"type": "rhymes"}]})
    with pytest.raises(RewardError, match="not supported"):
        constraints_of({"instruction_id_list": ["language:response_language"], "kwargs": [{}]})
    rubric = Rubric([RewardTerm("if", instructions_reward())])
    (s,) = rubric.score([text_trajectory("hi", {"constraints": [{"type": "rhymes"}]})])
    assert s.masked and "reward_error" in s.flags


def test_reward_function_signature_and_modes():
    fn = instructions_reward(mode="all")
    out = fn([[]], [GOOD], constraints=[[{"type": "no_commas"}, {"type": "lowercase"}]])
    assert out[0].score == 0.0 and out[0].info["passed"] == 1
    with pytest.raises(RewardError):
        grade_instructions(GOOD, [{"type": "no_commas"}], mode="most")
    assert len(CHECKS) >= 15
