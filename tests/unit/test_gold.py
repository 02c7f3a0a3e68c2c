import math

import pytest

from rlfuse.data.gold import gold_score, grammatical_rate, parse_sentence, sentences


def pol(text):
    return parse_sentence(sentences(text)[0])


def test_plain_adjective_has_its_polarity():
    assert pol("the acting was good.") == pytest.approx(0.5)
    assert pol("the plot is awful.") == pytest.approx(-0.9)


def test_intensifier_scales():
    assert pol("the acting was very good.") == pytest.approx(0.5 * 1.5)
    assert pol("this film was slightly bad.") == pytest.approx(-0.6 * 0.5)


def test_negation_flips_and_damps():
    assert pol("the acting was not good.") == pytest.approx(-0.7 * 0.5)
    assert pol("the ending was not very bad.") == pytest.approx(-0.7 * 1.5 * -0.6)


def test_but_clause_dominates():
    # 0.5 * (-0.5) + 1.0 * 0.8: the second clause carries the weight
    assert pol("the plot was dull, but the acting was great.") == pytest.approx(0.55)
    assert pol("the plot was great but the acting was awful.") == pytest.approx(0.5 * 0.8 - 0.9)


def test_statements_with_verbs():
    assert pol("i loved this movie.") == pytest.approx(0.8)
    assert pol("i did not like the music.") == pytest.approx(-0.7 * 0.5)
    assert pol("i really hated the ending.") == pytest.approx(-0.9 * 1.4)


def test_plot_sentences_are_neutral_and_grammatical():
    assert pol("the old detective finds the letter in the castle.") == 0.0
    assert pol("later, the thief meets the young widow.") == 0.0
    assert pol("the story takes place in the desert.") == 0.0


def test_review_score_is_tanh_of_sum_with_label():
    g = gold_score("the detective finds the map. the acting was good. i loved this film.")
    assert g.score == pytest.approx(math.tanh(0.5 + 0.8))
    assert g.label == "positive" and g.grammatical_rate == 1.0
    assert gold_score("the plot was awful.").label == "negative"
    assert gold_score("the detective finds the map.").label == "neutral"


def test_degenerate_text_scores_but_is_not_grammatical():
    g = gold_score("great great great. good good.")
    assert g.score > 0.9 and g.grammatical_rate == 0.0
    assert grammatical_rate("the acting was good. acting good the was.") == 0.5


def test_any_text_is_scored_in_range():
    for text in ["", "!!!", "Hello, World", "the the the the", "not not very very bad bad"]:
        g = gold_score(text)
        assert -1.0 <= g.score <= 1.0


@pytest.mark.parametrize("name,wrong,check", [
    ("INTENSIFIERS", "unit", "test_intensifier_scales"),  # every intensifier x 1: ignored
    ("NEGATION_FACTOR", 1.0, "test_negation_flips_and_damps"),  # negation ignored
    ("NEGATION_FACTOR", -1.0, "test_negation_flips_and_damps"),  # negation flips without damping
    ("BUT_WEIGHTS", (1.0, 1.0), "test_but_clause_dominates"),  # both clauses weigh alike
])
def test_the_hand_checks_reject_a_scorer_with_a_rule_broken(monkeypatch, name, wrong, check):
    """Each hand check above fails on a gold scorer with its rule broken (a grammar table changed under it)."""
    from rlfuse.data import grammar

    if wrong == "unit":
        wrong = {word: 1.0 for word in grammar.INTENSIFIERS}
    monkeypatch.setattr(grammar, name, wrong)
    with pytest.raises(AssertionError):
        globals()[check]()
