"""bench/h200_ab_call.sh on the CPU, with stand-ins for nvidia-smi and python: each A/B part gets its own output folder
and flags, and a part that the call's time limit cannot hold is skipped, not started."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _call(tmp_path, limit):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    # the stand-in python records its arguments and what the call exported
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$SDQUANT_COMMIT $*" >> {log}\necho "| stub |"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), H200_AB_LIMIT_S=str(limit))
    r = subprocess.run(["bash", str(ROOT / "bench" / "h200_ab_call.sh"), "abc123"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return r.stdout, calls, out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_part_runs_with_its_flags(tmp_path):
    stdout, calls, out = _call(tmp_path, 560)
    assert len(calls) == 3, stdout
    p45, p44, p42 = calls
    assert p45.startswith("abc123 bench/int4_wgmma.py") and "--schedule auto,1wg,2wg,ws" in p45
    assert f"--out {out}/p45" in p45
    assert "bench/ab_build.py --old none --new-defines=-DSDQ_WG_RAW_OCC=3" in p44 and f"--out {out}/p44" in p44
    assert "--schedule auto,nosk+k0+wc0" in p42 and f"--out {out}/p42" in p42
    budget = int(p42.split("--budget-s ")[1].split()[0])
    assert 560 - 60 - 5 <= budget <= 560 - 60  # what the first two parts left (here ~all: the stand-ins take no
    # time), less the check child's minute
    assert all((out / name).is_dir() for name in ("p45", "p44", "p42"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_parts_the_limit_cannot_hold_are_skipped(tmp_path):
    # each part runs only if what is left holds its least useful time (p45 120 s, p44 150 s, p42 90 s)
    for limit, ran, skipped in ((130, ("auto,1wg,2wg,ws", "auto,nosk+k0+wc0"), ("p44",)),
                                (100, ("auto,nosk+k0+wc0",), ("p45", "p44")),
                                (60, (), ("p45", "p44", "p42"))):
        d = tmp_path / str(limit)
        d.mkdir()
        stdout, calls, _ = _call(d, limit)
        assert [c.split("--schedule ")[1].split()[0] for c in calls] == list(ran), (limit, calls)
        assert all(f"{name}: skipped" in stdout for name in skipped), (limit, stdout)
