"""The 'grade' reward for rubric models: clipped to [0, 10] at both ends, so it never rises below 0."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dph_async.rewards.grade import grade_score, parse_total_score
from dph_async.rewards.worker import ScoreRequest, score_one


def score(response, truth):
    return score_one(ScoreRequest("grade", response, truth, {}))


@pytest.mark.parametrize(("text", "grade"), [
    ("Reasoning...\nTotal Score: 7/10", 7.0),
    ("**Total Score**: [8.5] points", 8.5),
    ("total score | 3", 3.0),
    ("Total Score: -5/10", -5.0),
    ("Total Score: 85/100", 85.0),
    ("Total Score 2 ... final Total Score: 9", 9.0),
    ("no total here", None),
    ("Total Score: nine", None),
])
def test_parse_total_score(text, grade):
    assert parse_total_score(text) == grade


def test_negative_grades_cannot_earn_reward():
    # The unclipped original gives (1 - |-0.5 - 1|)^2 = 0.25 here.
    result = score("Total Score: -5/10", 1.0)
    assert (result.score, result.correct) == (0.0, False)
    assert score("Total Score: 85/100", 1.0).score == 1.0  # clipped to 10 from above, as before
    assert score("Total Score: 7", 0.7).correct
    assert score("Total Score: 4", 0.7).score == pytest.approx(0.49)


def test_parse_failure_and_bad_reference():
    assert score("I think it deserves a 7", 0.5).status == "parse_error"
    assert score("Total Score: 7", 1.5).status == "error"


@given(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6), st.floats(0, 1))
def test_score_never_increases_moving_away_from_the_reference(a, b, reference):
    assert 0.0 <= grade_score(a, reference) <= 1.0
    clip = lambda x: min(max(x, 0.0), 10.0) / 10.0  # noqa: E731
    if abs(clip(a) - reference) <= abs(clip(b) - reference):
        assert grade_score(a, reference) >= grade_score(b, reference)
