"""The README and docs/*.md, read as a user reads them: a README short enough to read, no
work-log wording ("session 9", "issue 11", "stop 3") in place of what a result is, and every
relative link (with its #anchor, for a Markdown target) pointing at something that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

# "session 9", "Session 10:", "sessions 8 and 9", "issue #4", "issue 8's", "stop 3", and the
# anchors GitHub makes of such headings ("#session-10-..."). Not: "a GitHub issue", "the issue's
# bars", "x-session-id", or a raw file's name such as serving-...-session8.json (no separator).
WORK_LOG = re.compile(r"\b(?:sessions?|issues?|stops?)[ \-]#?\d+", re.IGNORECASE)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(md: Path) -> set[str]:
    """The #anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", md.read_text())):
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(md: Path) -> list[str]:
    text = prose(md.read_text())
    targets = LINK.findall(text) + REF_DEF.findall(text)
    return [t for t in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t)]  # http:, mailto:


def broken_links(md: Path) -> list[str]:
    broken = []
    for target in relative_links(md):
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading in {rel(dest)} gives #{anchor}")
    return broken


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, at most {README_MAX_LINES}: move details to docs/ "
        "(measured history to docs/benchmarks.md)")


@pytest.mark.parametrize("md", DOCS, ids=rel)
def test_no_work_log_wording(md):
    hits = [f"{rel(md)}:{i}: {m.group(0)!r} in {line.strip()[:100]!r}"
            for i, line in enumerate(md.read_text().splitlines(), 1)
            for m in WORK_LOG.finditer(line)]
    assert not hits, ("name a result by what it is or by its date, not by a work session, issue "
                      "or stop number:\n" + "\n".join(hits))


@pytest.mark.parametrize("md", DOCS, ids=rel)
def test_relative_links_resolve(md):
    broken = broken_links(md)
    assert not broken, f"{rel(md)} links to what does not exist:\n" + "\n".join(broken)


def test_the_checks_can_fail(tmp_path):
    """The patterns themselves: they must catch what they are for and pass what is fine."""
    for bad in ["session 3", "Session 10: the tail", "sessions 8 and 9", "issue #4", "(issue 8's bar)",
                "stop 3", "trees.md#session-10-the-tail"]:
        assert WORK_LOG.search(bad), bad
    for fine in ["a GitHub issue", "the issue's bars", "x-session-id: demo-3", "session of its own",
                 "[raw](bench/serving-dev-32-guard002-session8.json)", "stopped 2 workers"]:
        assert not WORK_LOG.search(fine), fine
    (tmp_path / "there.md").write_text("# A heading: `here`, too\n\ntext\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading-here-too) [gone](missing.md) [bad](there.md#nope)\n"
                    "`[code](not-a-link.md)`\n```\n[fenced](not-a-link.md)\n```\n[web](https://x.y/z)\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "there.md#nope"]
