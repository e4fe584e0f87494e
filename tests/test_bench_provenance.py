"""bench/provenance.py: the source digest that result files record beside the commit they were told (the device's
git metadata can be older than its files)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import provenance  # noqa: E402


def _tree(root: Path) -> Path:
    (root / "sdquant" / "kernels" / "csrc").mkdir(parents=True)
    (root / "sdquant" / "__init__.py").write_text("x = 1\n")
    (root / "sdquant" / "kernels" / "csrc" / "k.cuh").write_text("// kernel\n")
    (root / "sdquant" / "kernels" / "table.json").write_text("{}\n")
    return root


def test_digest_follows_the_sources_and_nothing_else(tmp_path):
    root = _tree(tmp_path)
    d0 = provenance.source_digest(root)
    assert len(d0) == 12 and d0 == provenance.source_digest(root)
    (root / "sdquant" / "__pycache__").mkdir()
    (root / "sdquant" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0\1")
    (root / "sdquant" / "notes.txt").write_text("not a source\n")
    (root / "README.md").write_text("outside the package\n")
    assert provenance.source_digest(root) == d0
    (root / "sdquant" / "kernels" / "csrc" / "k.cuh").write_text("// kernel, edited\n")
    d1 = provenance.source_digest(root)
    assert d1 != d0
    (root / "sdquant" / "kernels" / "csrc" / "k.cuh").rename(root / "sdquant" / "kernels" / "csrc" / "k2.cuh")
    assert provenance.source_digest(root) not in (d0, d1)  # the path is part of the digest


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_digest_at_a_commit_matches_the_checked_out_tree(tmp_path):
    root = _tree(tmp_path)
    git = ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = provenance.source_digest(root)
    (root / "sdquant" / "__init__.py").write_text("x = 2\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    assert provenance.digest_at("HEAD", root) == provenance.source_digest(root) != first
    assert provenance.digest_at("HEAD~1", root) == first
