"""The QA data of `ragkv eval` (ragkv/eval/suite.py) and `ragkv demo`
(ragkv/entrypoints/demo_corpus.py): pure data checks, no model."""

from __future__ import annotations

import collections
import re

import pytest

from ragkv.entrypoints import demo_corpus
from ragkv.eval.suite import (
    MAX_DOCUMENTS,
    MAX_TWO_HOP_DOCUMENTS,
    MIN_DOCUMENTS,
    TASKS,
    EvalItem,
    build_suite,
    is_correct,
    normalize_answer,
)


@pytest.fixture(scope="module", params=[0, 1])
def suite(request) -> list[EvalItem]:
    return build_suite(seed=request.param)


def test_same_seed_same_suite_other_seed_other_suite():
    assert build_suite(20, seed=3) == build_suite(20, seed=3)
    assert build_suite(20, seed=3) != build_suite(20, seed=4)
    # A smaller suite is a prefix of each task's items: --limit picks the same questions.
    small, large = build_suite(5, seed=3), build_suite(20, seed=3)
    for task in TASKS:
        assert [i for i in small if i.task == task] == [i for i in large if i.task == task][:5]


def test_counts_and_ids(suite):
    assert len(suite) == 80 * len(TASKS)
    assert collections.Counter(i.task for i in suite) == {t: 80 for t in TASKS}
    assert len({i.id for i in suite}) == len(suite)
    assert all(i.id.startswith(i.task + "-") for i in suite)
    assert build_suite(0) == []
    with pytest.raises(ValueError):
        build_suite(-1)


def test_documents_are_well_formed(suite):
    for item in suite:
        top = MAX_TWO_HOP_DOCUMENTS if item.task == "two-hop" else MAX_DOCUMENTS
        assert MIN_DOCUMENTS <= len(item.documents) <= top, item.id
        assert len(set(item.documents)) == len(item.documents), item.id
        for doc in item.documents:
            assert "##" not in doc
            assert 30 <= len(doc.split()) <= 150, doc
        assert item.system and "##" not in item.system and "##" not in item.question
        assert 1 <= len(item.answer.split()) <= 4, item.answer


def test_answer_is_stated_in_the_evidence(suite):
    for item in suite:
        assert len(item.evidence) == (2 if item.task == "two-hop" else 1), item.id
        last = item.documents[item.evidence[-1]]
        assert any(g in last for g in (item.answer, *item.aliases)), item.id
        if item.task == "two-hop":
            assert item.bridge, item.id
            assert all(item.bridge in item.documents[e] for e in item.evidence), item.id
            assert item.answer not in item.documents[item.evidence[0]], item.id


def test_fact_position_per_task(suite):
    for item in suite:
        n, (at, *_) = len(item.documents), item.evidence
        if item.task == "single-first":
            assert at == 0
        elif item.task == "single-last":
            assert at == n - 1
        elif item.task == "single-middle":
            assert 0 < at < n - 1 and at == n // 2


def test_distractors_name_similar_entities(suite):
    def stems(text: str) -> set[str]:
        return {w[:3] for w in re.findall(r"\b[A-Z][a-z]{3,}", text)}

    for item in suite:
        if item.task != "distractor":
            continue
        others = [d for k, d in enumerate(item.documents) if k not in item.evidence]
        assert any(stems(item.question) & stems(d) for d in others), item.id


def test_documents_recur_across_items(suite):
    uses = collections.Counter(d for item in suite for d in item.documents)
    assert len(uses) < sum(uses.values()) / 10
    common = uses.most_common(1)[0][0]
    places = {item.documents.index(common) for item in suite if common in item.documents}
    assert len(places) > 3  # the same text at different places in the prompt


def test_normalize_answer():
    assert normalize_answer("The river Velna.") == "river velna"
    assert normalize_answer("  An  IRON kiln!\n") == "iron kiln"
    assert normalize_answer("about 4,300 people") == "about 4300 people"
    assert normalize_answer("") == ""


def test_is_correct():
    item = EvalItem("x-0000", "distractor", "s", ("d",) * 4, "q?", "Velna")
    assert is_correct("Caldmere lies on the river Velna.", item)
    assert is_correct("VELNA", item)
    assert not is_correct("Velnaby", item)
    assert not is_correct("", item)
    number = EvalItem("x-0001", "single-first", "s", ("d",) * 4, "q?", "2,700")
    assert is_correct("About 2700 people live there.", number)
    assert not is_correct("12,700", number)
    plural = EvalItem("x-0002", "single-last", "s", ("d",) * 4, "q?", "glass buoys",
                      aliases=("glass buoy",))
    assert is_correct("It makes a glass buoy.", plural)
    assert is_correct("The glass buoys", plural)
    assert not is_correct("buoys", plural)


def test_demo_corpus():
    docs, questions = demo_corpus.DOCUMENTS, demo_corpus.QUESTIONS
    assert len(set(docs)) == len(docs) >= 6
    for doc in docs:
        assert "##" not in doc and 50 <= len(doc.split()) <= 150
    for q in questions:
        assert q.documents and all(0 <= d < len(docs) for d in q.documents)
        assert q.expected.lower() in docs[q.documents[-1]].lower()
    assert "##" not in demo_corpus.SYSTEM
