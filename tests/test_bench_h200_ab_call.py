"""The one-call device scripts bench/h200_ab_call.sh and bench/tight_pdl_call.sh on the CPU, with stand-ins for
nvidia-smi and python: each part gets its own output folder and flags, the tuning resumes the committed table on an
H200 only, and a part that the call's time limit cannot hold is skipped, not started."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _call(tmp_path, limit, gpu="NVIDIA H200", script="h200_ab_call.sh", limit_env="H200_AB_LIMIT_S"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu}'\n")
    # the stand-in python records its arguments and what the call exported
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$SDQUANT_COMMIT $*" >> {log}\necho "| stub |"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), **{limit_env: str(limit)})
    r = subprocess.run(["bash", str(ROOT / "bench" / script), "abc123"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return r.stdout, calls, out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_part_runs_with_its_flags(tmp_path):
    stdout, calls, out = _call(tmp_path, 560)
    assert len(calls) == 4, stdout
    tune, cr, sw, g = calls
    assert tune == f"abc123 -m sdquant.cli tune-kernels --output {out}/t.json --resume"
    # the resumed table starts as the committed one (the stand-in tuner leaves it as it was copied)
    assert (out / "t.json").read_bytes() == (ROOT / "bench/results/crossover_h200_tune_20261207.json").read_bytes()
    assert cr.startswith("abc123 bench/int4_wgmma.py") and "--schedule auto,cr97" in cr and f"--out {out}/cr" in cr
    assert "--splits 0,2,3,4,6,8" in sw and "--shapes 4096x4096,4096x6144" in sw and f"--out {out}/sw" in sw
    assert g.startswith("abc123 bench/gemm.py") and "--kernels bf16,sdq_cuda,sdq_int4_layer" in g
    assert all((out / name).is_dir() for name in ("cr", "sw", "g"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_no_tuning_off_the_h200_and_no_call_without_a_commit(tmp_path):
    stdout, calls, out = _call(tmp_path, 560, gpu="NVIDIA H100 80GB HBM3")
    assert "tune: skipped" in stdout and not (out / "t.json").exists()
    assert [c.split()[1] for c in calls] == ["bench/int4_wgmma.py", "bench/int4_wgmma.py", "bench/gemm.py"]
    env = dict(os.environ, OUT=str(tmp_path))
    r = subprocess.run(["bash", str(ROOT / "bench" / "h200_ab_call.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "usage: bash bench/h200_ab_call.sh" in r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_parts_the_limit_cannot_hold_are_skipped(tmp_path):
    # each part runs only if what is left holds its least useful time (cr 100 s, sw 100 s, g 60 s); the stand-ins take
    # no time, so what is left is the limit
    for limit, ran, skipped in ((230, ("cr", "sw", "g"), ()),
                                (90, ("g",), ("cr", "sw")),
                                (50, (), ("cr", "sw", "g"))):
        d = tmp_path / str(limit)
        d.mkdir()
        stdout, calls, out = _call(d, limit, gpu="NVIDIA H100 80GB HBM3")
        assert [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in calls] == list(ran), (limit, calls)
        assert all(f"{name}: skipped" in stdout for name in skipped), (limit, stdout)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tight_pdl_call_runs_its_parts_and_skips_what_the_limit_cannot_hold(tmp_path):
    kw = {"script": "tight_pdl_call.sh", "limit_env": "TIGHT_PDL_LIMIT_S", "gpu": "NVIDIA H100 80GB HBM3"}
    stdout, calls, out = _call(tmp_path, 560, **kw)
    assert len(calls) == 4, stdout
    pdl, late, trig, ab = calls
    assert pdl.startswith("abc123 bench/gemm.py") and "--kernels bf16,sdq_cuda,sdq_cuda_pdl,sdq_cuda_pdl_late" in pdl
    assert "--ms 1,2,4,8,16" in pdl and f"--out {out}/pdl" in pdl and "--pdl-max-m" not in pdl
    assert late.startswith("abc123 bench/gemm.py") and "--kernels bf16,sdq_cuda_pdl,sdq_cuda_pdl_late" in late
    assert "--ms 16,32,64" in late and "--pdl-max-m 64" in late and f"--out {out}/late" in late
    assert len(late.split("--shapes ")[1].split()[0].split(",")) == 7
    assert trig.startswith("abc123 bench/ab_build.py --old none --new-defines=-DSDQ_WG_EARLY_TRIGGER_MAX_M=0")
    assert "--new-defines=-DSDQ_WG_EARLY_TRIGGER_MAX_M=256" in trig
    assert "--configs 62,63" in trig and "--pdl 2" in trig and f"--out {out}/trig" in trig
    assert ab.startswith("abc123 bench/ab_build.py --old none --new-defines=-DSDQ_TIGHT_SZO=0")
    assert f"--out {out}/ab" in ab
    # pdl needs 60 s to be worth starting, late 90, trig 120, ab 150; the stand-ins take no time, so what is left is
    # the limit
    for limit, ran in ((130, ["pdl", "late", "trig"]), (100, ["pdl", "late"]), (80, ["pdl"]), (50, [])):
        d = tmp_path / str(limit)
        d.mkdir()
        stdout, calls, out = _call(d, limit, **kw)
        assert [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in calls] == ran, (limit, calls)
        skipped = {n for n in ("pdl", "late", "trig", "ab") if f"{n}: skipped" in stdout}
        assert skipped == {"pdl", "late", "trig", "ab"} - set(ran), (limit, stdout)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gluon_call_runs_the_prototype_first_then_the_decode_columns(tmp_path):
    kw = {"script": "gluon_call.sh", "limit_env": "GLUON_CALL_LIMIT_S", "gpu": "NVIDIA H200"}
    stdout, calls, out = _call(tmp_path, 560, **kw)
    assert len(calls) == 3, stdout
    gluon, pdl, trig = calls
    assert gluon == f"abc123 bench/triton_gluon.py --ms 2,4,8,16 --out {out}/gluon"
    assert pdl.startswith("abc123 bench/gemm.py") and "sdq_cuda_pdl,sdq_cuda_pdl_late" in pdl
    assert f"--out {out}/pdl" in pdl
    assert trig.startswith("abc123 bench/ab_build.py --old none") and "--pdl 2" in trig
    assert "late: not asked for" in stdout and "ab: not asked for" in stdout
    # gluon needs 120 s to be worth starting, pdl 60, trig 120 (the stand-ins take no time: what is left is the limit)
    for limit, ran in ((110, ["pdl"]), (130, ["gluon", "pdl", "trig"]), (50, [])):
        d = tmp_path / str(limit)
        d.mkdir()
        stdout, calls, out = _call(d, limit, **kw)
        assert [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in calls] == ran, (limit, calls)
