"""The fused decode-block op (``sdquant::w4a16_cuda_fused``: RMSNorm scale, SiLU * up, residual add and the next norm's
input inside the tight INT4 kernel) and the runtime's fused decode blocks, on CPU tensors.

On a CPU the op evaluates its reference (``int4_cuda.fused_reference``) over the CUDA layout; these tests check that
reference against the unfused composition it replaces (rms_norm, the canonical-weight linear, SiLU * up, residual add),
its schema (opcheck), its refusals, and that a model decoding through ``Block.forward_fused`` matches the unfused
blocks. The CUDA kernel itself is checked against the same reference on the H200 (bench/fused_ops.py: every tight
variant, both split paths, every mode; docs/benchmarks/decode.md)."""
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


# ------------------------------------------------------------------------------------------ the RoPE / KV-cache epilogue
def _rope_case(m=3, cache_b=4, nh=2, nkv=1, T=16, seed=4):
    """A qkv weight for nh query and nkv KV heads of 128 (K = 256), its layout, a consumer's input and a filled cache."""
    from sdquant.runtime.testing import default_rope_tables
    g = torch.Generator().manual_seed(seed)
    n = (nh + 2 * nkv) * 128
    qw = make_qw(n, 256, 64, False, False, seed=seed)
    lay = L.repack_cuda(qw, DT)
    h = (torch.randn(m, 1, 256, generator=g) * 3).to(DT)
    w_norm = (1 + 0.3 * torch.randn(256, generator=g)).to(DT)
    kv = torch.randn(2, cache_b, nkv, T, 128, generator=g).to(DT)
    cos, sin = (t.to(DT) for t in default_rope_tables(T, 128))
    return qw, lay, h, w_norm, kv, cos, sin


def _rope_op(lay, x, ss, kv, pos, cos, sin, q_cols, config=-1):
    return torch.ops.sdquant.w4a16_cuda_fused_rope(x, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"], ss,
                                                   EPS, kv, pos, cos, sin, q_cols, config)


@pytest.mark.parametrize("pos", [0, 9, 15])
def test_rope_epilogue_is_the_consumer_then_rope_and_the_cache_write(pos):
    """y = [rope(q), rope(k), v] of the consumer's output (each head rotated as the runtime's apply_rope does, HF
    layout) and rope(k), v at slot pos of the first M cache rows; every other cache entry unchanged."""
    from sdquant.runtime.model import apply_rope
    qw, lay, h, w_norm, kv, cos, sin = _rope_case()
    m, q_cols = h.shape[0], 256
    ss = int4_cuda.block_sumsq(h)
    p = torch.tensor([pos])
    c, s = cos[p], sin[p]                                             # [1, 128]: as the runtime passes them
    got = kv.clone()
    y = _rope_op(lay, h * w_norm, ss, got, p, c, s, q_cols)
    plain = _op(h * w_norm, lay, rms_ss=ss)[0]                        # the consumer without the epilogue
    heads = plain.view(m, 1, 4, 128)
    want = torch.cat([apply_rope(heads[:, :, :3], c, s), heads[:, :, 3:]], dim=2).reshape(m, 1, 512)
    assert y.shape == (m, 1, 512) and y.dtype == DT
    assert _rel(y, want) < 1e-2                                       # bf16 rotation there, fp32 here
    assert torch.equal(y[..., 384:], plain[..., 384:])                # v: not rotated
    if pos:                                                           # q and k rotated (at pos 0: cos 1, sin 0)
        assert _rel(y[..., :384], plain[..., :384]) > 0.1
    else:
        assert torch.equal(y[..., :384], plain[..., :384])
    assert torch.equal(got[0, :m, 0, pos], y[:, 0, 256:384]) and torch.equal(got[1, :m, 0, pos], y[:, 0, 384:])
    rest, before = got.clone(), kv.clone()
    rest[:, :m, :, pos], before[:, :m, :, pos] = 0, 0
    assert torch.equal(rest, before)
    # the rotation is the attention kernel's rope_q, rounded once: exactly, from the consumer's rounded output
    from sdquant.kernels.decode_attention import rope_q
    assert torch.equal(y[..., :384].view(m, 3, 128), rope_q(plain[..., :384].view(m, 3, 128), c[0], s[0]).to(DT))


def test_rope_epilogue_opcheck_and_refusals():
    qw, lay, h, w_norm, kv, cos, sin = _rope_case(m=2)
    ss = int4_cuda.block_sumsq(h)
    p = torch.tensor([5])
    torch.library.opcheck(torch.ops.sdquant.w4a16_cuda_fused_rope,
                          (h * w_norm, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"], ss, EPS, kv.clone(),
                           p, cos[p], sin[p], 256, -1))
    x = h * w_norm
    with pytest.raises(ShapeError, match="query columns"):
        _rope_op(lay, x, ss, kv, p, cos[p], sin[p], 128)
    with pytest.raises(ShapeError, match=r"\[2, B, nkv, T, 128\]"):
        _rope_op(lay, x, ss, kv[..., :64], p, cos[p], sin[p], 256)
    with pytest.raises(ShapeError, match="cache of batch 1"):
        _rope_op(lay, x, ss, kv[:, :1], p, cos[p], sin[p], 256)
    with pytest.raises(ShapeError, match="one position"):
        _rope_op(lay, x, ss, kv, torch.tensor([5, 6]), cos[p], sin[p], 256)
    with pytest.raises(ShapeError, match="dtype"):
        _rope_op(lay, x, ss, kv.float(), p, cos[p], sin[p], 256)
    with pytest.raises(ShapeError, match="config 10"):
        _rope_op(lay, x, ss, kv, p, cos[p], sin[p], 256, config=10)


TINY128 = dict(family="llama", vocab_size=512, hidden_size=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128,
               intermediate_size=512, rms_eps=1e-5, tie_embeddings=False)


def test_runtime_kv_write_gemm_matches_index_copy(gpu_like, monkeypatch):
    """Transformer.set_kv_write("gemm") (the default) on fused INT4 blocks with 128-feature heads: each decode step runs
    the qkv GEMM with the RoPE / cache epilogue (one call a layer, no index_copy_), and its logits and caches match the
    index_copy path's; under torch.compile(fullgraph) too. Heads of 64 features keep index_copy, and say why."""
    from sdquant.errors import ConfigError
    from sdquant.runtime.testing import random_decoder
    rt = random_decoder(TINY128, "int4", device="cpu", dtype=DT, lm_head="int4", max_seq_len=64, kernels="cuda",
                        fused=True, group_size=64, seed=5).set_attention("triton")
    prompt = torch.randint(0, rt.d.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))

    def run(step):
        rt.setup_caches(2, 32)
        with torch.no_grad():
            rt(prompt, torch.arange(6))
            ids, out = prompt[:, -1:], []
            for i in range(6, 9):
                logits = step(ids, torch.tensor([i]))
                out.append(logits)
                ids = logits.argmax(-1, keepdim=True)
        return torch.stack(out), torch.stack([blk.attn.kv_cache.kv.clone() for blk in rt.layers])
    assert all(blk.attn.kv_write == "gemm" and blk.attn.attn_preload for blk in rt.layers)  # the default
    rt.set_kv_write("index_copy")
    base = run(rt.decode_step)
    rt.set_kv_write("gemm")
    x = torch.zeros(2, 1, 256, dtype=DT)
    assert all(blk.attn.rope_why_not(x, 2) is None for blk in rt.layers)
    calls = []
    real = torch.ops.sdquant.w4a16_cuda_fused_rope

    class Counted:
        def __call__(self, *a):
            calls.append(a[0].shape)
            return real(*a)
    monkeypatch.setattr(torch.ops.sdquant, "w4a16_cuda_fused_rope", Counted())
    eager = run(rt.decode_step)
    assert len(calls) == 3 * len(rt.layers)
    assert _rel(eager[0], base[0]) < 2e-2 and _rel(eager[1], base[1]) < 1e-2
    assert torch.equal(eager[0].argmax(-1), base[0].argmax(-1))
    monkeypatch.setattr(torch.ops.sdquant, "w4a16_cuda_fused_rope", real)
    comp = run(torch.compile(rt.decode_step, fullgraph=True, backend="aot_eager"))
    assert torch.equal(comp[1], eager[1]) and _rel(comp[0], eager[0]) < 1e-3
    with pytest.raises(ConfigError, match="kv_write"):
        rt.set_kv_write("op")
    small = _tiny(fused=True).set_attention("triton").set_kv_write("gemm")
    small.setup_caches(1, 16)
    assert "128" in small.layers[0].attn.rope_why_not(torch.zeros(1, 1, 256, dtype=DT), 1)
