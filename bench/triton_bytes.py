"""A prototype (not shipped): the Triton W4A16 swap-AB GEMM over a byte layout whose wgmma A operand stays in
registers, timed beside the shipped Triton op at M = 1-64 (H200, one device call). docs/benchmarks/pending.md, pending 12.

    SDQUANT_COMMIT=<hash> python bench/triton_bytes.py --out $OUT
    python bench/triton_bytes.py --dry          # CPU: Triton's interpreter, tiny shapes, checks only

Why. ncu put the shipped swap-AB kernel (``int4_triton_midm``) on the L1/shared-memory pipe (77.5% at M = 4 on
8192x28672): it dequantizes words [BK/8, BN] in a blocked layout and Triton converts the bf16 tile to the wgmma
A-operand layout through shared memory (16-byte STS, then LDSM). Compiled offline (Triton 3.9, sm_90), a tile of
int8 bytes, K-contiguous per feature, unpacked with ``tl.join(lo, hi).reshape(BN, BK)``, keeps the A operand in
registers (``dot_op`` kWidth 2): the packed bytes are read from shared memory straight into the fragment, one
``LDS.U8`` per code pair, and no bf16 tile is stored. Whether that is faster is what this script measures.

Layout ("bytes"): uint8 [N, K/2], byte (n, j) = code[n, 2j] | code[n, 2j + 1] << 4; scales and zs [K/gs, N] in the
activation dtype as in ``int4_layout.repack_triton`` (so ``w = code * s + zs``); no act-order (the prototype
rejects it). Kernel: out^T [BN, BM] = W [BN, BK] @ x^T [BK, BM] per program, the codes as the magic-number value
``0x4300 | c`` = 128 + c (bf16; ``0x6400 | c`` = 1024 + c for fp16), dequantized in the activation dtype
``(v - BIAS) * s + zs`` with a K tile inside one group, fp32 accumulation, split-K over all SMs with
``int4_triton_gemv``'s fixed-order reduction.

Timing: bench/gemm.py's method (weight copies rotating past 3x L2, CUDA graph, median of 5 replays), bf16, random
symmetric g128 codes; baselines in the same process: cuBLAS bf16 ``F.linear`` and the shipped Triton op
(``sdquant::w4a16_triton`` as routed by its plans). Every timed config is checked first against x @ W.T in float32
(relative error <= 1e-2; 2e-3 for fp16 in --dry). Writes $OUT/triton_bytes.json.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CONFIGS = {
    "b128m32w4x2": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0},
    "b128m32w8x4": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "waves": 4.0},
    "b64m32w4x2": {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0},
    "b64m32w4x4": {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0},
    "b128m64w4x2": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0},
}
MS = [1, 2, 4, 8, 16, 32, 64]


def repack_bytes(qw, dtype):
    """The prototype's layout from a QuantizedWeight (no act-order)."""
    import torch

    from sdquant.kernels import int4_layout
    if qw.g_idx is not None:
        raise ValueError("triton_bytes prototype: act-order weights are not supported")
    codes, s, zs, perm = int4_layout._prepared(qw, dtype)                    # codes [N, K] uint8
    b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()  # [N, K/2]
    return {"qbytes": b, "scales": s.t().contiguous().to(dtype), "zs": zs.t().contiguous().to(dtype)}


def _bytes_kernel(x_ptr, b_ptr, s_ptr, zs_ptr, out_ptr, part_ptr, M, N, K, stride_xm, K_SPLIT,
                  GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  PARTIAL: tl.constexpr, CDT: tl.constexpr, MAGIC: tl.constexpr, BIAS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    k_begin = pid_k * K_SPLIT
    for kt in range(0, K_SPLIT, BLOCK_K):
        k0 = k_begin + kt
        wb = tl.load(b_ptr + offs_n[:, None] * (K // 2) + (k0 // 2 + offs_b)[None, :])         # uint8 [BN, BK/2]
        g = k0 // GS
        s = tl.load(s_ptr + g * N + offs_n).to(CDT)[:, None]
        z = tl.load(zs_ptr + g * N + offs_n).to(CDT)[:, None]
        w16 = wb.to(tl.uint16)
        lo = ((w16 & 0xF) | MAGIC).to(CDT, bitcast=True)
        hi = ((w16 >> 4) | MAGIC).to(CDT, bitcast=True)
        lo = (lo - BIAS) * s + z
        hi = (hi - BIAS) * s + z
        w = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)                                        # k = 2j + (0 | 1)
        xt = tl.trans(tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                              mask=m_mask[:, None], other=0.0))                               # [BK, BM]
        acc = tl.dot(w, xt.to(CDT), acc)
    _store_out_t(out_ptr, part_ptr, acc, offs_m, offs_n, m_mask, pid_k, M, N, PARTIAL)


def _kernels():
    """The prototype kernel jitted for the current interpreter mode, with the shipped mid-M kernel's epilogue."""
    import triton.language as tl

    from sdquant.kernels import int4_triton_midm as MM
    from sdquant.kernels.triton_jit import jit_in_namespace
    (kern,) = jit_in_namespace({**globals(), "tl": tl}, (_bytes_kernel,), (MM._store_out_t,))
    return kern


_KERN: dict = {}


def run(x, lay, gs: int, cfg: dict, sms: int):
    """y [M, N] = x [M, K] @ W.T through the prototype kernel."""
    import torch
    import triton
    import triton.language as tl

    from sdquant.kernels import int4_triton_midm as MM
    mode = os.environ.get("TRITON_INTERPRET", "0")
    if mode not in _KERN:
        _KERN[mode] = _kernels()
    m, k = x.shape
    n = lay["qbytes"].shape[0]
    # the shipped mid-M kernel's tile fitting and split-K; a K tile here must lie inside one group
    c = MM.resolve({**cfg, "BLOCK_K": min(cfg["BLOCK_K"], gs)}, m, n, k, gs, sms)
    bn, bk, bm, split = c["BLOCK_N"], c["BLOCK_K"], c["BLOCK_M"], c["SPLIT_K"]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    interp = mode == "1"
    if x.dtype == torch.float16:
        cdt, magic, bias = tl.float16, 0x6400, 1024.0
    else:
        cdt, magic, bias = tl.bfloat16, 0x4300, 128.0
    if interp and x.dtype == torch.bfloat16:
        raise ValueError("triton_bytes --dry runs fp16 only (the interpreter's bf16 arithmetic is wrong)")
    _KERN[mode][(triton.cdiv(m, bm), n // bn, split)](
        x, lay["qbytes"], lay["scales"], lay["zs"], out, part, m, n, k, x.stride(0), k // split, GS=gs,
        BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, PARTIAL=split > 1, CDT=cdt, MAGIC=magic, BIAS=bias,
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    if split > 1:
        import w4a16_proto
        w4a16_proto.reduce_splits(part, out, m, n, split)
    return out


DRY_SHAPES = [(256, 128, 128, True), (512, 64, 64, False), (256, 128, -1, True)]


def main(argv=None):
    import w4a16_proto
    return w4a16_proto.main(argv, __doc__, "triton_bytes", CONFIGS, repack_bytes, run, MS, DRY_SHAPES, (1, 3, 17))


if __name__ == "__main__":
    main()
