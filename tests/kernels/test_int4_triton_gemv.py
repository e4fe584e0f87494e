"""The small-M Triton kernels (sdquant.kernels.int4_triton_gemv) through Triton's interpreter on CPU tensors.

Reference: x @ W.T in float64 with W = QuantizedWeight.dequantize() (the op sdquant::int_linear). TRITON_INTERPRET
is set per test with monkeypatch; the module jits its kernels per interpreter mode, so nothing leaks.
"""
import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_layout as L
from sdquant.kernels import ops  # noqa: F401  (reference op)

int4_triton = pytest.importorskip("sdquant.kernels.int4_triton")
if not int4_triton.available():
    pytest.skip("triton not installed", allow_module_level=True)
from sdquant.kernels import int4_triton_gemv as G  # noqa: E402

from test_int4_layout import make_qw  # noqa: E402

BOUND = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(x, qw, bias=None):
    y = torch.ops.sdquant.int_linear(x.double(), qw.qweight, qw.scales, qw.zeros, qw.g_idx,
                                     None if bias is None else bias.double(), 4, qw.group_size, qw.in_features)
    return y.float()


def rel(y, ref):
    assert torch.isfinite(y).all()
    return float((y.float() - ref).norm() / ref.norm())


def run(x, lay, cfg):
    k = x.shape[-1]
    return G.run(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], k // lay["scales"].shape[0], cfg)


# (K, N, group, symmetric, act_order, dtype): Llama-like ratios, small enough for the interpreter
CASES = [
    (512, 256, 128, True, False, torch.bfloat16),
    (512, 256, 32, False, True, torch.bfloat16),
    (1024, 128, 64, False, False, torch.float16),
    (768, 384, -1, True, False, torch.float16),
    (768, 256, 128, False, True, torch.float16),
]
TC = {"kernel": "tc", "BLOCK_N": 64, "BLOCK_K": 128}
GEMV = {"kernel": "gemv", "BLOCK_N": 128, "BLOCK_K": 64}


@pytest.mark.parametrize("k,n,gs,sym,act,dtype", CASES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("swap", [True, False])
def test_tc_matches_reference(interpret, k, n, gs, sym, act, dtype, m, swap):
    qw = make_qw(n, k, gs, sym, act, seed=k + n + m)
    lay = L.repack_triton(qw, dtype)
    x = torch.randn(m, k).to(dtype)
    y = run(x, lay, {**TC, "SWAP": swap})
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel(y, reference(x, qw)) < BOUND[dtype]


@pytest.mark.parametrize("k,n,gs,sym,act,dtype", CASES)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_gemv_matches_reference(interpret, k, n, gs, sym, act, dtype, m):
    qw = make_qw(n, k, gs, sym, act, seed=k + 2 * n + m)
    lay = L.repack_triton(qw, dtype)
    x = torch.randn(m, k).to(dtype)
    y = run(x, lay, GEMV)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel(y, reference(x, qw)) < BOUND[dtype]


@pytest.mark.parametrize("unpack,swap", [(1, True), (1, False), (3, False)])
def test_tc_fp16_magic_unpack(interpret, unpack, swap):
    """UNPACK=1/3 (the fp16 magic number 0x6400 | code = 1024 + code, bias folded into the zero term) run in the
    interpreter for fp16; the GPU path (UNPACK=2, inline PTX) computes the same values."""
    qw = make_qw(256, 512, 64, False, True, seed=11)
    lay = L.repack_triton(qw, torch.float16)
    x = torch.randn(5, 512).to(torch.float16)
    y = run(x, lay, {**TC, "UNPACK": unpack, "SWAP": swap})
    assert rel(y, reference(x, qw)) < BOUND[torch.float16]


@pytest.mark.parametrize("kernel", ["tc", "gemv"])
@pytest.mark.parametrize("split", [1, 2, 3, 6])
def test_forced_split_k_is_deterministic(interpret, kernel, split):
    qw = make_qw(128, 768, 128, False, False, seed=3)
    lay = L.repack_triton(qw, torch.bfloat16)
    x = torch.randn(2, 768).to(torch.bfloat16)
    cfg = {"kernel": kernel, "BLOCK_N": 64 if kernel == "tc" else 128, "BLOCK_K": 128, "SPLIT_K": split}
    y1, y2 = run(x, lay, cfg), run(x, lay, cfg)
    assert torch.equal(y1, y2)
    assert rel(y1, reference(x, qw)) < BOUND[torch.bfloat16]


def test_gemv_zero_scale_column(interpret):
    """A column whose scale is 0 (zero point undefined) must give 0, not NaN."""
    qw = make_qw(128, 256, 64, False, False, seed=5)
    qw.scales[7] = 0
    lay = L.repack_triton(qw, torch.float16)
    x = torch.randn(1, 256).to(torch.float16)
    y = run(x, lay, GEMV)
    assert torch.isfinite(y).all() and float(y[0, 7].abs()) == 0.0
    assert rel(y, reference(x, qw)) < BOUND[torch.float16]


def test_auto_split_and_fitting():
    # K tiles divisible by the split; enough programs for the target where possible
    assert G.auto_split(8192, 128, 224, 264) == 2
    assert G.auto_split(14336, 128, 32, 264) == 14          # 112 tiles: divisors 1, 2, 4, 7, 8, 14, ...
    assert G.auto_split(256, 128, 1, 264) == 2              # capped by the number of K tiles
    c = G.resolve({"kernel": "tc", "BLOCK_K": 128}, 1, 4096, 4096, 32, 132)
    assert c["BLOCK_K"] == 32                               # a K tile never crosses a group
    c = G.resolve({"kernel": "gemv", "BLOCK_N": 512, "num_warps": 4}, 2, 97 * 32, 4096, 128, 132)
    assert c["BLOCK_N"] == 32 and c["num_warps"] == 1       # N = 3104 = 97 x 32 -> BLOCK_N 32
    with pytest.raises(ShapeError, match="M=5"):
        G.resolve({"kernel": "gemv"}, 5, 4096, 4096, 128, 132)
    with pytest.raises(ShapeError, match="SPLIT_K=5"):
        G.resolve({"kernel": "tc", "SPLIT_K": 5}, 1, 4096, 4096, 128, 132)


def test_plan_per_bucket():
    assert int4_triton.m_bucket(1) == 1 and int4_triton.m_bucket(3) == 4 and int4_triton.m_bucket(9) == 16
    assert int4_triton.small_m_plan(33, 4096, 4096) is None
    for m in range(1, 17):
        cfg = int4_triton.small_m_plan(m, 4096, 4096)
        assert cfg is None or cfg["kernel"] == "tc" or (cfg["kernel"] == "gemv" and m <= 4)


@pytest.mark.parametrize("plan", ["tc", "gemv", None])
def test_op_dispatch_uses_plan(interpret, monkeypatch, plan):
    """The op routes M <= 16 through SMALL_M_PLAN (a gemv plan only where M <= 4), with bias and batch dims."""
    cfg = {"tc": TC, "gemv": GEMV, None: None}[plan]
    monkeypatch.setattr(int4_triton, "SMALL_M_PLAN", {b: cfg for b in (1, 2, 4, 8, 16)})
    qw = make_qw(256, 512, 64, False, True, seed=9)
    lay = L.repack_triton(qw, torch.bfloat16)
    bias = torch.randn(256).to(torch.bfloat16)
    for lead in ((1, 3), (2, 4), (12,)):
        x = torch.randn(*lead, 512).to(torch.bfloat16)
        y = torch.ops.sdquant.w4a16_triton(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], bias)
        assert y.shape == (*lead, 256)
        m = x.numel() // 512
        assert rel(y.reshape(m, 256), reference(x.reshape(m, 512), qw, bias)) < BOUND[torch.bfloat16]


def test_odd_shapes_rejected(interpret):
    lay = L.repack_triton(make_qw(64, 128, 32, True, False), torch.float16)
    with pytest.raises(ShapeError, match="last dim"):
        int4_triton.w4a16_triton_impl(torch.randn(1, 96).half(), lay["qweight"], lay["scales"], lay["zs"], None,
                                      None, force_path="tc")
    bad = dict(lay, qweight=lay["qweight"][:, :48])           # N = 48
    with pytest.raises(ShapeError, match="multiples of 32"):
        int4_triton.w4a16_triton_impl(torch.randn(1, 128).half(), bad["qweight"], bad["scales"], bad["zs"], None,
                                      None, force_path="gemv")
    with pytest.raises(ShapeError, match="M=5"):
        int4_triton.w4a16_triton_impl(torch.randn(5, 128).half(), lay["qweight"], lay["scales"], lay["zs"], None,
                                      None, force_path="gemv")


def test_bench_dry_run(tmp_path):
    """bench/triton_small_m.py --dry: checks, timing loop, plan choice and JSON on CPU (interpreter, child process)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(root / "bench" / "triton_small_m.py"), "--dry", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "triton_small_m.json").read_text())
    assert res["meta"]["dry"] and res["chosen"] is not None
    assert all(c["pass"] for c in res["check"])
    kernels = {row["kernel"] for row in res["rows"]}
    assert {"bf16", "old", "tc128", "gv512k32"} <= kernels


def test_ncu_bench_dry_run():
    """bench/ncu_triton.py --dry: the profiled child (the op as routed, checked against x @ W.T) on CPU, no ncu."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(root / "bench" / "ncu_triton.py"), "--dry"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert sum(ln.startswith("ITEM ") for ln in lines) == 3
    errs = [float(ln.split()[-1]) for ln in lines if ln.strip().startswith("rel err")]
    assert len(errs) == 3 and max(errs) <= 1e-2


@pytest.mark.parametrize("m,split,force", [(1, 3, None), (1, 6, None), (3, 6, True), (4, 2, True)])
def test_split_k_fold_in_kernel_matches_second_pass(interpret, m, split, force):
    """With the layout's counters the last GEMV program of each tile sums the splits (``_fold``; by default at M = 1,
    forced at M = 3-4) instead of ``_reduce_kernel``: the same order from the same start, so the same bits; the
    counters end at zero (the next call reuses them), and a second call agrees too."""
    qw = make_qw(192, 768, 128, False, True, seed=21 + m)
    lay = L.repack_triton(qw, torch.bfloat16)
    assert lay["locks"].shape == (192 // 32,) and lay["locks"].dtype == torch.int32
    x = torch.randn(m, 768).to(torch.bfloat16)
    args = (x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], 128)
    cfg = {**GEMV, "BLOCK_N": 64, "SPLIT_K": split, **({} if force is None else {"fold": force})}
    two = G.run(*args, cfg)
    one = G.run(*args, cfg, lay["locks"])
    again = G.run(*args, cfg, lay["locks"])
    assert int(lay["locks"].abs().sum()) == 0
    assert torch.equal(one, two) and torch.equal(one, again)
    assert rel(one, reference(x, qw)) < BOUND[torch.bfloat16]


def test_split_k_fold_is_chosen_only_where_it_can_run(monkeypatch):
    """``use_fold``: only split-K launches with counters, enough of them (else the second pass), and a config
    that does not opt out; counters of the wrong kind are a one-line error naming them."""
    dev = torch.device("cpu")
    locks = torch.zeros(4, dtype=torch.int32)
    assert G.use_fold(locks, 3, 4, dev, {})
    assert not G.use_fold(locks, 1, 4, dev, {})              # one split: nothing to sum
    assert not G.use_fold(None, 3, 4, dev, {})
    assert not G.use_fold(locks, 3, 5, dev, {})              # too few counters: the second pass
    assert not G.use_fold(locks, 3, 4, dev, {"fold": False})
    assert not G.use_fold(locks, 3, 4, dev, {}, default=False)   # how run() asks at M > 1
    assert G.use_fold(locks, 3, 4, dev, {"fold": True}, default=False)
    with pytest.raises(ShapeError, match="locks"):
        G.use_fold(torch.zeros(4, dtype=torch.int64), 3, 4, dev, {})


def test_op_passes_the_layouts_counters(interpret, monkeypatch):
    """The op, given the layout's counters (QuantLinear passes the layout's buffers by argument name), hands them to
    the kernel and gives the bits of the call without them; the counters end at zero."""
    monkeypatch.setattr(int4_triton, "SMALL_M_PLAN", {b: {**GEMV, "SPLIT_K": 4} for b in (1, 2, 4, 8, 16)})
    qw = make_qw(128, 512, 64, False, False, seed=4)
    lay = L.repack_triton(qw, torch.bfloat16)
    x = torch.randn(1, 512).to(torch.bfloat16)
    y0 = torch.ops.sdquant.w4a16_triton(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], None)
    seen = []
    real_run = G.run

    def spy(*a):
        seen.append(a[7])
        return real_run(*a)
    monkeypatch.setattr(G, "run", spy)
    y1 = torch.ops.sdquant.w4a16_triton(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], None, lay["locks"])
    assert len(seen) == 1 and seen[0] is lay["locks"]
    assert torch.equal(y0, y1) and int(lay["locks"].abs().sum()) == 0


def test_split_k_fold_ptx_for_hopper(monkeypatch):
    """Compiled for sm_90 here (no GPU needed): the GEMV with the fold counts in with one acq_rel atomic add at gpu
    scope (predicated to one thread) after a CTA barrier and reads the partials through L2 (ld.global.cg, one a
    split); without it the kernel has no atomic at all."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = G._kernels()["gemv"]
    types = ["*bf16", "*i32", "*bf16", "*bf16", "*i32", "*bf16", "*fp32", "*i32"] + ["i32"] * 5
    ptx = {}
    for fold in (False, True):
        consts = dict(GS=128, ROWS=1, BLOCK_N=128, BLOCK_K=64, PARTIAL=True, HAS_PERM=False, FOLD=fold,
                      SPLIT=8 if fold else 1, ROWS_P=1)
        sig = dict(zip(fn.arg_names, types + ["constexpr"] * len(consts)))
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        ptx[fold] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]
    atoms = [ln.strip() for ln in ptx[True].splitlines() if "atom." in ln]
    assert len([a for a in atoms if ".acq_rel.add" in a]) == 1 and all(a.startswith("@") for a in atoms), atoms
    assert "ld.global.cg" in ptx[True] and "bar.sync" in ptx[True]
    assert "atom." not in ptx[False] and "ld.global.cg" not in ptx[False]
