"""Which code a benchmark ran: a digest of the package's sources, recorded beside the commit a run was told.

On the device the working tree is a copy whose git metadata can be older than the files (`git rev-parse HEAD` there
named the session's first commit while later trees ran), so the "commit" a run records is only what the sender passed
in SDQUANT_COMMIT. ``source_digest`` hashes the files that decide the numbers (sdquant/'s Python, CUDA and C++
sources), so two result files with the same digest ran the same code whatever they say of git, and a digest can be
matched against any commit here with ``python bench/provenance.py --at <rev>``.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h", ".json")


def source_digest(root: Path = ROOT) -> str:
    """sha256 (first 12 hex digits) over sdquant/'s source files: relative path and bytes, in path order."""
    h = hashlib.sha256()
    pkg = Path(root) / "sdquant"
    for p in sorted(q for q in pkg.rglob("*") if q.is_file() and q.suffix in SUFFIXES and "__pycache__" not in q.parts):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:12]


def digest_at(rev: str, root: Path = ROOT) -> str:
    """The digest of sdquant/ as committed at rev (read with git archive, so the working tree is not touched)."""
    import io
    import tarfile
    import tempfile
    data = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev, "sdquant"], check=True,
                          capture_output=True).stdout
    with tempfile.TemporaryDirectory() as d:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            tf.extractall(d, filter="data")
        return source_digest(Path(d))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at", default=None, help="a commit: print the digest of its sdquant/ instead of the working tree's")
    a = ap.parse_args(argv)
    print(digest_at(a.at) if a.at else source_digest())


if __name__ == "__main__":
    sys.exit(main())
