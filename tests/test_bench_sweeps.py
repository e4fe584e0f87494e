"""bench/env_sweep.sh and bench/define_sweep.sh, the one-call A/B drivers of the device runs: each setting reaches its
own process with its environment and options, a flagged build is timed only after its checks pass, and the call's
files come back as one archive. A stand-in `python` on PATH records what it was given (no GPU, no benchmark)."""
from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# records its arguments and the variables a sweep sets; writes the --out file; fails fused_ops when told to
prev=""
for a in "$@"; do
  if [ "$prev" = "--out" ] && [[ "$a" == *.json ]]; then mkdir -p "$(dirname "$a")"; echo '{}' > "$a"; fi
  prev="$a"
done
echo "ARGS $* | CARVEOUT=${SDQ_CARVEOUT:-} | NVCC=${SDQUANT_NVCC_FLAGS:-} |"
case "$*" in *fused_ops.py*) [ "${SDQUANT_NVCC_FLAGS:-}" = "-DBAD=1" ] && { echo "checks: 1 failed"; exit 1; }
                             echo "checks: 324 points, 0 failed";; esac
case "$*" in *chain.py*) printf '| M | PDL | qkv |\\n|---|---|---|\\n| 1 | on | 7.0 |\\n';; esac
case "$*" in *e2e.py*) echo "  x decode B=1: {'ms_per_step': 2.0, 'tokens_per_s': 500.0, 'trials_ms': [2.0]}";; esac
exit 0
"""


@pytest.fixture()
def fake_path(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


def _run(script, args, path, out):
    env = {**os.environ, "PATH": path, "OUT": str(out)}
    env.pop("SDQ_CARVEOUT", None)
    env.pop("SDQUANT_NVCC_FLAGS", None)
    return subprocess.run(["bash", str(ROOT / "bench" / script), *args], capture_output=True, text=True, env=env,
                          cwd=str(ROOT), timeout=120)


def _members(archive: Path) -> dict:
    with tarfile.open(archive) as t:
        return {m.name.lstrip("./"): t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}


def test_env_sweep_one_process_a_setting(fake_path, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = _run("env_sweep.sh", ["", "SDQ_CARVEOUT=100 --group-size -1"], fake_path, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["e2e_sweep.tgz"]  # one file back from the device
    files = _members(out / "e2e_sweep.tgz")
    assert set(files) == {"e2e_0/e2e.log", "e2e_0/e2e.json", "e2e_1/e2e.log", "e2e_1/e2e.json", "summary.txt"}
    first, second = files["e2e_0/e2e.log"], files["e2e_1/e2e.log"]
    assert "CARVEOUT= " in first and "--group-size" not in first
    assert "CARVEOUT=100 " in second and second.split("|")[0].rstrip().endswith("--group-size -1")
    assert "--commit unknown+[SDQ_CARVEOUT=100 --group-size -1]" in second
    assert "== e2e [SDQ_CARVEOUT=100 --group-size -1]" in r.stdout and "tokens_per_s': 500.0" in r.stdout


def test_define_sweep_checks_a_flagged_build_before_timing_it(fake_path, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = _run("define_sweep.sh", ["chain", "", "-DSDQ_TIGHT_L2PF=0", "-DBAD=1"], fake_path, out)
    assert r.returncode == 1  # the failed build
    files = _members(out / "chain_sweep.tgz")
    # the default build: timed without a check run; the good flag: checked, then timed with its flags
    assert "chain_0/fused_ops.log" not in files and "NVCC= |" in files["chain_0/chain.log"]
    assert "NVCC=-DSDQ_TIGHT_L2PF=0" in files["chain_1/fused_ops.log"]
    assert "NVCC=-DSDQ_TIGHT_L2PF=0" in files["chain_1/chain.log"]
    # the bad flag: its checks failed, so it was never timed
    assert "chain_2/chain.log" not in files and "checks FAILED" in r.stdout
    assert "== chain [-DSDQ_TIGHT_L2PF=0]" in files["summary.txt"] and "| 1 | on | 7.0 |" in files["summary.txt"]


def test_sweeps_refuse_an_unknown_mode(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "bench" / "define_sweep.sh"), "gemm", ""], capture_output=True, text=True,
                       cwd=str(ROOT), env={**os.environ, "OUT": str(tmp_path)}, timeout=60)
    assert r.returncode == 2 and "usage" in r.stdout
