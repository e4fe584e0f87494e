"""The measured record's index (bench/docs_index.py): docs/BENCHMARKS.md lists every section of docs/benchmarks/*.md
under its file, and every place in the code and docs that names a topic file, or a section of one by its title, points
at something that exists."""
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
docs_index = pytest.importorskip("docs_index")

# docs/benchmarks/<file>.md, optionally followed by a quoted section title (straight or curly quotes)
CITE = re.compile(r'docs/benchmarks/([a-z0-9-]+)\.md[,:]?\s*(?:["“]([^"”]+)["”])?')


def _norm(s):
    """Titles are cited with ASCII hyphens and an elided tail ('...'); headings use en dashes."""
    s = s.split("...")[0].split("…")[0]  # an elided title is cited by its head
    return re.sub(r"\s+", " ", s.replace("–", "-").replace("—", "-")).strip()


def _cited():
    for path in [*ROOT.glob("sdquant/**/*.py"), *ROOT.glob("sdquant/**/*.cuh"), *ROOT.glob("sdquant/**/*.h"),
                 *ROOT.glob("bench/**/*.py"), *ROOT.glob("bench/**/*.cu"), *ROOT.glob("tests/**/*.py"),
                 *ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        # a citation may wrap: join comment and docstring continuation lines before matching
        flat = re.sub(r"\n\s*(?://|#)?\s*", " ", text)
        for m in CITE.finditer(flat):
            yield path, m.group(1), m.group(2)


def test_index_is_current():
    assert docs_index.main(["--check"]) == 0


def test_cited_topic_files_and_sections_exist():
    heads = {name: {_norm(h) for _, h in docs_index.sections(docs_index.TOPIC_DIR / f"{name}.md")[1]}
             for name in docs_index.TOPICS}
    n_files = n_titles = 0
    for path, name, title in _cited():
        assert name in heads, f"{path.relative_to(ROOT)} cites docs/benchmarks/{name}.md, which does not exist"
        n_files += 1
        if title:
            t = _norm(title)
            assert any(h.startswith(t) or (len(t) > 12 and t in h) for h in heads[name]), \
                f"{path.relative_to(ROOT)} cites section {title!r} of {name}.md, which has no such heading"
            n_titles += 1
    assert n_files >= 50 and n_titles >= 20  # the citations this test exists for were found at all


def test_check_notices_a_section_added_without_the_index(tmp_path):
    topic = tmp_path / "benchmarks"
    shutil.copytree(docs_index.TOPIC_DIR, topic)
    _, shipped = docs_index.split_index(docs_index.INDEX.read_text(encoding="utf-8"))
    assert docs_index.render(topic) == shipped
    with (topic / "fp8.md").open("a", encoding="utf-8") as f:
        f.write("\n## A new FP8 run (2026-12-08)\n\nmeasured\n")
    stale = docs_index.render(topic)
    assert stale != shipped and "- A new FP8 run (2026-12-08)" in stale.split("### [FP8")[1].split("### [")[0]


def test_unknown_or_missing_topic_files_are_refused(tmp_path):
    topic = tmp_path / "benchmarks"
    shutil.copytree(docs_index.TOPIC_DIR, topic)
    (topic / "stray.md").write_text("# Stray\n")
    with pytest.raises(ValueError, match="stray"):
        docs_index.render(topic)
    (topic / "stray.md").unlink()
    (topic / "seedance.md").unlink()
    with pytest.raises(ValueError, match="seedance"):
        docs_index.render(topic)
    (topic / "seedance.md").write_text("no title line\n")
    with pytest.raises(ValueError, match="first line"):
        docs_index.render(topic)


def test_relative_links_in_the_docs_resolve():
    """Every relative markdown link in README.md, docs/*.md and docs/benchmarks/*.md names a file or folder that
    exists (the record moved one folder down on 2026-12-07)."""
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("docs/benchmarks/*.md")]
    seen = 0
    for page in pages:
        for target in link.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            seen += 1
    assert seen >= 20
