"""A prototype (not shipped): Triton W4A16 swap-AB GEMM over a "fragment" layout whose words unpack straight into
the wgmma A operand (registers), timed beside the shipped Triton op, the sdquant CUDA op and cuBLAS bf16 at M = 1-64
(H200, one device call). docs/benchmarks/pending.md, pending 12.

    SDQUANT_COMMIT=<hash> python bench/triton_frag.py --out $OUT
    python bench/triton_frag.py --dry          # CPU: Triton's interpreter, tiny shapes, checks only

Why. The shipped swap-AB kernel (``int4_triton_midm``) converts its dequantized bf16 tile to the wgmma A-operand
layout through shared memory (ncu: L1/shared pipe 77.5% busy at M = 4 on 8192x28672). The byte-layout prototype
(``bench/triton_bytes.py``) kept the A operand in registers but read one byte per ``LDS.U8`` and was 3-16% slower
(bench/results/triton_bytes_h200.json). Here each thread's 16-byte load holds exactly the codes of its fragment.

Layout ("frag"): int32 [N, K/8]; K in blocks of 128; inside a block, with k' = jhi*32 + i1*16 + i0*8 + jlo*2 + h
(jhi, jlo in 0..3; i1, i0, h in 0..1), the code of (n, k') is nibble p = (i0 + 2 i1) + 4 h of word
(n, block, jlo, jhi) at n*K/8 + block*16 + jlo*4 + jhi. In Triton the 4x4 words of a row-block are loaded as
[BN, 4 (jlo), 4 (jhi)] (16 contiguous bytes a thread), unpacked by inline PTX into 8 bf16 tensors (nibbles (j, j+4)
of a word by one ``lop3`` with the magic 0x4300 = 128, minus (128 + zero) by one ``sub.bf16x2``: exact code - zero),
joined to [BN, jlo, jhi, h, i0, i1], permuted to [BN, jhi, i1, i0, jlo, h] and reshaped to [BN, 128]. Offline
(Triton 3.9, sm_90) that chain lowers to the ``dot_op`` (kWidth 2) layout with no layout conversion: per thread and
128-K tile, two ``LDS.128`` of words, 24 SHF + 32 LOP3 + 32 HADD2 (64 weights), 8 HGMMA (BM 16), no STS, no PRMT.
The per-group scale multiplies the fp32 product of each 128-K tile (so groups of 128 and multiples, and per-channel;
smaller groups are rejected). Scale (fp16) and zero (128 + z in the activation dtype) share one int32 per [K/128, N]:
4 bytes a row and tile, as in the shipped layouts. Split-K over all SMs with ``int4_triton_gemv``'s fixed-order
reduction.

Timing: bench/gemm.py's method (weight copies rotating past 3x L2, CUDA graph, median of 5 replays), bf16, random
symmetric g128 codes. Every timed config is checked first against x @ W.T in float32 (relative error <= 1e-2; 2e-3
for fp16 in --dry). Writes $OUT/triton_frag.json.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CONFIGS = {  # runs 1-3 (bench/results/triton_frag_h200_run{1,2,3}.json): n128w4s3x4 fastest at most M <= 16 points;
    # PAIR slower everywhere (run 3). r128: ptxas capped at 128 registers (167 without: 3 CTAs an SM; 127 and no
    # spills with the cap: 4)
    "n128w4s3x4": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "waves": 4.0},
    "n64w4s4x2": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4, "waves": 2.0},
    "p_n128w4s3x4": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "waves": 4.0, "PAIR": True},
    "r128_n128w4s3x4": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "waves": 4.0, "maxnreg": 128},
    "r128_n128w4s4x4": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0, "maxnreg": 128},
    "r128_n128w4s3x6": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "waves": 6.0, "maxnreg": 128},
    "r128_n128w4s4x8": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "waves": 8.0, "maxnreg": 128},
    # (a GEMV with N-major tiles over this layout, gv*, ran in runs 4-5 and was removed after them: 8-25% slower
    # than the shipped GEMV at M = 1, spilling at M = 2; code at commit 41d75f7)
    # the K-major GEMV (lanes along K, [BN, R] accumulators): not measured yet (pending 14)
    "gk64k128x4": {"kernel": "gemvk", "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "waves": 4.0},
    "gk32k128x8": {"kernel": "gemvk", "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "waves": 8.0},
    "gk128k64x4": {"kernel": "gemvk", "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2, "waves": 4.0},
}
MS = [1, 2, 4, 8, 16, 32, 64]
DRY_SHAPES = [(256, 128, 128, True), (512, 128, 256, False), (384, 256, -1, False), (256, 512, 128, False)]
DRY_MS = (1, 2, 3, 17)


def dry_applies(cfg: dict, k: int, n: int, m: int = 1) -> bool:
    """Whether --dry runs cfg on an M x K x N problem (BLOCK_N divides N; PAIR needs K in 256s; the GEMV M <= 2)."""
    return n % cfg["BLOCK_N"] == 0 and not (cfg.get("PAIR") and k % 256) and not (
        cfg.get("kernel") == "gemvk" and m > 2)


def repack_frag(qw, dtype):
    """The prototype's layout from a QuantizedWeight (no act-order; groups of 128 or a multiple, or per-channel)."""
    import torch

    from sdquant.kernels import int4_layout
    if qw.g_idx is not None:
        raise ValueError("triton_frag prototype: act-order weights are not supported")
    codes, s, _zs, _ = int4_layout._prepared(qw, dtype)                     # codes [N, K] uint8, s [N, G]
    n, k = codes.shape
    gs = k // s.shape[1]
    if k % 128 or gs % 128:
        raise ValueError(f"triton_frag prototype: K={k} and the group size {gs} must be multiples of 128")
    z = torch.full_like(s, 8.0) if qw.zeros is None else qw.zeros.float()
    c = codes.view(n, k // 128, 4, 2, 2, 4, 2)                                # [n, b, jhi, i1, i0, jlo, h]
    c = c.permute(0, 1, 5, 2, 6, 3, 4).reshape(n, k // 128, 4, 4, 8)          # [n, b, jlo, jhi, p = 4h + 2i1 + i0]
    words = int4_layout._nibbles_to_words(c).reshape(n, k // 8).contiguous()
    rep = gs // 128
    s_t = s.repeat_interleave(rep, 1).t().contiguous().to(torch.float16).view(torch.int16)   # [K/128, N]
    bias = 1024.0 if dtype == torch.float16 else 128.0
    zb = (z + bias).repeat_interleave(rep, 1).t().contiguous().to(dtype).view(torch.int16)
    sz = (s_t.to(torch.int32) & 0xFFFF) | (zb.to(torch.int32) << 16)       # fp16 scale bits | (B + z) bits << 16
    return {"qweight": words, "sz": sz.contiguous()}


def sub_asm(fp16: bool) -> str:
    """The inline PTX of ``_unpack_sub`` for fp16 or bf16: word $8 (nibble p at bits 4p) and the pair
    $9 = (B + z, B + z) -> 8 halves (code_p - z) in the order (p0, p4, p1, p5, p2, p6, p3, p7): one lop3 per pair
    (p, p + 4) with the magic number (fp16 0x6400 = 1024, bf16 0x4300 = 128) and one packed subtraction."""
    magic, sub = ("0x64006400", "sub.rn.f16x2") if fp16 else ("0x43004300", "sub.rn.bf16x2")
    lines = ["shr.b32 s1, $8, 4;", "shr.b32 s2, $8, 8;", "shr.b32 s3, $8, 12;"]
    lines += [f"lop3.b32 t{i}, {'$8' if i == 0 else f's{i}'}, 0x000F000F, {magic}, 0xEA;" for i in range(4)]
    lines += [f"{sub} t{i}, t{i}, $9;" for i in range(4)]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, t{i};" for i in range(4)]
    return "{\n.reg .b32 t0, t1, t2, t3, s1, s2, s3;\n" + "\n".join(lines) + "\n}"


def _unpack_sub(w, zp, CDT, SUB_ASM):
    """``sub_asm``'s 8 results (code_p - z) in CDT for words w and zero pairs zp."""
    # (a tuple of the constexpr CDT does not lower: the type is named, in one static branch each)
    if CDT == tl.float16:
        out = tl.inline_asm_elementwise(asm=SUB_ASM, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[w, zp],
                                        dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(asm=SUB_ASM, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[w, zp],
                                        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return out


def _frag_tile(w, sz, BLOCK_N, CDT, ASM, BIAS, SUB_ASM):
    """One 128-K tile: words [BN, 4, 4] and the packed scale / zero [BN] -> (code - z) [BN, 128] in CDT (the wgmma A
    operand's register layout) and the fp32 scale [BN]."""
    s = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if ASM:
        zp = (sz & -65536) | ((sz >> 16) & 0xFFFF)                                 # the pair (B + z, B + z)
        l0, h0, l1, h1, l2, h2, l3, h3 = _unpack_sub(w, zp[:, None, None], CDT, SUB_ASM)
    else:   # the interpreter: no inline PTX
        zb = ((sz >> 16) & 0xFFFF).to(tl.int16)
        zf = (zb.to(CDT, bitcast=True).to(tl.float32) - BIAS).to(CDT)[:, None, None]
        o0, o1, o2, o3, o4, o5, o6, o7 = _codes8(w, CDT, 0)                          # nibble p at bits 4p, plain
        l0, l1, l2, l3 = o0 - zf, o1 - zf, o2 - zf, o3 - zf
        h0, h1, h2, h3 = o4 - zf, o5 - zf, o6 - zf, o7 - zf
    t = tl.join(tl.join(tl.join(l0, h0), tl.join(l1, h1)), tl.join(tl.join(l2, h2), tl.join(l3, h3)))
    t = tl.permute(t, (0, 2, 5, 4, 1, 3))                                          # [BN, jhi, i1, i0, jlo, h]
    return tl.reshape(t, (BLOCK_N, 128)), s


def _frag_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, K_SPLIT,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PARTIAL: tl.constexpr, CDT: tl.constexpr,
                 ASM: tl.constexpr, BIAS: tl.constexpr, PAIR: tl.constexpr, SUB_ASM: tl.constexpr):
    """out^T [BN, BM] per program over its K slice; PAIR: two 128-K tiles an iteration, both products issued
    before either is scaled (the second tile's unpacking can overlap the first tile's wgmma)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    jl = tl.arange(0, 4)
    jh = tl.arange(0, 4)
    wp = w_ptr + offs_n[:, None, None] * stride_wn + jl[None, :, None] * 4 + jh[None, None, :]
    offs_k = tl.arange(0, 128)
    xp = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    t_begin = pid_k * (K_SPLIT // 128)
    if PAIR:
        for tt in range(0, K_SPLIT // 256):
            g = t_begin + 2 * tt                              # tiles g, g + 1 (their scale rows); 16 words a row
            wa, sa = _frag_tile(tl.load(wp + g * 16), tl.load(sz_ptr + g * N + offs_n), BLOCK_N, CDT, ASM, BIAS,
                                SUB_ASM)
            xa = tl.trans(tl.load(xp + g * 128, mask=m_mask[:, None], other=0.0))
            pa = tl.dot(wa, xa.to(CDT))
            wb, sb = _frag_tile(tl.load(wp + (g + 1) * 16), tl.load(sz_ptr + (g + 1) * N + offs_n), BLOCK_N, CDT,
                                ASM, BIAS, SUB_ASM)
            xb = tl.trans(tl.load(xp + (g + 1) * 128, mask=m_mask[:, None], other=0.0))
            pb = tl.dot(wb, xb.to(CDT))
            acc += sa[:, None] * pa + sb[:, None] * pb
    else:
        for tt in range(0, K_SPLIT // 128):
            g = t_begin + tt                                  # the 128-K tile (its scale row); 16 words a row
            wt, s = _frag_tile(tl.load(wp + g * 16), tl.load(sz_ptr + g * N + offs_n), BLOCK_N, CDT, ASM, BIAS,
                               SUB_ASM)
            xt = tl.trans(tl.load(xp + g * 128, mask=m_mask[:, None], other=0.0))      # [128, BM]
            acc += s[:, None] * tl.dot(wt, xt.to(CDT))
    _store_out_t(out_ptr, part_ptr, acc, offs_m, offs_n, m_mask, pid_k, M, N, PARTIAL)


def _fadd(a, b):
    return a + b


def _kx_row(x_ptr, stride_xm, ROW, M, kr, P: tl.constexpr):
    """x[ROW, k] for nibble P of each word: kr [R] = the words' jhi * 32 + jlo * 2 (+ block), P = j + 4h."""
    j: tl.constexpr = P % 4
    koff: tl.constexpr = (j % 2) * 8 + (j // 2) * 16 + P // 4
    return tl.load(x_ptr + ROW * stride_xm + kr + koff, mask=(kr * 0 + ROW) < M, other=0.0).to(tl.float32)


def _kmajor_row(x_ptr, stride_xm, ROW, M, kr, d0, d1, d2, d3, d4, d5, d6, d7):
    """(sum over each word's 8 nibbles of code * x as fp32 [BN, R], the words' x sums [R]) for one row of x."""
    x0 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 0)
    x1 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 1)
    x2 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 2)
    x3 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 3)
    x4 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 4)
    x5 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 5)
    x6 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 6)
    x7 = _kx_row(x_ptr, stride_xm, ROW, M, kr, 7)
    p = (d0 * x0[None, :] + d1 * x1[None, :] + d2 * x2[None, :] + d3 * x3[None, :]
         + d4 * x4[None, :] + d5 * x5[None, :] + d6 * x6[None, :] + d7 * x7[None, :])
    return p, x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7


def _frag_gemvk_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, part_ptr, M, N, stride_xm, stride_wn, K_SPLIT, MAGIC,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                       CDT: tl.constexpr, BIAS: tl.constexpr):
    """A K-major GEMV (M <= 2) over the fragment layout: [BN, R] word tiles with K along the lanes (a warp reads
    contiguous K of a few rows, as row-major GEMV kernels do), each word's 8 products and the group's scale and zero
    applied in registers ([BN, R] accumulators), one cross-lane sum per row at the end."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    R: tl.constexpr = BLOCK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    mg = MAGIC.to(tl.uint32)
    acc0 = tl.zeros((BLOCK_N, R), tl.float32)
    acc1 = tl.zeros((BLOCK_N, R), tl.float32)
    t_begin = pid_k * (K_SPLIT // BLOCK_K)
    for tt in range(0, K_SPLIT // BLOCK_K):
        wr = (t_begin + tt) * R                                            # the tile's first word along K
        wq = tl.load(w_ptr + offs_n[:, None] * stride_wn + (wr + offs_r)[None, :]).to(tl.uint32, bitcast=True)
        wh = wq >> 12
        wi = (wr + offs_r) % 16                                            # word within its 128-block: jlo * 4 + jhi
        kr = (wr // 16) * 128 + (wi % 4) * 32 + (wi // 4) * 2              # block + jhi * 32 + jlo * 2
        sz = tl.load(sz_ptr + (wr // 16) * N + offs_n)
        s = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        z = ((sz >> 16) & 0xFFFF).to(tl.int16).to(CDT, bitcast=True).to(tl.float32) - BIAS
        zs = (-z[:, None]) * s
        d0 = _gemv_code(wq, wh, 0, mg)
        d1 = _gemv_code(wq, wh, 1, mg)
        d2 = _gemv_code(wq, wh, 2, mg)
        d3 = _gemv_code(wq, wh, 3, mg)
        d4 = _gemv_code(wq, wh, 4, mg)
        d5 = _gemv_code(wq, wh, 5, mg)
        d6 = _gemv_code(wq, wh, 6, mg)
        d7 = _gemv_code(wq, wh, 7, mg)
        p0, xs0 = _kmajor_row(x_ptr, stride_xm, 0, M, kr, d0, d1, d2, d3, d4, d5, d6, d7)
        acc0 += p0 * s + zs * xs0[None, :]
        if ROWS > 1:
            p1, xs1 = _kmajor_row(x_ptr, stride_xm, 1, M, kr, d0, d1, d2, d3, d4, d5, d6, d7)
            acc1 += p1 * s + zs * xs1[None, :]
    y0 = tl.reduce(acc0, 1, _fadd)
    if not PARTIAL:
        dst = out_ptr + offs_n
        tl.store(dst, y0.to(out_ptr.dtype.element_ty))
        if ROWS > 1:
            tl.store(dst + N, tl.reduce(acc1, 1, _fadd).to(out_ptr.dtype.element_ty), mask=(offs_n * 0 + 1) < M)
    else:
        dst = part_ptr + pid_k * M * N + offs_n
        tl.store(dst, y0)
        if ROWS > 1:
            tl.store(dst + N, tl.reduce(acc1, 1, _fadd), mask=(offs_n * 0 + 1) < M)


def _kernels():
    import triton.language as tl

    from sdquant.kernels import int4_triton_midm as MM
    from sdquant.kernels.triton_jit import jit_in_namespace
    from sdquant.kernels import int4_triton_gemv as G
    ns = {**globals(), "tl": tl}
    return dict(zip(("tc", "gemvk"), jit_in_namespace(
        ns, (_frag_kernel, _frag_gemvk_kernel),
        (_unpack_sub, _frag_tile, MM._store_out_t, _fadd, _kx_row, _kmajor_row, G._nib32, G._nib16, G._codes8,
         G._asm_unpack8, G._gemv_code))))


_KERN: dict = {}


def resolve(cfg: dict, m: int, n: int, k: int, sms: int) -> dict:
    from sdquant.kernels import int4_triton_gemv as G
    bn = cfg["BLOCK_N"]
    if cfg.get("kernel") == "gemvk":
        bk = cfg["BLOCK_K"]
        if m > 2 or n % bn or k % 128 or 128 % bk:
            raise ValueError(f"triton_frag gemv: M={m} > 2, or N={n} / K={k} do not divide into {bn} x {bk} tiles")
        c = dict(cfg)
        c["SPLIT_K"] = G.auto_split(k, bk, n // bn, cfg["waves"] * sms)
        return c
    if n % bn or k % 128:
        raise ValueError(f"triton_frag: N={n} / K={k} do not divide into {bn} x 128 tiles")
    bm = 16
    while bm < m and bm < 64:
        bm *= 2
    tiles = (n // bn) * ((m + bm - 1) // bm)
    unit = 256 if cfg.get("PAIR") else 128                  # PAIR: an even number of 128-K tiles per split
    if k % unit:
        raise ValueError(f"triton_frag: K={k} is not a multiple of {unit} (PAIR)")
    split = G.auto_split(k, unit, tiles, cfg["waves"] * sms)
    return {**cfg, "BLOCK_M": bm, "SPLIT_K": split}


def run(x, lay, gs: int, cfg: dict, sms: int):
    """y [M, N] = x [M, K] @ W.T through the prototype kernel (``gs`` is in the layout: unused)."""
    import torch
    import triton
    import triton.language as tl

    from sdquant.kernels import int4_triton_gemv as G
    mode = os.environ.get("TRITON_INTERPRET", "0")
    if mode not in _KERN:
        _KERN[mode] = _kernels()
    m, k = x.shape
    n = lay["qweight"].shape[0]
    c = resolve(cfg, m, n, k, sms)
    split = c["SPLIT_K"]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    interp = mode == "1"
    if interp and x.dtype == torch.bfloat16:
        raise ValueError("triton_frag --dry runs fp16 only (the interpreter's bf16 arithmetic is wrong)")
    cdt, bias = (tl.float16, 1024.0) if x.dtype == torch.float16 else (tl.bfloat16, 128.0)
    if c.get("kernel") == "gemvk":
        _KERN[mode]["gemvk"][(n // c["BLOCK_N"], split)](
            x, lay["qweight"], lay["sz"], out, part, m, n, x.stride(0), k // 8, k // split, G.MAGIC_F32, ROWS=m,
            BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PARTIAL=split > 1, CDT=cdt, BIAS=bias,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
    else:
        _launch_tc(x, lay, out, part, m, n, k, split, c, cdt, bias, interp)
    if split > 1:
        import w4a16_proto
        w4a16_proto.reduce_splits(part, out, m, n, split)
    return out


def _launch_tc(x, lay, out, part, m, n, k, split, c, cdt, bias, interp):
    import triton
    import triton.language as tl
    mode = os.environ.get("TRITON_INTERPRET", "0")
    _KERN[mode]["tc"][(triton.cdiv(m, c["BLOCK_M"]), n // c["BLOCK_N"], split)](
        x, lay["qweight"], lay["sz"], out, part, m, n, k, x.stride(0), k // 8, k // split,
        BLOCK_N=c["BLOCK_N"], BLOCK_M=c["BLOCK_M"], PARTIAL=split > 1, CDT=cdt, ASM=not interp, BIAS=bias,
        PAIR=bool(c.get("PAIR")), SUB_ASM=sub_asm(cdt == tl.float16),
        num_warps=c["num_warps"], num_stages=c["num_stages"], **({"maxnreg": c["maxnreg"]} if "maxnreg" in c else {}))


def main(argv=None):
    import w4a16_proto
    return w4a16_proto.main(argv, __doc__, "triton_frag", CONFIGS, repack_frag, run, MS, DRY_SHAPES, DRY_MS,
                            dry_applies)


if __name__ == "__main__":
    main()
