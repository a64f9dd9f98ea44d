"""Issue 70 (item 6): the environments that ask whether a text states an answer, a title or a topic (env=goal_reflect's
goal targets, self-play's `answer_in_question`, `off_topic` and check) match whole normalized tokens
(`dspo.metrics.phrase_in`), not substrings: "1" is not in "1991", "new york" is in "I live in New York.". subEM, the
paper's metric, stays a substring test."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from dspo.agent.selfplay import check_agrees, off_topic
from dspo.env.goal_reflect import check_searches
from dspo.env.proposals import Proposal, parse_proposal
from dspo.env.rewards import EpisodeRecord, TurnRecord
from dspo.env.tools import ToolResult
from dspo.metrics import normalize_answer, phrase_in, sub_exact_match
from dspo.types import Passage, QAItem

# pieces that collide as substrings: numbers inside longer numbers, words inside words, articles, case, punctuation
PIECES = ["1", "19", "91", "1991", "kel", "Kel", "KELVIN", "dran", "Dranson", "new", "York", "york.", "New-York",
          "the", "The", "a", "an", "An", "A.", "s", "'s", ",", ".", "?", "!", "(", ")", "-", "é", "Ω"]  # fmt: skip
SPACES = st.sampled_from([" ", "  ", "\t", "\n", ""])
piece_text = st.lists(st.tuples(st.sampled_from(PIECES), SPACES), max_size=8).map(
    lambda parts: "".join(piece + space for piece, space in parts)
)
any_text = st.one_of(piece_text, st.text(max_size=30))  # piece_text: collisions are common; st.text: anything


def reference(phrase: str, text: str) -> bool:
    """The rule, written plainly: the phrase's normalized tokens are a contiguous run of the text's."""
    wanted, tokens = normalize_answer(phrase).split(), normalize_answer(text).split()
    return bool(wanted) and any(tokens[i : i + len(wanted)] == wanted for i in range(len(tokens) - len(wanted) + 1))


@settings(max_examples=400, deadline=None)
@given(any_text, any_text)
@example("1", "in 1991")
@example("new york", "I live in New York.")
@example("kel", "Kelvin")
def test_a_phrase_is_in_a_text_when_its_normalized_tokens_are_a_run_of_the_texts(phrase, text):
    assert phrase_in(phrase, text) == reference(phrase, text)


@settings(max_examples=300, deadline=None)
@given(piece_text, piece_text, piece_text, st.sampled_from([str.upper, str.lower, str.title, lambda s: s]),
       st.sampled_from(["", "The ", "a ", "(", '"']), st.sampled_from(["", ".", "?!", ",", ")"]))  # fmt: skip
def test_a_phrase_written_in_a_text_is_always_found_whatever_its_case_articles_and_punctuation(
    phrase, before, after, case, opening, closing
):
    text = f"{before} {opening}{case(phrase)}{closing} {after}"
    assert phrase_in(phrase, text) == bool(normalize_answer(phrase))
    assert not phrase_in("", text) and not phrase_in(" the . ", text)  # a blank phrase is in nothing


words = st.from_regex(r"[a-z]{1,6}", fullmatch=True).filter(lambda w: w not in ("a", "an", "the"))  # not articles


@settings(max_examples=300, deadline=None)
@given(st.from_regex(r"[0-9]{1,4}", fullmatch=True), st.from_regex(r"[0-9]{1,3}", fullmatch=True), words,
       st.from_regex(r"[a-z]{1,3}", fullmatch=True))  # fmt: skip
def test_a_number_inside_a_longer_number_and_a_word_inside_a_word_are_not_found(number, digits, word, letters):
    assert not phrase_in(number, f"In {number}{digits}, and {digits}{number}.")
    assert not phrase_in(f"Kel {word}", f"kel {word}{letters} was born")
    assert not phrase_in(word, f"{letters}{word}{letters}") and phrase_in(word, f"born in {word.upper()}.")


def test_subem_the_papers_metric_stays_a_substring_test():
    assert sub_exact_match("in 1991", ["1"]) == 1.0 and sub_exact_match("Kelvin", ["kel"]) == 1.0
    assert not phrase_in("1", "in 1991") and not phrase_in("kel", "Kelvin")


# ------------------------------------------------------------------------------------------ the environments
questions = piece_text.filter(lambda q: q.strip() and "<" not in q and ">" not in q)


@settings(max_examples=300, deadline=None)
@given(questions, any_text.filter(lambda a: normalize_answer(a) and "<" not in a))
@example("What happened in 1991?", "1")
@example("Where is New York?", "new york")
def test_a_proposal_gives_its_answer_away_only_when_its_question_states_it(question, answer):
    proposal, reason = parse_proposal(f"<question>{question}</question> <answer>{answer}</answer>")
    if reference(answer, question):
        assert (proposal, reason) == (None, "answer_in_question")
    else:
        assert (proposal, reason) == (Proposal(question.strip(), answer.strip()), "")


def test_a_question_about_1991_may_have_the_answer_1():
    text = "<question> How many albums did Kel Dran release in 1991? </question> <answer> 1 </answer>"
    assert parse_proposal(text) == (Proposal("How many albums did Kel Dran release in 1991?", "1"), "")
    assert off_topic("Where was Kelvin Dranson born?", "Kel Dran") == "off_topic"
    assert not check_agrees("1991", "1") and check_agrees("It was New York.", "new york")


@settings(max_examples=300, deadline=None)
@given(questions, piece_text)
@example("Where was Kelvin born?", "Kel")
@example("Where was Kel born?", "kel")
def test_a_question_is_on_topic_when_it_names_the_topic_as_whole_words(question, topic):
    assert off_topic(question, topic) == ("" if reference(topic, question) else "off_topic")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), piece_text), piece_text)
@example("1991", "1")
@example("It was New York.", "new york")
@example(None, "1")
def test_the_self_play_check_passes_when_its_answer_states_the_proposers(checked, proposed):
    assert check_agrees(checked, proposed) == (checked is not None and reference(proposed, checked))


@settings(max_examples=300, deadline=None)
@given(st.lists(piece_text.filter(lambda t: normalize_answer(t)), min_size=1, max_size=3, unique_by=normalize_answer),
       piece_text)  # fmt: skip
@example(["1", "19"], "find 1991")
@example(["Kel", "Mardale"], "the page of Kelvin")
def test_a_goal_targets_the_last_gold_page_it_names_as_whole_words_else_its_positions(chain, goal):
    item = QAItem("q", "?", ["x"], metadata={"chain": chain})
    search = TurnRecord(f"<goal>{goal}</goal> <search> q </search>", ("search", {}), result=ToolResult("r", []))
    (check,) = check_searches(EpisodeRecord(item, [search], None), "chain")
    gold = [normalize_answer(title) for title in chain]
    named = [title for title in gold if reference(title, goal)]
    assert check.target == (named[-1] if named else gold[0])


def test_a_goal_naming_kel_dranson_does_not_target_kel_dran():
    item = QAItem("q", "?", ["x"], metadata={"chain": ["Mardale", "Kel Dran"]})
    page = Passage("p", "Mardale", "Mardale is a city.")
    goal = TurnRecord("<goal> Kel Dranson </goal> <search> q </search>", ("search", {}), result=ToolResult("r", [page]))
    (check,) = check_searches(EpisodeRecord(item, [goal], None), "chain")
    assert check.target == "mardale" and check.held  # the search's position's page, not Kel Dran's
