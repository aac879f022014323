"""The prompt classifier against Spec-Bench's categories, and its rules one by one."""
from __future__ import annotations

import collections
import doctest
import json

import pytest

from specfleet_api.enums import PromptType
from specfleet_bench.questions import default_questions
from specfleet_router import classify as classify_module
from specfleet_router.classify import classify, classify_messages

# Spec-Bench category -> the prompt type a request of it should get (the rest are chat)
EXPECTED = {"coding": "code", "math_reasoning": "math", "math": "math", "summarization": "summarization",
            "translation": "translation", "rag": "rag", "extraction": "extraction"}


def test_docstring_examples():
    assert doctest.testmod(classify_module).failed == 0


def test_spec_bench_categories_are_told_apart():
    rows = [json.loads(line) for line in default_questions().read_text().splitlines() if line.strip()]
    confusion = collections.Counter((r["category"], classify(r["turns"][0]).value) for r in rows)
    right = sum(n for (cat, got), n in confusion.items() if EXPECTED.get(cat, "chat") == got)
    assert right / len(rows) >= 0.95, sorted(confusion.items())
    for cat in ("translation", "summarization", "rag"):  # the types that route differently
        assert confusion[(cat, EXPECTED[cat])] >= 0.95 * sum(n for (c, _), n in confusion.items() if c == cat)


@pytest.mark.parametrize("text,expected", [
    ("", PromptType.OTHER),
    ("What is 12345 + 678?", PromptType.MATH),
    ("12345 + 678", PromptType.OTHER),  # no words: nothing to go on
    ("```python\nprint(1)\n```\nWhy does this fail?", PromptType.CODE),
    ("Please summarize the meeting notes below.", PromptType.SUMMARIZATION),
    ("Extract every date from the following text: ...", PromptType.EXTRACTION),
    ("What's a good name for a cat?", PromptType.CHAT),
    ("word " * 400 + "\nBased on the passage, who wrote the song?", PromptType.RAG),
])
def test_each_rule(text, expected):
    assert classify(text) == expected


def test_chat_messages_use_the_last_user_turn_and_long_context():
    doc = "The river runs through the old town. " * 60
    assert classify_messages([{"role": "system", "content": "Translate everything."},
                              {"role": "user", "content": "Hello there, how are you?"}]) == PromptType.CHAT
    assert classify_messages([{"role": "user", "content": doc},
                              {"role": "assistant", "content": "Noted."},
                              {"role": "user", "content": "Which river is it?"}]) == PromptType.RAG
    assert classify_messages([{"role": "system", "content": "hi"}]) == PromptType.OTHER
