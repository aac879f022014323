"""A cheap prompt classifier: one `PromptType` per request from the text alone, in microseconds.

Rules are tried in order and the first that fires wins; each looks at what a user writes to ask
for that kind of work (an instruction word near the start, code fences, digits and operators, a
long pasted context ending in a question). No model, no tokenizer. Measured against Spec-Bench's
categories in tests/router/test_classify.py.

>>> classify("Translate German to English: Alle Tickets behalten Gültigkeit .")
<PromptType.TRANSLATION: 'translation'>
>>> classify("Write a C++ program to find the nth Fibonacci number using recursion.")
<PromptType.CODE: 'code'>
>>> classify("x+y = 4z, x*y = 4z^2, express x-y in z")
<PromptType.MATH: 'math'>
>>> classify("Where was the 2015 rugby union world cup held?")
<PromptType.CHAT: 'chat'>
"""

from __future__ import annotations

import re

from specfleet_api.enums import PromptType

HEAD = 400  # characters of the request where instructions are looked for
LONG_CONTEXT = 1500  # characters: past this, a question at the end reads as retrieval-augmented

_TRANSLATE = re.compile(r"\btranslat(e|ion)\b|\b(into|to) (english|french|german|spanish|chinese|japanese|"
                        r"italian|portuguese|russian|korean|arabic|dutch)\b", re.I)
_SUMMARIZE = re.compile(r"\b(summari[sz]e|summary|summarization|tl;?dr|condense|sum up)\b", re.I)
_CODE_WORDS = re.compile(
    r"```|\bdef \w+\(|\bclass \w+[:(]|#include\b|\bfunction\s*\w*\(|\b(python|javascript|typescript|java|c\+\+|"
    r"golang|rust|sql|bash|html|css|regex|regular expression)\b|\b(c\+\+|c#)|\b(write|implement|debug|fix|refactor) "
    r"(a |an |the )?(\w+ ){0,3}(program|function|script|code|class|method|query|algorithm)\b|\bbug\b", re.I)
_EXTRACT = re.compile(r"\b(extract|identify|list (all|the)|find (all|the)|count how many|parse|categori[sz]e|"
                      r"assign (them|each)|analy[sz]e the following|"
                      r"in (json|csv|yaml) format|return .{0,20}json|from the (following|text|paragraph|passage)"
                      r"|(read|given) the (following|paragraph|text|data))\b", re.I)
_MATH_WORDS = re.compile(r"\b(solve|calculate|compute|how (many|much|old|long|far|high|tall|fast)|equation|integral|"
                         r"derivative|percent|sum of|average|what (is|was|'s) the (total|value|sum|number|amount|"
                         r"temperature|average|cost|price)|what is \d)\b", re.I)
# no digits needed: the question itself is arithmetic
_MATH_ALONE = re.compile(r"\b(probability|remainder|divisible|prime number|[a-z]\([a-z0-9]\) ?=)", re.I)
# an operator between operands ('-' left out: "9-10" and "100-years-old" are prose)
_MATH_SYMBOLS = re.compile(r"\d\s*[+*/^=×÷]\s*[\d(a-z]|[a-z]\s*[+*/^=]\s*\d|\$\s?\d|\d+%")
_NUMBER = re.compile(r"\d+(\.\d+)?")
_QUESTION_TAIL = re.compile(r"\?\s*$|\b(answer|question)\b", re.I)
_WORD = re.compile(r"[^\W\d_]{2,}")


def classify(text: str) -> PromptType:
    """The prompt type of a request's text (for chat, its user messages joined)."""
    if not _WORD.search(text):
        return PromptType.OTHER
    head = text[:HEAD]
    if _TRANSLATE.search(head):
        return PromptType.TRANSLATION
    if _SUMMARIZE.search(head):
        return PromptType.SUMMARIZATION
    if _CODE_WORDS.search(text):
        return PromptType.CODE
    if _MATH_SYMBOLS.search(head) or _MATH_ALONE.search(head):
        return PromptType.MATH
    if _EXTRACT.search(head):
        return PromptType.EXTRACTION
    if len(text) >= LONG_CONTEXT and _QUESTION_TAIL.search(text[-300:]):
        return PromptType.RAG
    if _MATH_WORDS.search(text) and len(_NUMBER.findall(text)) >= 2:
        return PromptType.MATH
    return PromptType.CHAT


def classify_messages(messages: list[dict]) -> PromptType:
    """The prompt type of a chat request: its last user message decides, the earlier ones give
    context (a long pasted document in an earlier turn still makes it retrieval-augmented)."""
    users = [m.get("content") or "" for m in messages if m.get("role") == "user"]
    if not users:
        return PromptType.OTHER
    last = classify(users[-1])
    if last == PromptType.CHAT and sum(map(len, users)) >= LONG_CONTEXT:
        return classify("\n".join(users))
    return last
