"""Repacking canonical 4-bit weights into the Triton and CUDA kernel layouts, and back."""
import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_layout as L
from sdquant.quant.qtensor import QuantizedWeight

CASES = [  # (N, K, group_size, symmetric, act_order)
    (128, 256, 64, True, False),
    (192, 512, 32, False, True),
    (64, 128, -1, False, False),
    (128, 256, 128, False, True),
]


def make_qw(n, k, gs, sym, act, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    groups = 1 if gs == -1 else k // gs
    scales = torch.rand(n, groups, generator=g) * 0.1 + 0.01
    zeros = None if sym else torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    g_idx = (torch.randperm(k, generator=g) // gs).to(torch.int32) if act else None
    return QuantizedWeight.from_codes(codes, scales, zeros, 4, gs, g_idx)


@pytest.mark.parametrize("n,k,gs,sym,act", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip(n, k, gs, sym, act, dtype):
    qw = make_qw(n, k, gs, sym, act)
    ref = qw.dequantize()
    for repack, unpack, deq in ((L.repack_triton, L.unpack_triton, L.dequantize_triton),
                                (L.repack_cuda, L.unpack_cuda, L.dequantize_cuda)):
        lay = repack(qw, dtype)
        assert all(t is None or t.is_contiguous() for t in lay.values())
        back = unpack(lay, sym)
        assert torch.equal(back.codes(), qw.codes())          # codes and channel order survive exactly
        assert (back.zeros is None) == sym
        if act:
            assert torch.equal(back.g_idx, qw.g_idx)
        # the CUDA layout keeps fp16 scales and integer zeros: exact. Triton stores s and -z*s rounded to the
        # activation dtype (one FMA per weight), so it is within that dtype's rounding.
        tol = 0.0 if repack is L.repack_cuda else (1e-3 if dtype == torch.float16 else 1e-2)
        err = (deq(lay) - ref).abs().max() / ref.abs().max()
        assert float(err) <= tol
        assert float((back.dequantize() - ref).abs().max() / ref.abs().max()) <= tol


def test_cuda_fragment_order():
    """Lane 4g+t, word w, nibble p of tile (nb, kb) holds W[nb*64 + 16w + 8*(p>>1 & 1) + g, kb*16 + 2t + ...]."""
    n, k = 64, 64
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    qw = QuantizedWeight.from_codes(codes, torch.ones(n, 1), None, 4, -1)
    words = L.repack_cuda(qw, torch.float16)["qweight"]          # [1, 4, 32, 4]
    for kb in range(4):
        for lane in (0, 5, 31):
            g, t = lane // 4, lane % 4
            for w in range(4):
                word = int(words[0, kb, lane, w]) & 0xFFFFFFFF
                for p in range(8):
                    joff, krow = L._CUDA_NIBBLES[p]
                    row = 16 * w + 8 * joff + g
                    assert (word >> (4 * p)) & 0xF == int(codes[row, kb * 16 + 2 * t + krow])


def test_cuda_locks_cover_a_stream_k_grid():
    """The CUDA layout's split-K / stream-K counters: max(N/64, CUDA_LOCKS_MIN) int32 zeros (the warp-specialized
    stream-K counts in on its owner CTA's lock, one a CTA of its grid: csrc/w4a16.h SDQ_LOCKS_MIN)."""
    import re
    from sdquant.kernels import int4_cuda
    header = (int4_cuda.CSRC / "w4a16.h").read_text()
    assert int(re.search(r"#define SDQ_LOCKS_MIN (\d+)", header).group(1)) == L.CUDA_LOCKS_MIN == 1024
    for n in (128, 64 * 1024, 64 * 2048):
        lay = L.repack_cuda(make_qw(n, 64, 64, True, False), torch.float16)
        assert lay["locks"].dtype == torch.int32 and lay["locks"].shape == (max(n // 64, 1024),)
        assert not lay["locks"].any()


def test_triton_word_order():
    qw = make_qw(64, 128, 32, True, False)
    q = L.repack_triton(qw, torch.float16)["qweight"]             # [K/8, N]
    codes = qw.codes()
    for k8, n in ((0, 0), (3, 17), (15, 63)):
        word = int(q[k8, n]) & 0xFFFFFFFF
        assert [(word >> (4 * j)) & 0xF for j in range(8)] == codes[n, 8 * k8: 8 * k8 + 8].tolist()


def test_rejects_bad_shapes():
    with pytest.raises(ShapeError, match="multiple of 64"):
        L.repack_cuda(make_qw(96, 128, 32, True, False), torch.float16)
    with pytest.raises(ShapeError, match="multiple of 32"):
        L.repack_triton(make_qw(80, 128, 16, True, False), torch.float16)
    with pytest.raises(ShapeError, match="group_size 16"):
        L.repack_triton(make_qw(64, 128, 16, True, False), torch.float16)
    w8 = QuantizedWeight.from_codes(torch.randint(0, 255, (64, 64), dtype=torch.uint8), torch.ones(64, 1), None, 8, -1)
    with pytest.raises(ShapeError, match="bits=8"):
        L.repack_triton(w8, torch.float16)
    with pytest.raises(ShapeError, match="dtype"):
        L.repack_cuda(make_qw(64, 128, 32, True, False), torch.float32)


def test_act_order_groups_must_be_equal():
    qw = make_qw(64, 128, 32, True, True)
    g_idx = qw.g_idx.clone()
    g_idx[g_idx == 1] = 0                                      # group 0 now holds 64 channels, group 1 none
    bad = QuantizedWeight(qw.qweight, qw.scales, qw.zeros, 4, 32, 128, g_idx)
    with pytest.raises(ShapeError, match="g_idx"):
        L.repack_triton(bad, torch.float16)


def test_plain_g_idx_needs_no_permutation():
    qw = make_qw(64, 128, 32, True, False)
    plain = QuantizedWeight(qw.qweight, qw.scales, None, 4, 32, 128, (torch.arange(128) // 32).to(torch.int32))
    assert L.repack_triton(plain, torch.float16)["perm"] is None
