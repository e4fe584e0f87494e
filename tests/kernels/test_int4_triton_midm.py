"""The mid-M swap-AB Triton W4A16 GEMM (sdquant.kernels.int4_triton_midm) through Triton's interpreter on CPU.

Reference: x @ W.T in float64 with W = QuantizedWeight.dequantize() (the op sdquant::int_linear), and the layout's
own meaning (int4_layout.dequantize_triton + F.linear in float64). TRITON_INTERPRET is set per test with
monkeypatch; the module jits its kernels per interpreter mode, so nothing leaks into other tests.
"""
import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_layout as L
from sdquant.kernels import ops  # noqa: F401  (reference op)

int4_triton = pytest.importorskip("sdquant.kernels.int4_triton")
if not int4_triton.available():
    pytest.skip("triton not installed", allow_module_level=True)
from sdquant.kernels import int4_triton_midm as MM  # noqa: E402

from test_int4_layout import make_qw  # noqa: E402

BOUND = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(x, qw):
    y = torch.ops.sdquant.int_linear(x.double(), qw.qweight, qw.scales, qw.zeros, qw.g_idx, None, 4,
                                     qw.group_size, qw.in_features)
    return y.float()


def layout_reference(x, lay):
    return torch.nn.functional.linear(x.double(), L.dequantize_triton(lay).double()).float()


def rel(y, ref):
    assert torch.isfinite(y).all()
    return float((y.float() - ref).norm() / ref.norm())


def run(x, lay, cfg=None):
    k = x.shape[-1]
    return MM.run(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], k // lay["scales"].shape[0], cfg)


# (K, N, group, symmetric, act_order, dtype, M, config overrides): odd and Llama-like ratios, small enough for the
# interpreter; split-K forced on (2, 3, 4) and off (1); the smallest BLOCK_M / BLOCK_N / BLOCK_K that still take
# several tiles of each
CASES = [
    (512, 256, 128, True, False, torch.bfloat16, 17, {"SPLIT_K": 1}),
    (512, 256, 32, False, True, torch.bfloat16, 33, {"SPLIT_K": 2, "BLOCK_K": 64}),
    (1024, 128, 64, False, False, torch.float16, 64, {"SPLIT_K": 4, "BLOCK_M": 32}),
    (768, 96, -1, True, False, torch.float16, 45, {}),                       # per-channel, odd N/32 and M
    (768, 256, 128, False, True, torch.float16, 100, {"BLOCK_M": 64, "BLOCK_N": 64, "SPLIT_K": 3}),
    (384, 160, 32, True, True, torch.bfloat16, 64, {"BLOCK_K": 128, "BLOCK_N": 32}),  # groups smaller than BK
    (512, 128, 128, False, False, torch.float16, 3, {}),                     # M = 3..16: one 16-row tile
    (256, 192, 64, True, True, torch.bfloat16, 9, {"SPLIT_K": 2}),
    # SCALE_ACC: raw codes into the MMA, the scale applied to each K tile's product
    (512, 256, 64, False, True, torch.bfloat16, 40, {"SCALE_ACC": True, "SPLIT_K": 2}),
    (768, 128, -1, False, False, torch.float16, 19, {"SCALE_ACC": True}),
]


@pytest.mark.parametrize("k,n,gs,sym,act,dtype,m,cfg", CASES)
def test_matches_reference(interpret, k, n, gs, sym, act, dtype, m, cfg):
    qw = make_qw(n, k, gs, sym, act, seed=k + n + m)
    lay = L.repack_triton(qw, dtype)
    x = torch.randn(m, k).to(dtype)
    y = run(x, lay, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel(y, reference(x, qw)) < BOUND[dtype]
    assert rel(y, layout_reference(x, lay)) < BOUND[dtype]


def test_resolve_splits_k_when_tiles_do_not_fill_the_sms():
    # 14336 x 4096 at M = 64: 32 tiles of 128 features; split-K brings it to at least one wave of 132 SMs
    c = MM.resolve(MM.default_config(64), 64, 4096, 14336, 128, 132)
    assert c["SPLIT_K"] > 1 and (14336 // c["BLOCK_K"]) % c["SPLIT_K"] == 0
    assert (4096 // c["BLOCK_N"]) * c["SPLIT_K"] >= 132
    # 8192 x 28672 at M = 64: 224 tiles already fill them
    assert MM.resolve(MM.default_config(64), 64, 28672, 8192, 128, 132)["SPLIT_K"] == 1
    # BLOCK_M shrinks to what M needs; BLOCK_K stays inside a group larger than it (192 -> 64), and smaller
    # groups are gathered per word (64 < 128 keeps 128)
    c = MM.resolve({"BLOCK_M": 128, "BLOCK_K": 128}, 20, 4096, 4608, 192, 132)
    assert c["BLOCK_M"] == 32 and c["BLOCK_K"] == 64
    assert MM.resolve({"BLOCK_K": 128}, 20, 4096, 4096, 64, 132)["BLOCK_K"] == 128


def test_op_runs_m_2_here_and_matches_the_reference(interpret, monkeypatch):
    # M = 2 (a planned bucket since run 4 of bench/triton_mid_m.py): the op routes to this kernel, 30 of 32 rows masked
    monkeypatch.setitem(int4_triton.MID_M_PLAN, 2, {**MM.default_config(2)})
    calls = []
    real = MM.run
    monkeypatch.setattr(MM, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    qw = make_qw(128, 256, 64, True, False, seed=5)
    lay = L.repack_triton(qw, torch.float16)
    x = torch.randn(2, 256).to(torch.float16)
    y = int4_triton.w4a16_triton_impl(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], None)
    assert calls and y.shape == (2, 128)
    assert rel(y, reference(x, qw)) < BOUND[torch.float16]


def test_op_routes_mid_m_here(interpret, monkeypatch):
    # the op's dispatch runs this kernel for a planned bucket; bias and batch dims go through the op
    monkeypatch.setitem(int4_triton.MID_M_PLAN, 64, {**MM.default_config(64), "SPLIT_K": 2})
    calls = []
    real = MM.run
    monkeypatch.setattr(MM, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    qw = make_qw(128, 256, 64, False, True, seed=3)
    lay = L.repack_triton(qw, torch.float16)
    x = torch.randn(2, 20, 256).to(torch.float16)
    bias = torch.randn(128).to(torch.float16)
    y = int4_triton.w4a16_triton_impl(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], bias)
    assert calls and y.shape == (2, 20, 128)
    ref = reference(x.reshape(40, 256), qw) + bias.float()
    assert rel(y.reshape(40, 128), ref) < BOUND[torch.float16]


def test_plan_leaves_m_1_to_the_gemv():
    # M = 1 everywhere, and M = 2 where the GEMV was measured faster (8192x10240, and since its folded zero point
    # 8192x28672 and 4096x28672), run the GEMV of the small-M plan
    assert int4_triton.mid_m_plan(1, 4096, 4096) is None and int4_triton.mid_m_plan(2, 10240, 8192) is None
    for n, k in ((10240, 8192), (28672, 8192), (28672, 4096)):
        assert int4_triton.mid_m_plan(2, n, k) is None and int4_triton.small_m_plan(2, n, k)["kernel"] == "gemv"
    assert int4_triton.mid_m_plan(2, 8192, 28672) is not None and int4_triton.mid_m_plan(2, 6144, 4096)["waves"] == 2.0
    for m in (2, 3, 17, 64, 300, 1024):
        cfg = int4_triton.mid_m_plan(m, 8192, 28672)
        assert cfg is not None and MM.resolve(cfg, m, 8192, 28672, 128, 132)["BLOCK_M"] >= 16


def test_shapes_that_do_not_divide(interpret):
    lay = L.repack_triton(make_qw(64, 256, 128, True, False), torch.float16)
    bad = dict(lay, qweight=lay["qweight"][:, :48])            # N = 48: not a multiple of 32
    with pytest.raises(ShapeError, match="multiples of 32"):
        int4_triton.w4a16_triton_impl(torch.randn(40, 256).half(), bad["qweight"], bad["scales"], bad["zs"],
                                      None, None, force_path="midm")
    with pytest.raises(ShapeError, match="SPLIT_K=3"):
        run(torch.randn(40, 256).half(), lay, {"SPLIT_K": 3, "BLOCK_K": 128})   # 2 K tiles
    with pytest.raises(ShapeError, match="do not divide"):
        MM.run(torch.randn(40, 256).half(), lay["qweight"][:, :48], lay["scales"][:, :48], lay["zs"][:, :48],
               None, 128, {"BLOCK_N": 32})


def test_bytes_prototype_dry_run():
    """bench/triton_bytes.py --dry: the byte-layout swap-AB prototype (pending 12 of docs/benchmarks/pending.md) matches
    x @ W.T under Triton's interpreter (fp16; symmetric / asymmetric, group 128 / 64 / per-channel, M = 1 / 3 / 17,
    every config), so that its device run times a correct kernel."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(root / "bench" / "triton_bytes.py"), "--dry"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 3 * 3 * 5 and max(row["rel_err"] for row in rows) <= 2e-3


def test_frag_prototype_dry_run_and_layout():
    """bench/triton_frag.py (pending 12 of docs/benchmarks/pending.md): its repack puts code (n, k) where the docstring says
    (decoded here independently of the kernel), it rejects groups smaller than 128, and --dry matches x @ W.T under
    Triton's interpreter for every config (fp16; symmetric / asymmetric, group 128 / 256 / per-channel, M = 1 / 3 /
    17), so that its device runs time a correct kernel."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "bench"))
    try:
        import gemm
        import triton_frag
    finally:
        sys.path.remove(str(root / "bench"))
    n, k = 64, 384
    qw = gemm.random_int4(n, k, gs=128, symmetric=False, seed=3)
    lay = triton_frag.repack_frag(qw, torch.float16)
    words = lay["qweight"].view(n, k // 128, 4, 4)                         # [n, block, jlo, jhi]
    codes = qw.codes()
    for kk in (0, 1, 2, 7, 8, 9, 31, 32, 33, 100, 127, 128, 200, 383):
        b, kp = divmod(kk, 128)
        jhi, i1, i0, jlo, h = kp >> 5, (kp >> 4) & 1, (kp >> 3) & 1, (kp >> 1) & 3, kp & 1
        p = (i0 + 2 * i1) + 4 * h
        got = (words[:, b, jlo, jhi] >> (4 * p)) & 0xF
        assert torch.equal(got.to(torch.uint8), codes[:, kk].to(torch.uint8)), kk
    sz = lay["sz"]                                                          # [K/128, N]
    s = (sz & 0xFFFF).to(torch.int16).view(torch.float16).float()
    zb = ((sz >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float()
    assert torch.equal(s, qw.scales.float().t().to(torch.float16).float())
    assert torch.equal(zb - 1024, qw.zeros.float().t())
    with pytest.raises(ValueError, match="multiples of 128"):
        triton_frag.repack_frag(gemm.random_int4(n, 256, gs=64, seed=4), torch.float16)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(root / "bench" / "triton_frag.py"), "--dry"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    expected = sum(triton_frag.dry_applies(c, k, n, m) for (k, n, _, _) in triton_frag.DRY_SHAPES
                   for m in triton_frag.DRY_MS for c in triton_frag.CONFIGS.values())
    assert expected >= 40 and len(rows) == expected and max(row["rel_err"] for row in rows) <= 2e-3
