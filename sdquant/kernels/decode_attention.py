"""Length-aware decode attention over the runtime's static KV cache, as the op ``sdquant::decode_attention``.

    y = torch.ops.sdquant.decode_attention(q, k_cache, v_cache, input_pos, window, scale, cos, sin)
        q          [B, nkv, rep, hd]   one query token per sequence: the rep query heads of each KV head
                                       (any strides with a unit last one: a view into the qkv output works)
        k/v_cache  [B, nkv, T, hd]     the static cache (already holding this step's key and value)
        input_pos  int [1]             the slot this step wrote; slot t is attended when
                                       pos − window < t ≤ pos (window 0: no sliding window)
        scale      float               softmax scale (head_dim ** −0.5)
        cos, sin   [hd] or None        RoPE rows of this position (HF layout, halves duplicated): when given,
                                       q is rotated as it is loaded (fp32), q·cos + rotate_half(q)·sin, so the
                                       runtime launches no separate kernel for the query's RoPE
        y          [B, nkv, rep, hd]   q.dtype; softmax in fp32

Why: a static cache of T slots attended "in full with a mask" (gpt-fast's way, the runtime's ``matmul``
implementation) reads all T slots at every step, however few are live. This op reads only the live slots, so
a step costs what the sequence length costs, not what ``max_seq`` costs. The position is read on the device,
so one captured CUDA graph replays correctly at every position.

Kernels (flash-decoding): ``_partial_kernel`` runs a grid (B·nkv, SPLITS); program (bh, s) owns slots
[s·C, (s+1)·C), C = ``chunk_for(B·nkv, T, SMs)`` (64 slots while the grid stays within 8 programs a SM, up to 1024
at large batch), and walks the live ones in BLOCK_T tiles: scores = q·kᵀ on the tensor cores (the rep
query rows padded to 16), an online softmax in fp32, acc += p·v; it writes its partial (acc, running max,
running sum), or an empty partial when its range holds no live slot. ``_merge_kernel`` combines the SPLITS
partials of each (bh, query row) in one load and a fixed order (deterministic, no atomics). With ``preload`` (one-tile
programs after the runtime's qkv epilogue) a program loads its older slots before its PDL wait, and a program
without live slots returns at once and writes nothing: the merge then reads only the live splits (LIVE). CPU tensors
run a PyTorch reference of the same maths (or the kernels under ``TRITON_INTERPRET=1``, which is how CI tests them).
``set_pdl`` launches both with programmatic dependent launch (``Transformer.compile_decode`` does on Hopper).

Measurement switches (read at launch time; docs/benchmarks/decode.md): SDQUANT_ATTN_CHUNK / _BT / _WARPS / _STAGES (tiles),
SDQUANT_ATTN_TRIGGER (where the early PDL trigger goes), SDQUANT_ATTN_LIVE=0 (dead programs wait and write empty
partials), SDQUANT_ATTN_NEWROW=tile (with the preload, slot pos scored as part of the tile, not as one row beside it).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from sdquant.errors import ShapeError
from sdquant.kernels.triton_jit import jit_in_namespace

try:  # Triton is optional (CPU-only installs): the op then runs the PyTorch reference on CPU only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

CHUNK = 64           # slots per program at batch 1 (at T = 2176: 34 programs per KV head); see chunk_for
BLOCK_T = 64         # slots per inner tile (a program walks chunk / BLOCK_T of them; one at batch 1)


# Slots per program by load: the smallest of CHUNKS whose grid holds at most PROGRAMS_PER_SM programs a SM. At batch 1
# the 64-slot tiles spread one sequence over the SMs; at batch 8-32 a grid of thousands of one-tile programs spends its
# time in prologues and in the merge. bench/e2e.py runs 35-36 (H200, Llama-3-8B heads, decode at position 1088 of
# 2176 slots), INT4 / bf16 tok/s from 64-slot programs to this rule: batch 32 (1024 slots) 5798 -> 7054 / 4428 -> 5155,
# batch 8 (256) 2662 -> 2852 / 1530 -> 1575; batch 1 keeps 64 (256 slots there: 434 -> 426).
CHUNKS = (CHUNK, 128, 256, 512, 1024)
PROGRAMS_PER_SM = 8
_SMS: dict = {}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter (CPU tests): as on the H200
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def chunk_for(rows: int, T: int, sms: int) -> int:
    """Slots per program for rows = batch x KV heads over a cache of T slots (SDQUANT_ATTN_CHUNK, a multiple of
    BLOCK_T, overrides it for measurements)."""
    v = os.environ.get("SDQUANT_ATTN_CHUNK")
    if v:
        c = int(v)
        if c < BLOCK_T or c % BLOCK_T:
            raise ValueError(f"SDQUANT_ATTN_CHUNK={v}: must be a positive multiple of {BLOCK_T}")
        return c
    for c in CHUNKS:
        if rows * -(-T // c) <= PROGRAMS_PER_SM * sms:
            return c
    return CHUNKS[-1]


def tile_config(chunk: int) -> dict:
    """The partial kernel's inner tile and launch shape for programs of ``chunk`` slots: BLOCK_T slots a tile, 4 warps,
    Triton's default pipelining. SDQUANT_ATTN_BT / _WARPS / _STAGES override them for measurements (the tile is capped
    at the chunk and must divide it)."""
    bt = int(os.environ.get("SDQUANT_ATTN_BT") or BLOCK_T)
    bt = min(bt, chunk)
    if bt < 16 or bt & (bt - 1) or chunk % bt:
        raise ValueError(f"SDQUANT_ATTN_BT={bt}: must be a power of two >= 16 dividing the {chunk}-slot chunk")
    cfg = {"BT": bt, "num_warps": int(os.environ.get("SDQUANT_ATTN_WARPS") or 4)}
    if os.environ.get("SDQUANT_ATTN_STAGES"):
        cfg["num_stages"] = int(os.environ["SDQUANT_ATTN_STAGES"])
    return cfg


def available() -> bool:
    return triton is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------- kernels
# Only Triton builtins and the @jit helpers below (combine functions, _live_range): see sdquant.kernels.triton_jit.
def _add(a, b):
    return a + b


def _max(a, b):
    return tl.maximum(a, b)


def _live_range(pos_ptr, sp, CHUNK_T: tl.constexpr, WINDOW):
    """(pos, start, end): the position and program sp's live slots [start, end) (WINDOW > T: no window)."""
    pos = tl.load(pos_ptr).to(tl.int32)
    start = tl.maximum(sp * CHUNK_T, tl.maximum(pos - WINDOW + 1, 0))
    end = tl.minimum(sp * CHUNK_T + CHUNK_T, pos + 1)
    return pos, start, end


def _partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, acc_ptr, ml_ptr, scale, T, REP, WINDOW, SPLITS,
                    NKV, sq_b, sq_h, sq_r, sk_bh, sk_t, sv_bh, sv_t,
                    HD: tl.constexpr, REP_P: tl.constexpr, CHUNK_T: tl.constexpr, BT: tl.constexpr,
                    CDT: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr,
                    LIVE: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    offs_d = tl.arange(0, HD)
    if PRELOAD:  # one tile a program (CHUNK_T == BT): its keys and values of the slots before pos, which no kernel of
        # this step writes, are loaded ahead of the wait, so under PDL they stream while the previous kernel finishes;
        # the position too (an input of the step), so that after the wait slot pos's load needs no round trip first
        pos, start, end = _live_range(pos_ptr, sp, CHUNK_T, WINDOW)
        if LIVE:  # a program without live slots leaves at once, before the wait, and writes nothing: the merge
            if start >= end:  # reads only the live splits, and the SMs are free for the kernels launched next
                return
        offs_t = start + tl.arange(0, BT)
        old = (offs_t < end) & (offs_t < pos)
        k_pre = tl.load(k_ptr + bh * sk_bh + offs_t[:, None] * sk_t + offs_d[None, :], mask=old[:, None], other=0.0)
        v_pre = tl.load(v_ptr + bh * sv_bh + offs_t[:, None] * sv_t + offs_d[None, :], mask=old[:, None], other=0.0)
        if PRELOAD == 2:  # the tiles in the products' operand layouts before the wait: a product with zeros here
            # makes the layout conversions (through shared memory) happen now, not after the wait beside the real ones
            k_t = tl.trans(k_pre.to(CDT))
            v_c = v_pre.to(CDT)
            s0 = tl.dot(tl.full((REP_P, HD), 0.0, CDT), k_t)                    # zeros [REP_P, BT]
            a0 = tl.dot(tl.full((REP_P, BT), 0.0, CDT), v_c)                    # zeros [REP_P, HD]
    if PDL:  # launched early (programmatic dependent launch): wait for the kernels that wrote q and the cache
        if PDL == 3:  # trigger first: the merge may launch even before this wait (it waits for this grid)
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if PDL == 2:  # early trigger: the merge may launch now (it waits for this grid on the device)
            tl.extra.cuda.gdc_launch_dependents()
    q_base = q_ptr + (bh // NKV) * sq_b + (bh % NKV) * sq_h
    if not PRELOAD:
        pos, start, end = _live_range(pos_ptr, sp, CHUNK_T, WINDOW)
    offs_r = tl.arange(0, REP_P)
    r_mask = offs_r < REP
    q = tl.load(q_base + offs_r[:, None] * sq_r + offs_d[None, :], mask=r_mask[:, None], other=0.0).to(tl.float32)
    if ROPE:  # q * cos + rotate_half(q) * sin, rotate_half(q) = [-q[hd/2:], q[:hd/2]]
        offs_h = (offs_d + HD // 2) % HD
        q_h = tl.load(q_base + offs_r[:, None] * sq_r + offs_h[None, :], mask=r_mask[:, None], other=0.0)
        sign = tl.where(offs_d < HD // 2, -1.0, 1.0)
        c = tl.load(cos_ptr + offs_d).to(tl.float32)
        sn = tl.load(sin_ptr + offs_d).to(tl.float32)
        q = q * c[None, :] + q_h.to(tl.float32) * (sign * sn)[None, :]
    q = (q * scale).to(CDT)
    m_i = tl.full((REP_P,), float("-inf"), tl.float32)
    l_i = tl.full((REP_P,), 0.0, tl.float32)
    acc = tl.full((REP_P, HD), 0.0, tl.float32)
    # an empty range (start >= end) runs no tile and leaves the empty partial (m = -inf, l = 0, acc = 0)
    for t0 in range(start, end, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_mask = offs_t < end
        if PRELOAD == 2:  # the preloaded tile with slot pos masked out of it, and slot pos (this step's key and value,
            # loaded after the wait by the program that holds it) as one row scored on its own: no second full-tile
            # load and select (PRELOAD 1), so the tile's registers are not held twice (167 registers, no spill)
            own = end > pos
            n_mask = offs_d < HD * own.to(tl.int32)                              # all or nothing
            kn = tl.load(k_ptr + bh * sk_bh + pos * sk_t + offs_d, mask=n_mask, other=0.0)
            vn = tl.load(v_ptr + bh * sv_bh + pos * sv_t + offs_d, mask=n_mask, other=0.0)
            s = tl.dot(q, k_t, s0)                                               # [REP_P, BT] fp32
            s = tl.where((t_mask & (offs_t < pos))[None, :], s, float("-inf"))
            sn = tl.where(own, tl.reduce(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1, _add), float("-inf"))
            m_new = tl.maximum(tl.maximum(m_i, tl.reduce(s, 1, _max)), sn)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            pn = tl.exp(sn - m_new)                                              # [REP_P]; 0 where not own
            l_i = l_i * alpha + tl.reduce(p, 1, _add) + pn
            acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v_c, a0) + \
                pn.to(CDT).to(tl.float32)[:, None] * vn.to(tl.float32)[None, :]
            m_i = m_new
        else:
            k_at = k_ptr + bh * sk_bh + offs_t[:, None] * sk_t + offs_d[None, :]
            v_at = v_ptr + bh * sv_bh + offs_t[:, None] * sv_t + offs_d[None, :]
            if PRELOAD:  # slot pos (this step's key and value) after the wait
                new = (t_mask & (offs_t == pos))[:, None]
                k = tl.where(new, tl.load(k_at, mask=new, other=0.0), k_pre)
                v = tl.where(new, tl.load(v_at, mask=new, other=0.0), v_pre)
            else:
                k = tl.load(k_at, mask=t_mask[:, None], other=0.0)
                v = tl.load(v_at, mask=t_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(CDT)))                                   # [REP_P, BT] fp32
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _add)
            acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v.to(CDT))
            m_i = m_new
    if PDL:  # the merge may launch now; it waits for this grid before it reads the partials (no-op if done)
        tl.extra.cuda.gdc_launch_dependents()
    part = bh * SPLITS + sp
    # only the REP real query rows (the merge never reads the padding rows of REP_P)
    tl.store(acc_ptr + (part * REP_P + offs_r[:, None]) * HD + offs_d[None, :], acc, mask=r_mask[:, None])
    tl.store(ml_ptr + (part * 2) * REP_P + offs_r, m_i)
    tl.store(ml_ptr + (part * 2 + 1) * REP_P + offs_r, l_i)


def _merge_at(acc_ptr, ml_ptr, part, r, offs_d, HD: tl.constexpr, REP_P: tl.constexpr):
    """The merge's addresses of query row r in partials ``part``: (running maxima; the sums are REP_P further on, the
    accumulators' columns offs_d)."""
    return ml_ptr + (part * 2) * REP_P + r, acc_ptr + (part[:, None] * REP_P + r) * HD + offs_d[None, :]


def _merge_kernel(acc_ptr, ml_ptr, out_ptr, pos_ptr, REP, SPLITS, so_bh, so_r, WINDOW,
                  HD: tl.constexpr, REP_P: tl.constexpr, SPLITS_P: tl.constexpr, BD: tl.constexpr,
                  PDL: tl.constexpr, LIVE: tl.constexpr, CHUNK_T: tl.constexpr, EARLY: tl.constexpr):
    # one program per (bh, query row, BD columns): every split's partial is loaded at once (one memory round
    # trip), then combined with the log-sum-exp weights in a fixed order
    pid = tl.program_id(0)
    bh = pid // REP
    r = pid % REP
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    s_mask = offs_s < SPLITS
    if LIVE:  # the partial kernel ran with PRELOAD: only the live splits wrote partials (the position is an input of
        # the step there, read before the wait as the partials did)
        pos = tl.load(pos_ptr).to(tl.int32)
        s_mask = s_mask & (offs_s >= tl.maximum(pos - WINDOW + 1, 0) // CHUNK_T) & (offs_s <= pos // CHUNK_T)
    part = bh * SPLITS + offs_s
    if EARLY:  # (with the row form, untimed) the addresses computed before the wait, where the source puts them: the
        # offline sm_90 build then runs 374 instructions after the wait instead of 492
        m_at, a_at = _merge_at(acc_ptr, ml_ptr, part, r, offs_d, HD, REP_P)
    if PDL:  # wait for the partials
        if PDL == 3:  # trigger first: the next kernel (the output projection) may launch while the partials run;
            # it still waits on the device for this grid, which finishes after the partials
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if PDL == 2:  # early trigger: the next kernel may launch now and wait for this grid on the device
            tl.extra.cuda.gdc_launch_dependents()
    if not EARLY:
        m_at, a_at = _merge_at(acc_ptr, ml_ptr, part, r, offs_d, HD, REP_P)
    m_s = tl.load(m_at, mask=s_mask, other=float("-inf"))
    l_s = tl.load(m_at + REP_P, mask=s_mask, other=0.0)
    a_s = tl.load(a_at, mask=s_mask[:, None], other=0.0)
    m = tl.reduce(m_s, 0, _max)
    w = tl.where(l_s > 0, tl.exp(m_s - m), 0.0)                                   # empty partials weigh 0
    y = tl.reduce(a_s * w[:, None], 0, _add) / tl.reduce(l_s * w, 0, _add)
    if PDL:  # the next kernel (e.g. the output projection) may launch and start on its weights (no-op if done)
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + bh * so_bh + r * so_r + offs_d, y.to(out_ptr.dtype.element_ty))


_KERNELS: dict = {}
_PDL = [0]


def set_pdl(enabled: bool, early_trigger: bool = False) -> int:
    """Launch this module's kernels (the attention's two) with programmatic dependent launch from
    now on in this process (CUDA only): each may
    start while the previous kernel of the stream finishes and waits on the device (``gdc_wait``) before it reads
    that kernel's results; each lets the next kernel launch before its own stores (``early_trigger``: before its
    wait, see ``_trigger``). Read at launch time, so set it before a CUDA graph is captured. Returns the previous
    setting (0 off, 1 on, 2 on with the early trigger)."""
    old = _PDL[0]
    _PDL[0] = (2 if early_trigger else 1) if enabled else 0
    return old


def _switch(name: str, choices: tuple) -> str:
    """A measurement switch read at launch time: the environment variable ``name``, one of ``choices`` (unset or empty:
    the first, the default); any other value is an error naming the variable."""
    v = os.environ.get(name) or choices[0]
    if v not in choices:
        raise ValueError(f"{name}={v}: must be one of {', '.join(choices)}")
    return v


_TRIGGERS = ("first", "merge-first", "wait")


def _trigger(pdl: int, preload: bool = True) -> tuple:
    """(partial, merge) PDL modes under ``set_pdl``'s setting pdl, for a call with or without ``preload``.

    With the early trigger and the preload, both kernels let their dependent launch before their own wait (mode 3).
    The o projection's GEMM is then launched while the partials run: its CTAs take the SMs as the partials leave, and
    its prologue (weights in flight, its own wait) is done when the merge finishes. e2e runs 65-66 (H200, INT4 decode):
    +1.4% at batch 1, +1.2% at batch 8; bf16 level; an L2 prefetch of its weights from the merge on top cost 0.5%
    (run 67). Each dependent still waits on the device for the whole grid before it reads.

    Only the preload's caller gets it: the runtime's fused path, whose kernel after the merge is the fused o GEMM, and
    that GEMM waits before it reads anything written in the step. An inductor kernel with PDL skips its wait when its
    predecessor did not write what it reads, assuming the kernels before that predecessor have finished. A merge that
    triggered before its own wait breaks that assumption, so every other call keeps mode 2 (at batch 32 the runtime
    takes that path; run 66 measured +0.5% there with mode 3).

    SDQUANT_ATTN_TRIGGER (measurements, read at launch time like the other SDQUANT_ATTN_* knobs): "first" (the
    default), "merge-first" (only the merge triggers before its wait: +1.0% at batch 1) or "wait" (each kernel
    triggers right after its wait, the setting before)."""
    v = _switch("SDQUANT_ATTN_TRIGGER", _TRIGGERS)
    if pdl != 2 or v == "wait" or not preload:
        return pdl, pdl
    return (3 if v == "first" else 2), 3


def _kernels():
    """(partial, merge) jitted for the current interpreter mode, on first use (importing starts no compiler)."""
    mode = _interpret()
    if mode not in _KERNELS:
        _KERNELS[mode] = jit_in_namespace(globals(), (_partial_kernel, _merge_kernel),
                                          (_add, _max, _live_range, _merge_at))
    return _KERNELS[mode]


# ---------------------------------------------------------------------------------------------- the op
def _workspace(shape, device) -> torch.Tensor:
    """The partials' fp32 scratch (uninitialized: a program writes the partial it owns before the merge reads it)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _check(q, k, v, input_pos, window, cos=None, sin=None):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ShapeError(f"decode_attention: q must be [B, nkv, rep, hd] and k/v [B, nkv, T, hd] of one shape, "
                         f"got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    b, nkv, _, hd = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, nkv, hd):
        raise ShapeError(f"decode_attention: cache {list(k.shape)} does not match q {list(q.shape)}")
    if hd & (hd - 1) or hd < 16:
        raise ShapeError(f"decode_attention: head_dim {hd} must be a power of two >= 16")
    if input_pos.numel() != 1:
        raise ShapeError(f"decode_attention: input_pos must hold one position (decode), got {input_pos.numel()}")
    if window < 0:
        raise ShapeError(f"decode_attention: window must be >= 0, got {window}")
    if (cos is None) != (sin is None) or (cos is not None and (cos.numel() != hd or sin.numel() != hd)):
        raise ShapeError(f"decode_attention: cos and sin must both be given with {hd} values (one position), "
                         f"got {None if cos is None else list(cos.shape)} and {None if sin is None else list(sin.shape)}")


def rope_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel's RoPE on load, in fp32: q·cos + rotate_half(q)·sin (HF layout), result in fp32."""
    qf = q.float()
    half = q.shape[-1] // 2
    return qf * cos.float() + torch.cat([-qf[..., half:], qf[..., :half]], dim=-1) * sin.float()


def reference(q, k, v, input_pos, window: int, scale: float, cos=None, sin=None) -> torch.Tensor:
    """The op's maths in PyTorch (fp32 softmax): what the kernels are tested against and what CPU runs."""
    if cos is not None:
        q = rope_q(q, cos, sin).to(q.dtype)
    t = torch.arange(k.shape[2], device=k.device)
    pos = input_pos.reshape(()).to(k.device)
    live = t <= pos
    if window > 0:
        live &= t > pos - window
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale                   # [B, nkv, rep, T]
    p = torch.softmax(s.masked_fill(~live, float("-inf")), dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


@torch.library.custom_op("sdquant::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor, window: int,
                     scale: float, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                     preload: bool = False) -> torch.Tensor:
    """softmax(rope(q)·kᵀ·scale over the live slots)·v; see the module docstring. preload: programs of one tile load
    their keys and values of the slots before pos ahead of their PDL wait (slot pos after it). Only for a caller whose
    previous kernel writes neither the position nor those slots: the runtime's qkv GEMM with the RoPE / cache epilogue,
    which lets the attention launch before its epilogue (e2e run 61: +1.2% at batch 1 there; behind inductor's
    cache-write kernels in the bf16 model it cost 3.9%)."""
    _check(q, k, v, input_pos, window, cos, sin)
    if triton is None or (q.device.type == "cpu" and not _interpret()):
        return reference(q, k, v, input_pos, window, scale, cos, sin)
    b, nkv, rep, hd = q.shape
    T = k.shape[2]
    q = q.contiguous() if q.stride(-1) != 1 else q
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride(0) != nkv * k.stride(1) or \
            v.stride(0) != nkv * v.stride(1):
        k, v = k.contiguous(), v.contiguous()
    rope = cos is not None
    if rope:
        cos, sin = cos.reshape(hd).contiguous(), sin.reshape(hd).contiguous()
    rep_p = max(16, triton.next_power_of_2(rep))
    chunk = chunk_for(b * nkv, T, _sms(q.device))
    splits = triton.cdiv(T, chunk)
    acc = _workspace((b * nkv, splits, rep_p, hd), q.device)
    ml = _workspace((b * nkv, splits, 2, rep_p), q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)   # contiguous, whatever q's strides
    # the interpreter computes bf16 arithmetic wrongly: evaluate it in fp32 there (CPU tests only)
    cdt = tl.float32 if (_interpret() and q.dtype == torch.bfloat16) or q.dtype == torch.float32 else (
        tl.float16 if q.dtype == torch.float16 else tl.bfloat16)
    partial, merge = _kernels()
    pdl = _PDL[0] if q.is_cuda and not _interpret() else 0
    p_pdl, m_pdl = _trigger(pdl, bool(preload))
    launch = {"launch_pdl": True} if pdl else {}
    pos = input_pos.reshape(1)
    win = int(window) if window > 0 else T + 1
    tiles = tile_config(chunk)
    pre = bool(preload) and tiles["BT"] == chunk
    if pre:  # slot pos as one row beside the preloaded tile (the default: e2e runs 71 and 73, INT4 +0.4% at batch 1)
        # or as part of the tile (the form before, kept for A/B)
        pre = 2 if _switch("SDQUANT_ATTN_NEWROW", ("row", "tile")) == "row" else 1
    live = bool(pre) and _switch("SDQUANT_ATTN_LIVE", ("1", "0")) == "1"  # 0: dead programs wait and write (A/B)
    partial[(b * nkv, splits)](q, k, v, pos, cos if rope else q, sin if rope else q, acc, ml, float(scale), T, rep,
                               win, splits, nkv, q.stride(0), q.stride(1), q.stride(2), k.stride(1), k.stride(2),
                               v.stride(1), v.stride(2),
                               HD=hd, REP_P=rep_p, CHUNK_T=chunk, CDT=cdt, ROPE=rope, PDL=p_pdl,
                               PRELOAD=pre, LIVE=live, **tiles, **launch)
    bd = min(hd, 32)
    merge[(b * nkv * rep, hd // bd)](acc, ml, out, pos, rep, splits, out.stride(1), out.stride(2), win, HD=hd,
                                     REP_P=rep_p, SPLITS_P=triton.next_power_of_2(splits), BD=bd, PDL=m_pdl, LIVE=live,
                                     CHUNK_T=chunk, EARLY=pre == 2, num_warps=4, **launch)
    return out


@decode_attention.register_fake
def _(q, k, v, input_pos, window, scale, cos=None, sin=None, preload=False):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
