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


def test_act_order_gathers_the_activations():
    """With act-order the CUDA layout holds K permuted; ``run`` gathers x's columns by the layout's perm first (on the
    CPU into the emulation), and the result is x @ W.T in the original order."""
    gemm, tg = _mods()
    from sdquant.kernels import int4_layout
    qw = gemm.random_int4(256, 512, gs=128, symmetric=False, act_order=True, seed=21)
    lay = int4_layout.repack_cuda(qw, torch.float16)
    assert lay["perm"] is not None
    x = torch.randn(5, 512, dtype=torch.float16)
    ref = x.double() @ qw.dequantize().double().t()
    y = tg.run(x, lay, 128, tg.CONFIGS["r3"], 4)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-3
    unperm = dict(lay, perm=None)                         # without the gather the columns meet the wrong weights
    assert ((tg.run(x, unperm, 128, tg.CONFIGS["r3"], 4).double() - ref).norm() / ref.norm()).item() > 0.1


def test_diagnose_reports_clean_rows_on_the_emulation():
    """The device run's first step, on the CPU (``run`` emulates there): one row per config, dtype, M and split form,
    each correct and with no bad features to summarize."""
    _, tg = _mods()
    rows = tg.diagnose(132, device="cpu")
    assert len(rows) == len(tg.CONFIGS) * 3 + 3
    assert all(r["rel_err"] < 1e-2 and "bad_features" not in r and "fail" not in r for r in rows), rows


def test_plan_and_bounds():
    _, tg = _mods()
    c = tg.plan(tg.CONFIGS["p1"], 4, 28672, 8192, 132)                    # 112 tiles, 264 slots
    assert c["NTOK"] == 8 and c["SPLIT"] * c["ITS"] >= 64 and (c["SPLIT"] - 1) * c["ITS"] < 64
    assert c["SPLIT"] * 112 <= 2 * 264
    assert tg.plan(tg.CONFIGS["r3"], 16, 4096, 4096, 132)["NTOK"] == 16
    assert tg.plan(dict(tg.CONFIGS["r3"], split=1), 16, 4096, 4096, 132)["SPLIT"] == 1
    # the split count that fills the last wave of resident CTAs best: 16 tiles x 23 splits (5 of the 112 iterations
    # each) is 368 of the 396 slots of 3 CTAs an SM (0.93 of a wave)
    c = tg.plan(tg.CONFIGS["r3"], 16, 4096, 14336, 132)
    assert (c["SPLIT"], c["ITS"]) == (23, 5)
    assert tg.applies(4096, 4096, 16, 128) and tg.applies(4096, 4096, 1, -1)
    assert not tg.applies(4096, 4096, 17, 128) and not tg.applies(4096, 4160, 1, 128)
    assert not tg.applies(4096, 4096, 1, 64)
    x = torch.randn(17, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M=17"):
        tg.run(x, {"qweight": torch.zeros(4, 16, 32, 4, dtype=torch.int32)}, 128, tg.CONFIGS["p1"], 132)


def test_sm90_compile_keeps_the_weights_in_registers():
    """Compiled here for sm_90 (no GPU), the three kernels (bf16, and one fp16 form): 40 HGMMA a 128-K iteration (8 K steps x 5), each taking its A
    operand from registers; no local memory; at most 255 registers. The register-prefetch kernel reads no shared
    memory at all (its only shared stores are the two activation sub-tiles) and loads the words 16 bytes at a time; the
    ring kernel copies words and activations by 16-byte cp.async and reads the words back with 8 16-byte shared loads
    an iteration (no other shared load, no shared store); the mma.sync kernel takes no shared memory, 40 HMMA an
    iteration and n8 tile. PIPE keeps a K step's five wgmmas in flight. FOLD adds the
    split-K count-in: one atomic add and one reset of the tile's counter, and the partials read back through L2."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _, tg = _mods()
    for kernel, ntok, pipe, stages, f16, fold in (("raw", 8, False, 0, False, False), ("raw", 16, True, 0, False, True),
                                                  ("ring", 16, False, 4, False, False), ("ring", 8, True, 3, False, False),
                                                  ("ring", 16, False, 3, True, True),
                                                  ("mma", 8, False, 0, False, False), ("mma", 16, False, 0, False, True)):
        r = tg.sass(ntok, pipe, kernel, stages, f16, fold)
        s, what = r["sass"], (kernel, ntok, pipe, stages, f16, fold)
        # FOLD: one counter add (acq_rel at gpu scope: STRONG.GPU) and one reset; the partials read back through L2
        atoms = re.findall(r"ATOMG\.E\.(ADD|EXCH)\.STRONG\.GPU", s)
        assert sorted(atoms) == (["ADD", "EXCH"] if fold else []), what
        assert ("LDG.E.STRONG.GPU" in s) == fold, what
        assert ("0x64006400" if f16 else "0x43004300") in s, what          # the magic: 1024 + c / 128 + c
        if kernel == "mma":   # 5 m16n8k16 a K step and n8 tile, 8 K steps
            assert len(re.findall(r"HMMA\.16816\.F32%s " % ("" if f16 else r"\.BF16"), s)) == 40 * ntok // 8, what
        else:
            hg = re.findall(r"HGMMA\.64x%dx16\.F32%s (R\d+|RZ), (\S+), gdesc" % (ntok, "" if f16 else r"\.BF16"), s)
            assert len(hg) == 40 and all(a.startswith("R") for _, a in hg), (what, hg[:3])
        assert r["local"] == 0 and r["regs"] <= 255, (what, r["regs"])
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", s)
        if kernel != "mma":
            assert (waits.count("0x5") == 8) == pipe and waits.count("0x0") == (1 if pipe else 8), (what, waits)
        live = "\n".join(ln for ln in s.splitlines() if "@!PT" not in ln)   # (never-issued padding aside)
        lds = re.findall(r"\bLDS(\.\d+)?\b", live)
        sts = re.findall(r"\bSTS(\.\d+)?\b", live)
        assert "LDSM" not in live, what
        # FOLD's scalar count-in is broadcast through shared memory: one more store and one more load
        if kernel == "mma":   # no shared memory but FOLD's broadcast; the words by 16-byte loads
            assert lds == [""] * int(fold) and sts == [""] * int(fold), what
            assert len(re.findall(r"LDG\.E\.128", s)) >= 16, what
        elif kernel == "raw":
            assert (lds.count(""), lds.count(".128")) == (int(fold), 0), what
            assert (sts.count(""), len(sts) - sts.count("")) == (int(fold), 2), what   # the two sub-tiles: 8 / 16 B
            assert len(re.findall(r"LDG\.E\.128", s)) >= 16, what   # 8 a thread and iteration, + the prologue
        else:
            assert (lds.count(""), lds.count(".128")) == (int(fold), 8) and sts == [""] * int(fold), what
            assert len(re.findall(r"LDGSTS\.E\.BYPASS\.128", s)) >= 8 * stages, what
            assert r["shared"] >= stages * 16384, what


def test_the_fragment_chain_puts_each_nibble_where_the_wgmma_reads_it(interpret):
    """The join / reshape / permute / split chain of the kernel's ``a_tiles`` and ``steps8`` (the same ops in plain
    Triton, which share Gluon's semantics and run under the interpreter; nibbles by shifts in place of the inline PTX)
    puts nibble i of word u, lane 4 g + t4, K step ks (pair element e: nibble i + 4) at row 16 v + 8 (i // 2) + g and
    column 8 (i % 2) + 2 t4 + e of tile u of step ks: the fragment of the CUDA layout."""
    import triton
    import triton.language as tl

    @triton.jit
    def chain(q_ptr, o_ptr):
        # q: int32 [4 v, 8 ks, 32 lanes, 4 u]; o: [8 ks, 4 u, 64, 16] int32 codes
        i_v = tl.arange(0, 4)[:, None, None, None]
        i_k = tl.arange(0, 8)[None, :, None, None]
        i_l = tl.arange(0, 32)[None, None, :, None]
        i_u = tl.arange(0, 4)[None, None, None, :]
        w = tl.load(q_ptr + i_v * 1024 + i_k * 128 + i_l * 4 + i_u)
        w = w.permute([0, 2, 3, 1]).reshape([4, 32, 4, 2, 2, 2])              # steps8
        y0, y1 = tl.split(w)
        y00, y01 = tl.split(y0)
        y10, y11 = tl.split(y1)
        s0, s4 = tl.split(y00)
        s2, s6 = tl.split(y01)
        s1, s5 = tl.split(y10)
        s3, s7 = tl.split(y11)
        st = (s0, s1, s2, s3, s4, s5, s6, s7)
        r = tl.arange(0, 64)[:, None]
        c = tl.arange(0, 16)[None, :]
        for ks in tl.static_range(8):
            t = st[ks]
            n0 = tl.join(t & 0xF, (t >> 16) & 0xF)                            # raw(t, i): pair (i, i + 4)
            n1 = tl.join((t >> 4) & 0xF, (t >> 20) & 0xF)
            n2 = tl.join((t >> 8) & 0xF, (t >> 24) & 0xF)
            n3 = tl.join((t >> 12) & 0xF, (t >> 28) & 0xF)
            a = tl.join(tl.join(n0, n1), tl.join(n2, n3))                      # a_tiles
            a = a.reshape([4, 8, 4, 2, 2, 2, 2, 2]).permute([0, 7, 1, 6, 2, 5, 3, 4]).reshape([64, 16, 2, 2])
            x0, x1 = tl.split(a)
            t0, t2 = tl.split(x0)
            t1, t3 = tl.split(x1)
            base = o_ptr + ks * 4096 + r * 16 + c
            tl.store(base, t0)
            tl.store(base + 1024, t1)
            tl.store(base + 2048, t2)
            tl.store(base + 3072, t3)

    g = torch.Generator().manual_seed(5)
    q = torch.randint(-2**31, 2**31 - 1, (4, 8, 32, 4), dtype=torch.int64, generator=g).to(torch.int32)
    o = torch.empty(8, 4, 64, 16, dtype=torch.int32)
    chain[(1,)](q, o)
    qq = q.to(torch.int64) & 0xFFFFFFFF
    v, h, gg, kj, t4, e = torch.meshgrid(*[torch.arange(n) for n in (4, 2, 8, 2, 4, 2)], indexing="ij")
    shift = 4 * (2 * h + kj) + 16 * e                                          # nibble i = 2 h + kj, + 4 for e = 1
    for ks in range(8):
        for u in range(4):
            want = (qq[v, ks, 4 * gg + t4, u] >> shift) & 0xF
            got = o[ks, u][16 * v + 8 * h + gg, 8 * kj + 2 * t4 + e]
            assert torch.equal(got.to(torch.int64), want), (ks, u)
    # and every element: the tiles hold each nibble of the iteration exactly once
    assert torch.equal(torch.sort(o.flatten().to(torch.int64))[0],
                       torch.sort(torch.cat([(qq >> (4 * p)) & 0xF for p in range(8)]).flatten())[0])
