"""The index of the measured record: docs/BENCHMARKS.md ends with "## The record, by topic", a list of every section
of docs/benchmarks/*.md under its file, so that a section named by its title anywhere in the code or the notes can be
found. This script writes that list from the topic files, or checks that it is current.

    python bench/docs_index.py            # rewrite the index after adding a section to a topic file
    python bench/docs_index.py --check    # exit 1, naming the difference, when the index is stale

A topic file's first line is "# <title>"; its sections are its "## " headings (and "### " ones, listed indented).
The files are listed in TOPICS order; a topic file not in TOPICS, or a name in TOPICS with no file, is an error.
"""
import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "BENCHMARKS.md"
TOPIC_DIR = ROOT / "docs" / "benchmarks"
MARK = "## The record, by topic"
TOPICS = ("gemm-table", "int4-cuda", "int4-wgmma", "int4-triton", "fp8", "decode", "export", "calibration", "seedance",
          "pending")
PREAMBLE = ("Every measured result lives in one of these files, under the section titles listed here (in each file's "
            "order).\nCode, docs and notes name sections by title; this list says which file holds each.")


def sections(path):
    """(title, [(level, heading), ...]) of one topic file; level 2 or 3."""
    lines = path.read_text(encoding="utf-8").split("\n")
    if not lines or not lines[0].startswith("# "):
        raise ValueError(f"{path}: the first line must be '# <title>'")
    heads, fence = [], False
    for line in lines[1:]:
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^(#{2,3}) (.+)$", line)
        if m:
            heads.append((len(m.group(1)), m.group(2).strip()))
    return lines[0][2:].strip(), heads


def render(topic_dir=TOPIC_DIR):
    found = {p.stem for p in topic_dir.glob("*.md")}
    if found - set(TOPICS):
        raise ValueError(f"{topic_dir}: {sorted(found - set(TOPICS))} not in bench/docs_index.py TOPICS")
    if set(TOPICS) - found:
        raise ValueError(f"{topic_dir}: no file for {sorted(set(TOPICS) - found)}")
    out = [MARK, "", PREAMBLE, ""]
    for name in TOPICS:
        title, heads = sections(topic_dir / f"{name}.md")
        out += [f"### [{title}](benchmarks/{name}.md)", ""]
        out += [("  " if level == 3 else "") + f"- {h}" for level, h in heads]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def split_index(text):
    """(the part above the index, the index itself)."""
    at = text.find("\n" + MARK + "\n")
    if at < 0:
        raise ValueError(f"{INDEX}: no '{MARK}' section")
    return text[:at + 1], text[at + 1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is not what the topic files give")
    args = ap.parse_args(argv)
    try:
        head, old = split_index(INDEX.read_text(encoding="utf-8"))
        new = render()
    except (OSError, ValueError) as e:
        print(f"docs_index: {e}", file=sys.stderr)
        return 2
    if args.check:
        if old == new:
            return 0
        gone = sorted(set(old.split("\n")) - set(new.split("\n")))
        missing = sorted(set(new.split("\n")) - set(old.split("\n")))
        print(f"docs_index: {INDEX.name} is stale; run python bench/docs_index.py. Not listed: {missing[:3]}; "
              f"listed but gone: {gone[:3]}", file=sys.stderr)
        return 1
    tmp = INDEX.with_suffix(".md.tmp")
    tmp.write_text(head + new, encoding="utf-8")
    tmp.replace(INDEX)
    return 0


if __name__ == "__main__":
    sys.exit(main())
