"""Triton W4A16 kernels run through Triton's interpreter on CPU tensors, against the reference op.

TRITON_INTERPRET is set per test with monkeypatch (restored afterwards): int4_triton builds its kernels per
interpreter mode at call time, so nothing leaks into other tests of the same pytest run.
"""
import os
import subprocess
import sys

import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_layout as L
from sdquant.kernels import ops  # noqa: F401  (reference op)

int4_triton = pytest.importorskip("sdquant.kernels.int4_triton")
if not int4_triton.available():
    pytest.skip("triton not installed", allow_module_level=True)

from test_int4_layout import make_qw  # noqa: E402

BOUND = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def run(x, lay, bias=None, path=None):
    return int4_triton.w4a16_triton_impl(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], bias,
                                         force_path=path)


def reference(x, qw, bias=None):
    y = torch.ops.sdquant.int_linear(x.double(), qw.qweight, qw.scales, qw.zeros, qw.g_idx,
                                     None if bias is None else bias.double(), 4, qw.group_size, qw.in_features)
    return y.float()


def rel(y, ref):
    assert torch.isfinite(y).all()
    return float((y.float() - ref).norm() / ref.norm())


# (K, N, group, symmetric, act_order, dtype): real-ish K/N small enough for the interpreter
CASES = [
    (256, 128, 128, True, False, torch.float16),
    (512, 256, 32, False, True, torch.bfloat16),
    (1024, 512, 64, False, False, torch.float16),
    (768, 384, -1, True, False, torch.bfloat16),
]


@pytest.mark.parametrize("k,n,gs,sym,act,dtype", CASES)
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_matches_reference(interpret, k, n, gs, sym, act, dtype, m):
    qw = make_qw(n, k, gs, sym, act, seed=k + m)
    lay = L.repack_triton(qw, dtype)
    x = torch.randn(m, k).to(dtype)
    y = run(x, lay)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel(y, reference(x, qw)) < BOUND[dtype]


@pytest.mark.parametrize("path", ["splitk", "gemm"])
def test_both_paths_with_bias_and_batch_dims(interpret, path):
    qw = make_qw(256, 512, 64, False, True, seed=7)
    lay = L.repack_triton(qw, torch.float16)
    x = torch.randn(2, 3, 512).to(torch.float16)
    bias = torch.randn(256).to(torch.float16)
    y = int4_triton.w4a16_triton_impl(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], bias,
                                      force_path=path)
    assert y.shape == (2, 3, 256)
    assert rel(y.reshape(6, 256), reference(x.reshape(6, 512), qw, bias)) < BOUND[torch.float16]


def test_split_k_partials_reduced(interpret):
    k, n = 4096, 64   # K >> N: the config splits K, exercising the partial-sum reduction kernel
    cfg = int4_triton.splitk_config(1, n, k, 128, 132)
    assert cfg["SPLIT_K"] > 1
    qw = make_qw(n, k, 128, True, False, seed=1)
    lay = L.repack_triton(qw, torch.float16)
    x = torch.randn(1, k).to(torch.float16)
    assert rel(run(x, lay), reference(x, qw)) < BOUND[torch.float16]


def test_cpu_fallback_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qw = make_qw(128, 256, 32, False, True, seed=2)
    lay = L.repack_triton(qw, torch.bfloat16)
    x = torch.randn(5, 256).to(torch.bfloat16)
    y = torch.ops.sdquant.w4a16_triton(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], None)
    assert rel(y, reference(x, qw)) < BOUND[torch.bfloat16]


def test_opcheck(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qw = make_qw(64, 128, 32, False, True, seed=4)
    lay = L.repack_triton(qw, torch.float16)
    x = torch.randn(3, 128).to(torch.float16)
    torch.library.opcheck(torch.ops.sdquant.w4a16_triton,
                          (x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], torch.randn(64).half()))


def test_opcheck_with_counters(interpret):
    """The op with the layout's split-K counters (the GEMV's in-kernel sum at M = 1, under the interpreter): schema,
    fake tensor and AOT dispatch; the counters, read and written by the kernel, are left unchanged (zero)."""
    qw = make_qw(64, 256, 32, False, False, seed=6)
    lay = L.repack_triton(qw, torch.bfloat16)
    x = torch.randn(1, 256).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.sdquant.w4a16_triton,
                          (x, lay["qweight"], lay["scales"], lay["zs"], None, None, lay["locks"]))
    assert int(lay["locks"].abs().sum()) == 0


def test_compile_fullgraph_traces_the_op(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qw = make_qw(64, 128, 128, True, False, seed=5)
    lay = L.repack_triton(qw, torch.float16)
    fn = torch.compile(lambda x: torch.ops.sdquant.w4a16_triton(x, lay["qweight"], lay["scales"], lay["zs"],
                                                                 None, None) * 2, fullgraph=True, backend="eager")
    x = torch.randn(2, 128).half()
    assert rel(fn(x), 2 * reference(x, qw)) < BOUND[torch.float16]


def test_rejects_bad_inputs(interpret):
    lay = L.repack_triton(make_qw(64, 128, 32, True, False), torch.float16)
    with pytest.raises(ShapeError, match="last dim"):
        run(torch.randn(1, 96).half(), lay)
    with pytest.raises(ShapeError, match="dtype"):
        run(torch.randn(1, 128).bfloat16(), lay)
    bad = dict(lay, qweight=lay["qweight"][:, :48])            # N = 48: not a multiple of 32
    with pytest.raises(ShapeError, match="multiples of 32"):
        run(torch.randn(1, 128).half(), bad)


def test_import_sets_no_interpreter_flag():
    code = ("import os, sdquant.kernels.int4_triton, sdquant.kernels.int4_cuda; "
            "assert 'TRITON_INTERPRET' not in os.environ; import torch; "
            "assert not torch.cuda.is_initialized()")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
