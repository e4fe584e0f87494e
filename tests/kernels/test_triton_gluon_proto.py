"""bench/triton_gluon.py (Pending 53 of docs/benchmarks/pending.md): the Gluon W4A16 prototype over the CUDA layout.

Gluon has no interpreter, so CI checks the two things a CPU can: the kernel's index arithmetic (its torch emulation
against x @ W.T, splits included) and its sm_90 compile (the weights reach the wgmma as a register operand, with no
shared-memory round trip). The kernel itself runs on the device (``python bench/triton_gluon.py --out $OUT``), which
checks every timed config against x @ W.T first."""
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _mods():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gemm
        import triton_gluon
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gemm, triton_gluon


@pytest.mark.parametrize("k,n,gs,sym,m", [(256, 256, 128, True, 1), (512, 256, 256, False, 3),
                                          (384, 512, -1, False, 16), (1024, 256, 128, False, 9)])
def test_emulation_matches_the_reference(k, n, gs, sym, m):
    """The kernel's mapping of word u, lane 4g + t4, nibble i and pair e to feature 64 nb + 16 u + 8 (i // 2) + g and
    K 16 ks + 8 (i % 2) + 2 t4 + e, the raw codes 128 + c and the fold s g - s (128 + z) gx, emulated in float64 on
    the CUDA layout, equal x @ W.T; with 1 split and with a split of every 128-K iteration."""
    gemm, tg = _mods()
    from sdquant.kernels import int4_layout
    qw = gemm.random_int4(n, k, gs=gs, symmetric=sym, seed=k + n + m)
    lay = int4_layout.repack_cuda(qw, torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.float64)
    ref = x @ qw.dequantize().double().t()
    for its in (k // 128, 1):
        y = tg.emulate(x, lay, gs, its)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-12, its
    # a wrong nibble order would not pass: swap two words' roles and the result moves far off
    bad = dict(lay, qweight=lay["qweight"].flip(-1).contiguous())
    assert ((tg.emulate(x, bad, gs, 1) - ref).norm() / ref.norm()).item() > 0.1


def test_plan_and_bounds():
    _, tg = _mods()
    c = tg.plan(tg.CONFIGS["g1"], 4, 28672, 8192, 132)                    # 112 tiles, 264 slots
    assert c["NTOK"] == 8 and c["SPLIT"] * c["ITS"] >= 64 and (c["SPLIT"] - 1) * c["ITS"] < 64
    assert c["SPLIT"] * 112 <= 2 * 264
    assert tg.plan(tg.CONFIGS["g2"], 16, 4096, 4096, 132)["NTOK"] == 16
    assert tg.applies(4096, 4096, 16, 128) and tg.applies(4096, 4096, 1, -1)
    assert not tg.applies(4096, 4096, 17, 128) and not tg.applies(4096, 4160, 1, 128)
    assert not tg.applies(4096, 4096, 1, 64)
    x = torch.randn(17, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M=17"):
        tg.run(x, {"qweight": torch.zeros(4, 16, 32, 4, dtype=torch.int32)}, 128, tg.CONFIGS["g1"], 132)


def test_sm90_compile_keeps_the_weights_in_registers():
    """Compiled here for sm_90 (no GPU), every form: 40 HGMMA a 128-K iteration (8 K steps x 5), each taking its A
    operand from registers; no shared-memory load at all (the only shared stores are the two activation sub-tiles);
    the weights arrive by 16-byte loads; no local memory; at most 255 registers (two CTAs an SM)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _, tg = _mods()
    for ntok in (8, 16):
        for pipe in (False, True):
            r = tg.sass(ntok, pipe)
            s = r["sass"]
            hg = re.findall(r"HGMMA\.64x%dx16\.F32\.BF16 (R\d+|RZ), (\S+), gdesc" % ntok, s)
            assert len(hg) == 40 and all(a.startswith("R") for _, a in hg), (ntok, pipe, hg[:3])
            assert not re.search(r"\b(LDS|LDSM)\b", s), (ntok, pipe)
            assert len(re.findall(r"\bSTS(\.\d+)?\b", s)) == 2, (ntok, pipe)
            assert len(re.findall(r"LDG\.E\.128", s)) >= 16, (ntok, pipe)   # 8 a thread and iteration, + prologue
            assert r["local"] == 0 and r["regs"] <= 255, (ntok, pipe, r["regs"])
            waits = re.findall(r"DEPBAR\.LE gsb0, (0x[0-9a-f]+)", s)
            assert (waits.count("0x5") == 8) == pipe, (ntok, pipe, waits)
