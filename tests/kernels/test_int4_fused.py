"""The fused decode-block op (``sdquant::w4a16_cuda_fused``: RMSNorm scale, SiLU * up, residual add and the next norm's
input inside the tight INT4 kernel) and the runtime's fused decode blocks, on CPU tensors.

On a CPU the op evaluates its reference (``int4_cuda.fused_reference``) over the CUDA layout; these tests check that
reference against the unfused composition it replaces (rms_norm, the canonical-weight linear, SiLU * up, residual add),
its schema (opcheck), its refusals, and that a model decoding through ``Block.forward_fused`` matches the unfused
blocks. The CUDA kernel itself is checked against the same reference on the H200 (bench/fused_ops.py: every tight
variant, both split paths, every mode; docs/BENCHMARKS.md)."""
import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_cuda
from sdquant.kernels import int4_layout as L
from sdquant.kernels import linear
from sdquant.kernels.ops import int_linear
from sdquant.runtime.model import rms_norm

from test_int4_layout import make_qw  # noqa: E402

DT = torch.bfloat16
EPS = 1e-5


def _lin(x, qw):
    """The unfused linear: the reference op on the canonical tensors."""
    return int_linear(x, qw.qweight, qw.scales, qw.zeros, qw.g_idx, None, 4, qw.group_size, qw.in_features)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _op(x, lay, **kw):
    args = dict(rms_ss=None, rms_eps=EPS, silu=False, resid=None, gamma=None, config=-1)
    args.update(kw)
    return torch.ops.sdquant.w4a16_cuda_fused(x, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"],
                                              args["rms_ss"], args["rms_eps"], args["silu"], args["resid"],
                                              args["gamma"], args["config"])


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("t_block", [64, 128])
def test_consumer_is_rmsnorm_then_linear(m, t_block):
    """y = rsqrt(mean(h^2) + eps) * (h * w_norm) @ W.T, from the producer's partial sums of squares, equals the linear
    of rms_norm(h, w_norm) (HF semantics) up to bf16 rounding of a different order."""
    g = torch.Generator().manual_seed(m)
    qw = make_qw(256, 256, 64, True, False, seed=m)
    lay = L.repack_cuda(qw, DT)
    h = (torch.randn(m, 1, 256, generator=g) * 3).to(DT)
    w_norm = (1 + 0.3 * torch.randn(256, generator=g)).to(DT)
    y, y2, ss = _op(h * w_norm, lay, rms_ss=int4_cuda.block_sumsq(h, t_block))
    ref = _lin(rms_norm(h, w_norm, EPS), qw)
    assert y.shape == ref.shape == (m, 1, 256) and y.dtype == DT
    assert _rel(y, ref) < 1e-2
    assert y2.numel() == 0 and ss.numel() == 0
    # without the scale the result differs by the RMS: the statistic is really applied
    assert _rel(_op(h * w_norm, lay)[0], ref) > 0.5


def test_silu_consumer_matches_silu_of_gate_times_up():
    g = torch.Generator().manual_seed(5)
    gate, up = make_qw(128, 256, 64, False, False, seed=1), make_qw(128, 256, 64, False, False, seed=2)
    perm = int4_cuda.interleave_gate_up(128)
    cat = lambda a, b: None if a is None else torch.cat([a, b])[perm]  # noqa: E731
    from sdquant.quant.qtensor import QuantizedWeight
    w13 = QuantizedWeight(cat(gate.qweight, up.qweight), cat(gate.scales, up.scales), cat(gate.zeros, up.zeros), 4,
                          64, 256)
    lay = L.repack_cuda(w13, DT)
    h = torch.randn(2, 256, generator=g).to(DT)
    w_norm = (1 + 0.3 * torch.randn(256, generator=g)).to(DT)
    y = _op(h * w_norm, lay, rms_ss=int4_cuda.block_sumsq(h), silu=True)[0]
    xn = rms_norm(h, w_norm, EPS)
    ref = torch.nn.functional.silu(_lin(xn, gate)) * _lin(xn, up)
    assert y.shape == (2, 128)
    assert _rel(y, ref) < 2e-2
    # the interleave is what the op reads: de-interleaving the plain output gives the same halves
    full = torch.ops.sdquant.w4a16_cuda(xn, lay["qweight"], lay["scales"], lay["zeros"], None, lay["locks"], None)
    gg, uu = int4_cuda.deinterleave_gate_up(full)
    assert _rel(gg, _lin(xn, gate)) < 1e-2 and _rel(uu, _lin(xn, up)) < 1e-2


@pytest.mark.parametrize("m", [1, 5])
def test_producer_adds_the_residual_and_prepares_the_next_norm(m):
    g = torch.Generator().manual_seed(7)
    qw = make_qw(256, 128, 64, False, False, seed=3)
    lay = L.repack_cuda(qw, DT)
    x = torch.randn(m, 128, generator=g).to(DT)
    resid = torch.randn(m, 256, generator=g).to(DT)
    gamma = (1 + 0.3 * torch.randn(256, generator=g)).to(DT)
    y, y2, ss = _op(x, lay, resid=resid, gamma=gamma)
    h = resid + _lin(x, qw)
    assert _rel(y, h) < 1e-2
    assert _rel(y2, y * gamma) < 1e-2
    # ss: the sums of squares of y's 64-column blocks, exactly what the next consumer reads
    assert ss.dtype == torch.float32 and ss.shape == (m, 4)
    torch.testing.assert_close(ss, y.float().pow(2).view(m, 4, 64).sum(-1))
    # chained into a consumer it is the next block's RMSNorm
    nxt = make_qw(128, 256, 64, True, False, seed=4)
    ln = L.repack_cuda(nxt, DT)
    z = _op(y2, ln, rms_ss=ss)[0]
    assert _rel(z, _lin(rms_norm(y, gamma, EPS), nxt)) < 2e-2


def test_opcheck():
    qw = make_qw(128, 128, 64, True, False, seed=9)
    lay = L.repack_cuda(qw, DT)
    x = torch.randn(2, 128).to(DT)
    r = torch.randn(2, 128).to(DT)
    gam = torch.rand(128).to(DT) + 0.5
    ss = torch.rand(2, 2) * 100
    for kw in (dict(rms_ss=ss), dict(resid=r, gamma=gam), dict(rms_ss=ss, silu=True)):
        args = dict(rms_ss=None, rms_eps=EPS, silu=False, resid=None, gamma=None, config=-1)
        args.update(kw)
        torch.library.opcheck(torch.ops.sdquant.w4a16_cuda_fused,
                              (x, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"], args["rms_ss"],
                               args["rms_eps"], args["silu"], args["resid"], args["gamma"], args["config"]))


def test_refusals():
    qw = make_qw(128, 128, 64, True, False, seed=2)
    lay = L.repack_cuda(qw, DT)
    with pytest.raises(ShapeError, match="M=9"):
        _op(torch.randn(9, 128).to(DT), lay)
    with pytest.raises(ShapeError, match="config 10"):
        _op(torch.randn(1, 128).to(DT), lay, config=10)
    with pytest.raises(ShapeError, match="partial sums"):
        _op(torch.randn(1, 128).to(DT), lay, rms_ss=torch.ones(1, 257))
    with pytest.raises(ShapeError, match="gamma"):
        _op(torch.randn(1, 128).to(DT), lay, resid=torch.randn(1, 128).to(DT), gamma=torch.ones(64).to(DT))
    lay64 = L.repack_cuda(make_qw(64, 128, 64, True, False), DT)
    with pytest.raises(ShapeError, match="multiple of 128"):
        _op(torch.randn(1, 128).to(DT), lay64)
    assert int4_cuda.fused_supported(1, 4096, 4096, 32) is not None  # group 32: the tight kernel's chunks are 64
    assert int4_cuda.fused_supported(8, 4096, 4096, 128) is None
    with pytest.raises(ShapeError):
        int4_cuda.interleave_gate_up(100)


def test_fused_config_is_a_tight_variant():
    for m, n, k in ((1, 6144, 4096), (8, 6144, 4096), (1, 28672, 4096), (4, 4096, 14336), (1, 128256, 4096)):
        assert int4_cuda.fused_config(m, n, k) % 64 in int4_cuda.TIGHT_VARIANTS
    assert int4_cuda.fused_config(8, 6144, 4096) == 38  # the table's M = 8 choice there (37) is a lean variant


# ------------------------------------------------------------------------------------------ the runtime
@pytest.fixture
def gpu_like(monkeypatch):
    """The CUDA layout built on the host (the op evaluates it with PyTorch), Triton in its interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_cuda_kernel_runs", lambda device: True)


def _tiny(fused):
    from sdquant.runtime.testing import TINY, random_decoder
    rt = random_decoder(TINY, "int4", device="cpu", dtype=DT, lm_head="int4", max_seq_len=64, kernels="cuda",
                        fused=fused, group_size=64, seed=3)
    g = torch.Generator().manual_seed(11)
    for blk in rt.layers:  # random norm weights (the random model's are ones)
        blk.attn_norm = (1 + 0.3 * torch.randn(blk.attn_norm.shape, generator=g)).to(DT)
        blk.ffn_norm = (1 + 0.3 * torch.randn(blk.ffn_norm.shape, generator=g)).to(DT)
    rt.norm = (1 + 0.3 * torch.randn(rt.norm.shape, generator=g)).to(DT)
    return rt


def test_fused_decode_matches_unfused_blocks(gpu_like):
    rt = _tiny(fused=True)
    assert rt.fused_decode and all(blk.gate_up_block == 64 for blk in rt.layers)
    assert rt.fused_why_not(2) is None
    assert "M=9" in rt.fused_why_not(9) and "prompt" in rt.fused_why_not(2, s=4)
    rt.setup_caches(2, 32)
    prompt = torch.randint(0, rt.d.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rt(prompt, torch.arange(5))                      # a prompt: the unfused blocks
        idx = torch.randint(0, rt.d.vocab_size, (2, 1), generator=torch.Generator().manual_seed(1))
        pos = torch.tensor([5])
        fused = rt.decode_step(idx, pos)
        rt.fused_decode = False
        plain = rt.decode_step(idx, pos)
    assert fused.shape == plain.shape == (2, rt.d.vocab_size)
    assert _rel(fused, plain) < 2e-2
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_fused_block_traces_fullgraph(gpu_like):
    from sdquant.runtime.model import _fused_block_call
    rt = _tiny(fused=True)
    rt.setup_caches(1, 16)
    blk = rt.layers[0]
    x = torch.randn(1, 1, rt.d.hidden_size).to(DT)
    pos = torch.tensor([3])
    args = (blk, x, x * blk.attn_norm, int4_cuda.block_sumsq(x), rt.rope_cos[pos], rt.rope_sin[pos],
            rt.masks[None][pos], pos, rt.layers[1].attn_norm)
    with torch.no_grad():
        want = _fused_block_call(*args)
        got = torch.compile(_fused_block_call, fullgraph=True, backend="eager")(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_fused_is_off_without_the_cuda_kernel():
    """fused=None on a CPU model: off (the layers plan the reference op), w13 keeps gate rows then up rows."""
    from sdquant.runtime.testing import TINY, random_decoder
    rt = random_decoder(TINY, "int4", device="cpu", dtype=DT, max_seq_len=32)
    assert not rt.fused_decode and all(blk.gate_up_block == 0 for blk in rt.layers)
    assert rt.fused_why_not(1) == "fused decode is off"
