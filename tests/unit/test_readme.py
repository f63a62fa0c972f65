"""The README a newcomer reads: the two set-up commands first, no paragraph over 120 words, performance rows quoted
only from the generated current page (benchmarks/RESULTS.md), and benchmarks/README.md naming every module."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.current import headlines

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_WORDS = 120


def paragraphs(text: str) -> list[str]:
    """Prose blocks of a Markdown text: blank-line separated, each list item on its own; code blocks, tables and
    headings left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith(("|", "#"))]
        item: list[str] = []
        for line in lines:
            if re.match(r"\s*([-*]|\d+\.)\s", line) and item:
                out.append(" ".join(item))
                item = []
            item.append(line.strip())
        if item:
            out.append(" ".join(item))
    return out


def test_paragraph_splitting():
    text = "one two\nthree\n\n- a b\n- c\n  d\n\n```\nx y z\n```\n| t | u |\n\n## head words\n"
    assert paragraphs(text) == ["one two three", "- a b", "- c d"]


def test_no_paragraph_over_120_words():
    long = [(len(p.split()), p[:80]) for p in paragraphs(README.read_text()) if len(p.split()) > MAX_WORDS]
    assert not long, f"README.md paragraphs over {MAX_WORDS} words: {long}"


def test_setup_commands_come_first():
    text = README.read_text()
    first_code = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert text.startswith("# graphserve\n")
    assert text.index("## On a fresh machine") < text.index("```bash")
    assert [line.split()[:2] for line in first_code.splitlines()] == [["make", "demo"], ["make", "test"]]


def test_performance_rows_are_rows_of_the_current_page():
    section = README.read_text().split("## Performance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| card |")]
    page = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert rows, "the performance section quotes no row"
    assert [r for r in rows if r not in page.splitlines()] == []
    # and they are the headline cases' rows, every card's, as `results_md --headlines` prints them
    assert "\n".join(rows) == "\n".join(headlines(page).splitlines()[2:])
    # a row that is not current is never presented as today's number: the section says so where it quotes one
    if any(not r.rstrip(" |").endswith("current") for r in rows):
        assert "stale" in section and "not a claim about the code in front of you" in section


def test_benchmarks_readme_names_every_module():
    index = (ROOT / "benchmarks" / "README.md").read_text()
    modules = [p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"]
    scripts = [p.name for p in (ROOT / "benchmarks").glob("*.sh")]
    assert [m for m in modules if f"`{m}" not in index] == []
    assert [s for s in scripts if f"benchmarks/{s}" not in index] == []


def test_readmes_and_benchmarks_cite_only_modules_in_the_tree():
    # JOURNAL.md is the record of past sittings: it may cite removed modules, each with a note; nothing else may
    cited = re.compile(r"benchmarks[./]([a-z][a-z0-9_]*)\b")
    bench = ROOT / "benchmarks"
    files = [README, bench / "README.md", *bench.glob("*.py"), *bench.glob("*.sh")]
    missing = {f"{f.relative_to(ROOT)}: {name}" for f in files for name in cited.findall(f.read_text())
               if name not in ("results", "py", "md", "sh")
               and not any((bench / f"{name}{ext}").exists() for ext in (".py", ".sh", ""))}
    assert not missing, f"citations of modules no longer in benchmarks/: {sorted(missing)}"
