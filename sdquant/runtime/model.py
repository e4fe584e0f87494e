"""A gpt-fast-style Llama-family decoder: RMSNorm, RoPE, grouped-query SDPA over a static KV cache, fused
qkv and gate/up linears (nn.Linear, QuantLinear or Fp8Linear), a bf16 lm_head. Small on purpose: every tensor
has a fixed shape during decode, so one CUDA graph replays a whole token.

    rt = Transformer.from_hf(hf_model, max_seq_len=2048, max_batch=8, device="cuda", dtype=torch.bfloat16)
    tokens = generate(rt, prompt_ids, max_new_tokens=64)                 # eager
    rt.compile_decode(mode="reduce-overhead")                            # torch.compile fullgraph + CUDA graphs
    tokens = generate(rt, prompt_ids, max_new_tokens=64)

Shapes: B batch, S new tokens, T = max_seq_len cache slots, H hidden, nh/nkv query/kv heads, hd head_dim.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sdquant.errors import ConfigError, SdquantError
from sdquant.runtime.spec import DecoderDims, DecoderSpec, decoder_spec


# ----------------------------------------------------------------------------------------- linear fusion
class ConcatLinear(nn.Module):
    """Linears sharing one input that cannot be merged into one weight (e.g. different act-order perms)."""

    def __init__(self, mods: Sequence[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(mods)

    def forward(self, x):
        return torch.cat([m(x) for m in self.parts], dim=-1)


def _same(ts) -> bool:
    if all(t is None for t in ts):
        return True
    if any(t is None for t in ts):
        return False
    return all(t.shape == ts[0].shape and torch.equal(t, ts[0]) for t in ts[1:])


def _cat_bias(mods, dtype=None):
    if all(m.bias is None for m in mods):
        return None
    parts = [m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, device=mods[0].bias.device)
             for m in mods]
    out = torch.cat([p.float() for p in parts])
    return out.to(dtype) if dtype is not None else out


def fuse_linears(mods: Sequence[nn.Module]) -> nn.Module:
    """One module computing cat([m(x) for m in mods], -1) with a single GEMM where the weights allow."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight
    if all(type(m) is nn.Linear for m in mods):
        w = torch.cat([m.weight.detach() for m in mods])
        lin = nn.Linear(w.shape[1], w.shape[0], bias=any(m.bias is not None for m in mods), device=w.device,
                        dtype=w.dtype)
        lin.weight = nn.Parameter(w, requires_grad=False)
        if lin.bias is not None:
            lin.bias = nn.Parameter(_cat_bias(mods, w.dtype), requires_grad=False)
        return lin
    if all(isinstance(m, QuantLinear) for m in mods):
        q0 = mods[0]
        ok = all(m.bits == q0.bits and m.group_size == q0.group_size and m.in_features == q0.in_features
                 for m in mods) and _same([m.g_idx for m in mods]) and _same([m.smooth for m in mods]) \
            and len({m.zeros is None for m in mods}) == 1
        if ok:
            qw = QuantizedWeight(torch.cat([m.qweight for m in mods]), torch.cat([m.scales for m in mods]),
                                 None if q0.zeros is None else torch.cat([m.zeros for m in mods]),
                                 q0.bits, q0.group_size, q0.in_features, q0.g_idx)
            return QuantLinear(qw, _cat_bias(mods), q0.smooth)
    if all(isinstance(m, Fp8Linear) for m in mods):
        f0 = mods[0]
        if _same([m.input_scale for m in mods]) and _same([m.smooth for m in mods]):
            fw = Fp8Weight(torch.cat([m.weight for m in mods]), torch.cat([m.weight_scale.float() for m in mods]),
                           f0.input_scale)
            return Fp8Linear(fw, _cat_bias(mods), f0.smooth)
    return ConcatLinear([own_linear(m) for m in mods])


def own_linear(mod: nn.Module) -> nn.Module:
    """A linear of the runtime's own that shares ``mod``'s tensors (no copy of the weights) but none of its module
    state, so that preparing it (device moves, dtype casts, kernel layouts) changes neither the caller's model nor
    another runtime built from that model. Before this, the unfused linears (o, down, a quantized head) were the
    caller's modules themselves: a second runtime's prepare re-attached their layouts, and a CUDA graph captured on
    the first kept reading the freed ones (Pending 30 in docs/benchmarks/pending.md), and an nn.Linear was cast in place."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    if type(mod) is nn.Linear:
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
        lin.weight = nn.Parameter(mod.weight.detach(), requires_grad=False)
        if mod.bias is not None:
            lin.bias = nn.Parameter(mod.bias.detach(), requires_grad=False)
        return lin
    if type(mod) is QuantLinear:
        return QuantLinear(mod.weight_q, mod.bias, mod.smooth)
    if type(mod) is Fp8Linear:
        return Fp8Linear(mod.weight_q, mod.bias, mod.smooth)
    if type(mod) is ConcatLinear:
        return ConcatLinear([own_linear(m) for m in mod.parts])
    raise ConfigError("model", f"unsupported linear layer type {type(mod).__name__} (expected nn.Linear, QuantLinear "
                               "or Fp8Linear)")


def _prepare(mod: nn.Module, device, dtype, kernels: str):
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    for m in mod.modules():
        if isinstance(m, (QuantLinear, Fp8Linear)):
            if hasattr(m, "prepare"):
                m.prepare(device=device, dtype=dtype, kernels=kernels)
            else:
                m.to(device)
            if m.bias is not None:
                m.bias = m.bias.to(dtype)
            if m.smooth is not None:
                m.smooth = m.smooth.to(device)
        elif type(m) is nn.Linear:
            m.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------- modules
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF semantics: normalize in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, h, hd], cos/sin [S, hd] (halves duplicated, HF layout)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[None, :, None] + rot * sin[None, :, None]


class KVCache(nn.Module):
    def __init__(self, batch, n_kv, max_seq, head_dim, dtype, device):
        super().__init__()
        # keys and values in one buffer [2, B, nkv, T, hd]: one in-place write stores both, so under compile the
        # key's RoPE and both cache writes are one kernel (two separate index_copy_ were two kernels)
        shape = (2, batch, n_kv, max_seq, head_dim)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def k(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[1]

    def update(self, input_pos, k, v):
        # k, v [B, nkv, S, hd] written at cache slots input_pos [S]; in place, so CUDA graphs can replay it
        self.kv.index_copy_(3, input_pos, torch.stack([k, v]))
        return self.kv[0], self.kv[1]


ATTENTION_IMPLS = ("auto", "matmul", "sdpa", "sdpa_gqa", "triton")


def _resolve_attention(impl: str, x: torch.Tensor, head_dim: int) -> str:
    """"auto": the Triton decode kernel on CUDA tensors where triton is installed and head_dim is a power of two
    >= 16 (its tile rule), else "matmul".
    (H200, e2e run 6: "triton" beat "matmul" at B = 1 / 8 / 32 by 6.7 / 6.1 / 4.4% INT4, 2.3 / 3.0 / 1.6% bf16.)"""
    if impl != "auto":
        return impl
    if x.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0:
        from sdquant.kernels import decode_attention
        if decode_attention.available():
            return "triton"
    return "matmul"


class Attention(nn.Module):
    """impl (decode steps; prefill always uses "sdpa"):
    "auto"     (default) "triton" for CUDA tensors where triton is installed and head_dim is a power of two >= 16,
               otherwise "matmul" (``_resolve_attention``).
    "matmul"   q.k^T, masked fp32 softmax, p.v as plain ops: cuBLAS spreads the two small batched GEMMs over
               all SMs, inductor fuses the mask into the softmax (flash-decoding-like parallelism).
    "sdpa"     SDPA with the rep query heads of a KV head as rep query rows (no K/V repeat); with a mask SDPA
               uses its memory-efficient kernel, one block per (batch, KV head) at decode: few SMs busy.
    "sdpa_gqa" SDPA with enable_gqa=True on [B, nh, S, hd] queries.
    "triton"   ``sdquant::decode_attention`` (sdquant/kernels/decode_attention.py): flash-decoding over the
               live cache slots only (the position is read on the device, so CUDA graphs replay it), where the
               other three read and mask all max_seq slots at every step.
    """

    def __init__(self, d: DecoderDims, wqkv: nn.Module, wo: nn.Module, q_norm=None, k_norm=None,
                 impl: str = "auto"):
        super().__init__()
        self.d = d
        self.impl = impl
        self.wqkv, self.wo = wqkv, wo
        self.register_buffer("q_norm", q_norm)
        self.register_buffer("k_norm", k_norm)
        self.kv_cache: Optional[KVCache] = None
        self.window: Optional[int] = None        # the block's sliding window (set by Block)
        # decode steps with impl "triton": "gemm" (default) in fused INT4 blocks: the qkv GEMM's epilogue rotates q and
        # k and writes the cache (rope_why_not says where it cannot), and the attention, launched before that epilogue,
        # loads its older slots ahead of its PDL wait (attn_preload); elsewhere, and with "index_copy", KVCache.update
        # writes the cache (inductor compiles the key's RoPE and the write into two kernels a layer).
        # Transformer.set_kv_write; docs/benchmarks/decode.md, e2e runs 60-62
        self.kv_write = "gemm"
        self.attn_preload = True
        if impl == "triton":
            from sdquant.kernels import decode_attention  # noqa: F401  (registers the op)

    def forward(self, x, cos, sin, mask, input_pos):
        return self.wo(self.attend(self.wqkv(x), cos, sin, mask, input_pos))

    def rope_why_not(self, x: torch.Tensor, m: int) -> Optional[str]:
        """Why a fused decode step of m rows (x: the qkv GEMM's input) does not rotate q, k and write the cache in the
        qkv GEMM's epilogue (None: it does; then ``attend_rotated`` follows)."""
        if self.kv_write != "gemm":
            return f"kv_write is {self.kv_write!r}"
        if _resolve_attention(self.impl, x, self.d.head_dim) != "triton":
            return "the decode attention is not the triton kernel"
        if self.q_norm is not None:
            return "q / k norms come between the projection and the RoPE"
        from sdquant.kernels.int4_cuda import rope_why_not
        return rope_why_not(self.d.q_size + 2 * self.d.kv_size, self.d.q_size, self.kv_cache.kv, m)

    def attend_rotated(self, qkv, input_pos):
        """The decode attention after the qkv GEMM's RoPE epilogue: qkv [B, 1, q + 2 kv] holds rope(q) and the cache
        this step's key and value."""
        d = self.d
        b = qkv.shape[0]
        q = qkv[..., :d.q_size].view(b, d.n_kv_heads, d.n_heads // d.n_kv_heads, d.head_dim)
        y = torch.ops.sdquant.decode_attention(q, self.kv_cache.k, self.kv_cache.v, input_pos, self.window or 0,
                                               d.head_dim ** -0.5, None, None, self.attn_preload)  # [B, nkv, rep, hd]
        return y.reshape(b, 1, d.q_size)

    def attend(self, qkv, cos, sin, mask, input_pos):
        """qkv [B, S, q + 2 kv] (the fused projection's output) -> the attention output [B, S, nh * hd] before wo;
        writes the new keys and values into the cache."""
        d = self.d
        b, s, _ = qkv.shape
        rep = d.n_heads // d.n_kv_heads
        q, k, v = qkv.split([d.q_size, d.kv_size, d.kv_size], dim=-1)
        q = q.view(b, s, d.n_heads, d.head_dim)
        k = k.view(b, s, d.n_kv_heads, d.head_dim)
        v = v.view(b, s, d.n_kv_heads, d.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, d.rms_eps), rms_norm(k, self.k_norm, d.rms_eps)
        impl = _resolve_attention(self.impl, qkv, d.head_dim) if s == 1 else "sdpa"
        k = apply_rope(k, cos, sin)
        k_all, v_all = self.kv_cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))  # [B, nkv, T, hd]
        if impl != "triton":  # the Triton kernel rotates q as it loads it (no kernel of its own)
            q = apply_rope(q, cos, sin)
        if impl == "matmul":
            q = q.view(b, d.n_kv_heads, rep, d.head_dim)                                      # [B, nkv, rep, hd]
            scores = torch.matmul(q, k_all.transpose(-1, -2)).float() * d.head_dim ** -0.5    # [B, nkv, rep, T]
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
            return torch.matmul(p, v_all).reshape(b, 1, d.q_size)                             # [B, 1, nh*hd]
        if impl == "triton":
            q = q.view(b, d.n_kv_heads, rep, d.head_dim)
            y = torch.ops.sdquant.decode_attention(q, k_all, v_all, input_pos, self.window or 0,
                                                   d.head_dim ** -0.5, cos, sin)         # [B, nkv, rep, hd]
            return y.reshape(b, 1, d.q_size)
        if impl == "sdpa_gqa":
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask,
                                               enable_gqa=True)                               # [B, nh, 1, hd]
            return y.reshape(b, 1, d.q_size)
        # GQA without repeating K/V: the rep query heads of one KV head become rep*S query rows
        q = q.view(b, s, d.n_kv_heads, rep, d.head_dim).permute(0, 2, 3, 1, 4).reshape(b, d.n_kv_heads, rep * s,
                                                                                          d.head_dim)
        m = mask if s == 1 else mask.repeat(rep, 1)                                           # [rep*S, T]
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=m)                      # [B, nkv, rep*S, hd]
        return y.view(b, d.n_kv_heads, rep, s, d.head_dim).permute(0, 3, 1, 2, 4).reshape(b, s, d.q_size)


class FloatEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)                                                 # [V, H]

    def forward(self, idx):
        return F.embedding(idx, self.weight)


class QuantEmbedding(nn.Module):
    """Embedding rows stored as a canonical 4/8-bit QuantizedWeight [V, H]; only the looked-up rows are
    dequantized (a gather of B*S rows), so the table costs 0.5 byte per weight on the device instead of 2."""

    def __init__(self, qw, dtype=torch.bfloat16):
        super().__init__()
        from sdquant.errors import ShapeError
        from sdquant.quant.qtensor import effective_group_size
        if qw.bits not in (4, 8) or qw.g_idx is not None:
            raise ShapeError(f"QuantEmbedding: bits={qw.bits}, act-order={qw.g_idx is not None}; "
                             f"supported: 4 or 8 bits, no g_idx")
        self.bits, self.dim, self.dtype = qw.bits, qw.in_features, dtype
        self.gs = effective_group_size(qw.in_features, qw.group_size)
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)

    def forward(self, idx):
        rows = self.qweight[idx]                                                               # [B, S, H*bits/8]
        if self.bits == 4:
            rows = torch.stack([rows & 15, rows >> 4], dim=-1).flatten(-2)                     # [B, S, H]
        s = self.scales[idx].float().repeat_interleave(self.gs, dim=-1)                        # [B, S, H]
        z = float(1 << (self.bits - 1)) if self.zeros is None else \
            self.zeros[idx].float().repeat_interleave(self.gs, dim=-1)
        return ((rows.float() - z) * s).to(self.dtype)


class Block(nn.Module):
    def __init__(self, d: DecoderDims, attn: Attention, w13: nn.Module, w2: nn.Module, attn_norm, ffn_norm,
                 window: Optional[int]):
        super().__init__()
        self.d, self.attn, self.w13, self.w2 = d, attn, w13, w2
        self.register_buffer("attn_norm", attn_norm)
        self.register_buffer("ffn_norm", ffn_norm)
        self.window = window
        attn.window = window
        # 64: w13's gate and up rows alternate in 64-row blocks (int4_cuda.interleave_gate_up), the layout the fused
        # decode kernel's SiLU epilogue reads; 0: gate rows, then up rows
        self.gate_up_block = 0

    def gate_up(self, y):
        """(gate, up) halves of w13's output."""
        if self.gate_up_block:
            from sdquant.kernels.int4_cuda import deinterleave_gate_up
            return deinterleave_gate_up(y, self.gate_up_block)
        return y.chunk(2, dim=-1)

    def fused_why_not(self, m: int) -> Optional[str]:
        """Why ``forward_fused`` cannot run M = ``m`` decode rows (None: it can): all four linears must take the fused
        INT4 kernel at this M (``QuantLinear.fused_why_not``) and w13 must be interleaved."""
        from sdquant.kernels.linear import QuantLinear
        if not self.gate_up_block:
            return "w13 is not interleaved"
        for name, lin in (("wqkv", self.attn.wqkv), ("wo", self.attn.wo), ("w13", self.w13), ("w2", self.w2)):
            if not isinstance(lin, QuantLinear):
                return f"{name} is not a QuantLinear"
            why = lin.fused_why_not(m)
            if why is not None:
                return f"{name}: {why}"
        return None

    def forward_fused(self, x, xg, ss, cos, sin, mask, input_pos, next_norm):
        """A decode step of the block through the fused INT4 kernels: x is the residual stream, xg = x * attn_norm
        (rounded) and ss the sums of squares of x in column blocks (fp32 [..., T]). The RMSNorms' scales, the SiLU * up
        and both residual adds happen in the GEMMs' prologues and epilogues. Returns (x', x' * next_norm, ss'): the
        next block's (x, xg, ss), or the final norm's."""
        eps = self.d.rms_eps
        at = self.attn
        if at.rope_why_not(xg, xg.numel() // xg.shape[-1]) is None:  # RoPE and the cache write in the qkv epilogue
            qkv = at.wqkv.forward_fused_rope(xg, ss, eps, at.kv_cache.kv, input_pos, cos, sin, self.d.q_size)
            y = at.attend_rotated(qkv, input_pos)
        else:
            y = at.attend(at.wqkv.forward_fused(xg, rms_ss=ss, eps=eps)[0], cos, sin, mask, input_pos)
        h, hg, hss = at.wo.forward_fused(y, resid=x, gamma=self.ffn_norm)
        a = self.w13.forward_fused(hg, rms_ss=hss, eps=eps, silu=True)[0]
        return self.w2.forward_fused(a, resid=h, gamma=next_norm)

    def forward(self, x, cos, sin, mask, input_pos):
        h, mlp_out = self.forward_deferred(x, cos, sin, mask, input_pos, None)
        return h + mlp_out

    def forward_deferred(self, x, cos, sin, mask, input_pos, pending: Optional[torch.Tensor]):
        """The block with its last residual add deferred: adds the previous block's ``pending`` MLP output to x
        first (None: nothing pending) and returns (residual stream, this block's MLP output). Under a per-block
        torch.compile the add then lands in the next block's first RMSNorm kernel instead of a kernel of its own
        (the same add of the same operands: the same values; the runtime passes zeros to its first block, which
        can only turn an exact -0.0 of the embedding into +0.0)."""
        if pending is not None:
            x = x + pending
        h = x + self.attn(rms_norm(x, self.attn_norm, self.d.rms_eps), cos, sin, mask, input_pos)
        g, u = self.gate_up(self.w13(rms_norm(h, self.ffn_norm, self.d.rms_eps)))
        return h, self.w2(F.silu(g) * u)


def _block_call(block: Block, x, cos, sin, mask, input_pos, pending=None):
    return block.forward_deferred(x, cos, sin, mask, input_pos, pending)


def _prefill_block_call(block: Block, x, cos, sin, mask, input_pos, pending=None):
    # a code object of its own: compiled with other options than _block_call, it keeps its own dynamo cache
    return block.forward_deferred(x, cos, sin, mask, input_pos, pending)


def _fused_block_call(block: Block, x, xg, ss, cos, sin, mask, input_pos, next_norm):
    return block.forward_fused(x, xg, ss, cos, sin, mask, input_pos, next_norm)


def _embed_call(rt: "Transformer", idx, input_pos, fused: bool):
    """A step's inputs to its first block: (x, cos, sin, the masks in ``rt.masks``' order, xg, ss, pending). For the
    fused blocks xg and ss are the first RMSNorm's weighted input and statistic (pending None); for the others pending
    is the zeros the first block adds (forward_deferred; xg and ss None)."""
    x = rt.tok(idx)                                                                           # [B, S, H]
    cos, sin = rt.rope_cos[input_pos], rt.rope_sin[input_pos]                                 # [S, hd]
    masks = tuple(m[input_pos] for m in rt.masks.values())                                    # [S, T] each
    if not fused:
        return x, cos, sin, masks, None, None, torch.zeros_like(x)
    from sdquant.kernels.int4_cuda import block_sumsq
    return x, cos, sin, masks, x * rt.layers[0].attn_norm, block_sumsq(x, x.shape[-1]), None


def _head_call(rt: "Transformer", x, pending, xg, ss, last_only: bool, greedy: bool):
    """The last block's outputs -> logits (float32) or, greedy, their argmax. pending: the unfused blocks' deferred
    MLP output (None after fused blocks, whose xg, ss are the last RMSNorm's input and statistic)."""
    from sdquant.kernels.linear import QuantLinear
    head = rt.lm_head
    if pending is None and isinstance(head, QuantLinear) and head.fused_why_not(x.shape[0] * x.shape[1]) is None:
        logits = head.forward_fused(xg, rms_ss=ss, eps=rt.d.rms_eps)[0].float()
    else:
        if pending is not None:
            x = x + pending
        if last_only:
            x = x[:, -1:]
        logits = head(rms_norm(x, rt.norm, rt.d.rms_eps)).float()
    return greedy_argmax(logits) if greedy else logits


ARGMAX_CHUNK = 512  # greedy_argmax's first stage: the maximum of each run of 512 logits


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> their argmax [...] (int64), torch.argmax's result (the first index of the maximum, NaN
    counting as the maximum), in two stages: each run of ARGMAX_CHUNK logits' maximum and its first index, then the
    first run holding the largest of those. Compiled, a whole vocabulary in one row is otherwise one reduction kernel
    in one program (inductor does not split argmax): 20-30 us a batch-1 step on the H200 for 128256 logits (e2e run
    73), most of it after the head. The tail is padded with -inf (after any real value: the first index wins ties)."""
    v = logits.shape[-1]
    if v <= 2 * ARGMAX_CHUNK:
        return logits.argmax(-1)
    runs = -(-v // ARGMAX_CHUNK)
    x = F.pad(logits, (0, runs * ARGMAX_CHUNK - v), value=float("-inf")).unflatten(-1, (runs, ARGMAX_CHUNK))
    best, at = x.max(-1)                                                                       # [..., runs]
    r = best.argmax(-1, keepdim=True)
    return (r * ARGMAX_CHUNK + at.gather(-1, r)).squeeze(-1)


def _interleave_w13(w13: nn.Module, inter: int) -> Optional[nn.Module]:
    """w13 (a QuantLinear of gate rows then up rows) with its rows in the fused kernel's interleaved order, or None
    where that does not apply (not one QuantLinear, or features not a multiple of 64)."""
    from sdquant.kernels.int4_cuda import FUSED_BLOCK, interleave_gate_up
    from sdquant.kernels.linear import QuantLinear
    from sdquant.quant.qtensor import QuantizedWeight
    if not isinstance(w13, QuantLinear) or inter % FUSED_BLOCK or w13.out_features != 2 * inter:
        return None
    perm = interleave_gate_up(inter).to(w13.qweight.device)
    pick = lambda t: None if t is None else t.index_select(0, perm)  # noqa: E731
    qw = QuantizedWeight(pick(w13.qweight), pick(w13.scales), pick(w13.zeros), w13.bits, w13.group_size,
                         w13.in_features, w13.g_idx)
    return QuantLinear(qw, pick(w13.bias), w13.smooth)


class Transformer(nn.Module):
    def __init__(self, d: DecoderDims, embed, blocks: List[Block], norm: torch.Tensor,
                 lm_head: nn.Module, rope_cos: torch.Tensor, rope_sin: torch.Tensor):
        super().__init__()
        self.d = d
        self.tok = embed if isinstance(embed, nn.Module) else FloatEmbedding(embed)          # [V, H] lookup
        self.layers = nn.ModuleList(blocks)
        self.register_buffer("norm", norm)
        self.lm_head = lm_head
        self.register_buffer("rope_cos", rope_cos, persistent=False)   # [P, hd]
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.max_batch = self.max_seq = 0
        self.pdl = False  # compile_decode sets it
        self._block_fn = _block_call
        self._prefill_block_fn = None   # compile_decode(scope="block") may give prompts (S > 1) their own compile
        self._fused_block_fn = _fused_block_call
        self._embed_fn = self._head_fn = None  # compile_decode(scope="block"): a decode step's glue, compiled
        self._compiled = False          # compile_decode sets it (_recompile_scope)
        self.graph_decode = False       # compile_decode(scope="block"): generate replays decode_graph's CUDA graphs
        self._graph_steps: dict = {}    # decode_graph's captures, by (batch, cache length, greedy)
        self.fused_decode = False       # from_spec(fused=...): decode steps through Block.forward_fused where it runs
        self._decode = self.forward

    # ------------------------------------------------------------------------------------- construction
    @classmethod
    def from_spec(cls, spec: DecoderSpec, max_seq_len: int = 2048, device="cpu", dtype=torch.float32,
                  kernels: str = "auto", compile: Optional[str] = None,  # noqa: A002
                  pdl: Optional[bool] = None, fused: Optional[bool] = None) -> "Transformer":
        """compile: None (eager) or a torch.compile mode ("reduce-overhead": fullgraph + CUDA graphs); pdl: see
        ``compile_decode``. fused: decode steps of at most ``int4_cuda.FUSED_MAX_M`` rows through the fused INT4
        kernels (``Block.forward_fused``: the RMSNorms, SiLU * up and residual adds inside the GEMMs), for INT4 layers
        on the CUDA kernel; None (default) = for an INT4 model on a GPU where that kernel is built, True = whatever the
        device (a step is still fused only where every layer's plan runs the CUDA kernel: the CPU tests build its
        layout on the host), False = never. w13's gate and up rows are then interleaved."""
        d = spec.dims
        if fused is None:
            from sdquant.kernels.linear import QuantLinear
            fused = torch.device(device).type == "cuda" and any(isinstance(L.gate, QuantLinear) for L in spec.layers)
            if fused:  # (only an INT4 model builds the extension here; prepare would build it anyway)
                from sdquant.kernels import int4_cuda
                fused = int4_cuda.available()
        if max_seq_len > d.max_position_embeddings:
            raise ConfigError("max_seq_len", f"{max_seq_len} exceeds the model's max_position_embeddings "
                                             f"({d.max_position_embeddings})")
        cast = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype)  # noqa: E731
        blocks = []
        for i, L in enumerate(spec.layers):
            wqkv, w13 = fuse_linears([L.q, L.k, L.v]), fuse_linears([L.gate, L.up])
            w13i = _interleave_w13(w13, d.intermediate_size) if fused else None
            w13 = w13i if w13i is not None else w13
            wo, w2 = own_linear(L.o), own_linear(L.down)
            for m in (wqkv, wo, w13, w2):
                _prepare(m, device, dtype, kernels)
            attn = Attention(d, wqkv, wo, cast(L.q_norm), cast(L.k_norm))
            blocks.append(Block(d, attn, w13, w2, cast(L.input_norm), cast(L.post_norm), d.sliding_window[i]))
            if w13i is not None:
                from sdquant.kernels.int4_cuda import FUSED_BLOCK
                blocks[-1].gate_up_block = FUSED_BLOCK
        head = spec.lm_head
        if type(head) is nn.Linear:
            head = nn.Linear(d.hidden_size, d.vocab_size, bias=head.bias is not None, device=device, dtype=dtype)
            head.weight = nn.Parameter(cast(spec.lm_head.weight), requires_grad=False)
            if head.bias is not None:
                head.bias = nn.Parameter(cast(spec.lm_head.bias), requires_grad=False)
        else:
            head = own_linear(head)
            _prepare(head, device, dtype, kernels)
        cos, sin = spec.rope_tables(max_seq_len)
        rt = cls(d, cast(spec.embed), blocks, cast(spec.final_norm), head, cast(cos), cast(sin)).eval()
        rt.fused_decode = bool(fused)
        return rt.compile_decode(mode=compile, pdl=pdl) if compile else rt

    @classmethod
    def from_hf(cls, model: nn.Module, max_seq_len: int = 2048, device="cpu", dtype=torch.float32,
                kernels: str = "auto", compile: Optional[str] = None,  # noqa: A002
                pdl: Optional[bool] = None, fused: Optional[bool] = None) -> "Transformer":
        """From a HF causal LM of a supported family; linears may be nn.Linear, QuantLinear or Fp8Linear."""
        return cls.from_spec(decoder_spec(model), max_seq_len, device, dtype, kernels, compile, pdl, fused)

    # ------------------------------------------------------------------------------------------ caches
    def setup_caches(self, max_batch: int, max_seq: int):
        if max_seq > self.rope_cos.shape[0]:
            raise ConfigError("max_seq", f"{max_seq} exceeds the RoPE table ({self.rope_cos.shape[0]} positions)")
        if (max_batch, max_seq) == (self.max_batch, self.max_seq):
            return
        self.drop_decode_graphs()   # captured over the caches being replaced
        d, dev, dt = self.d, self.norm.device, self.norm.dtype
        for blk in self.layers:
            blk.attn.kv_cache = None
        for blk in self.layers:
            blk.attn.kv_cache = KVCache(max_batch, d.n_kv_heads, max_seq, d.head_dim, dt, dev)
        self.max_batch, self.max_seq = max_batch, max_seq
        idx = torch.arange(max_seq, device=dev)
        causal = idx[None, :] <= idx[:, None]                                                 # [T, T]
        self.masks = {None: causal}
        for w in {blk.window for blk in self.layers} - {None}:
            self.masks[w] = causal & (idx[None, :] > idx[:, None] - w)

    def clear_caches(self, start: int = 0):
        """Zero every layer's cache slots from ``start`` on, in place (captured CUDA graphs stay valid). The attention
        masks slots past the position with zero weights, and zero times a non-finite value a previous request left
        there is still NaN; ``generate`` clears the slots past its prompt before each prompt."""
        for blk in self.layers:
            if blk.attn.kv_cache is not None:
                blk.attn.kv_cache.kv[..., start:, :].zero_()

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, last_only: bool = False,
                greedy: bool = False) -> torch.Tensor:
        """idx [B, S] token ids at cache slots input_pos [S] -> logits [B, S, V] (float32); last_only: the
        logits of the last position only ([B, 1, V]: a prefill needs no others); greedy: the argmax token ids
        instead of the logits ([B, S] or [B, 1], int64)."""
        if self.max_seq == 0:
            raise SdquantError("Transformer: call setup_caches(max_batch, max_seq) before forward")
        decode = idx.shape[1] == 1
        fused = self.fused_why_not(idx.shape[0] * idx.shape[1], idx.shape[1]) is None
        # a decode step's glue before the first block and after the last (_embed_call: embedding, RoPE rows, masks,
        # the first RMSNorm's statistic; _head_call: the last norm, the head, the argmax) is compiled by
        # compile_decode(scope="block") as two functions of its own: a few fused kernels instead of ~25 eager ones
        embed = self._embed_fn if decode and self._embed_fn is not None else _embed_call
        head = self._head_fn if decode and self._head_fn is not None else _head_call
        x, cos, sin, masks, xg, ss, pending = embed(self, idx, input_pos, fused)
        masks = dict(zip(self.masks, masks))
        if fused:
            layers = self.layers
            for i, blk in enumerate(layers):
                nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else self.norm
                x, xg, ss = self._fused_block_fn(blk, x, xg, ss, cos, sin, masks[blk.window], input_pos, nxt)
        else:
            # each block's MLP output is added inside the next block's first RMSNorm (forward_deferred); the first
            # block gets zeros (pending, from _embed_call), so one compiled block serves every layer (None would be a
            # graph of its own)
            block_fn = self._prefill_block_fn if not decode and self._prefill_block_fn is not None else \
                self._block_fn
            for blk in self.layers:
                x, pending = block_fn(blk, x, cos, sin, masks[blk.window], input_pos, pending)
        return head(self, x, pending, xg, ss, last_only, greedy)

    def fused_why_not(self, m: int, s: int = 1) -> Optional[str]:
        """Why a step of M = ``m`` rows (``s`` new tokens a sequence) does not go through the fused blocks (None: it
        does). Decided when the step is traced, so a compiled step keeps its choice."""
        if not self.fused_decode:
            return "fused decode is off"
        if s != 1:
            return "a prompt (more than one new token a sequence)"
        for i, blk in enumerate(self.layers):
            why = blk.fused_why_not(m)
            if why is not None:
                return f"layer {i}: {why}"
        return None

    def set_attention(self, impl: str) -> "Transformer":
        """Choose the decode attention implementation (see ``Attention``) for every layer."""
        if impl not in ATTENTION_IMPLS:
            raise ConfigError("attention", f"must be one of {', '.join(ATTENTION_IMPLS)}, got {impl!r}")
        if impl == "triton":
            from sdquant.kernels import decode_attention
            if not decode_attention.available():
                raise ConfigError("attention", "'triton' needs the triton package")
        for blk in self.layers:
            blk.attn.impl = impl
        self.drop_decode_graphs()   # captured with the kernels being replaced
        return self

    def set_kv_write(self, mode: str) -> "Transformer":
        """Where decode steps with the "triton" attention rotate k and write the KV cache, for every layer: "gemm"
        (default: in fused INT4 blocks with 128-feature heads and no q / k norms, the qkv GEMM's epilogue rotates q and
        k and writes the cache, ``sdquant::w4a16_cuda_fused_rope``; other blocks as "index_copy") or "index_copy"
        (KVCache.update: the key's RoPE and the write compiled by inductor)."""
        if mode not in ("index_copy", "gemm"):
            raise ConfigError("kv_write", f"must be 'index_copy' or 'gemm', got {mode!r}")
        for blk in self.layers:
            blk.attn.kv_write = mode
        self.drop_decode_graphs()   # captured with the kernels being replaced
        return self

    def decode_step(self, idx: torch.Tensor, input_pos: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """One token per sequence: idx [B, 1] -> logits [B, V], or with greedy their argmax [B] (int64; inside the
        compiled step). The compiled entry point."""
        with self._recompile_scope():
            return self._decode(idx, input_pos, greedy=greedy)[:, -1]

    def decode_graph(self, greedy: bool) -> "CUDAGraphStep":
        """The decode step at the cache's batch captured once as one CUDA graph and kept until the caches change
        (``generate`` replays it on a block-compiled CUDA model). greedy: the step returns its token [B, 1] and feeds
        it back inside the graph (CUDAGraphStep feedback=True); else its logits [B, V] from the inputs copied in.
        Capturing runs the step twice at slot 0 (warm-up), so capture before a prompt fills the cache."""
        key = (self.max_batch, self.max_seq, greedy)
        step = self._graph_steps.get(key)
        if step is None:
            if greedy:
                def fn(idx, pos):
                    return self.decode_step(idx, pos, greedy=True)[:, None]
            else:
                def fn(idx, pos):
                    return self.decode_step(idx, pos)
            step = CUDAGraphStep(fn, self.max_batch, self.norm.device, feedback=greedy)
            self._graph_steps[key] = step
        return step

    def drop_decode_graphs(self) -> None:
        """Forget decode_graph's captures. setup_caches, compile_decode, set_attention and set_kv_write do it
        themselves; call it after changing anything else a captured step reads, such as re-preparing a layer by hand
        (a graph keeps the addresses it captured, so it would go on reading the layer's old, freed layouts)."""
        self._graph_steps.clear()

    def __call__(self, *args, **kwargs):
        with self._recompile_scope():   # prompts and direct calls (a compiled model's blocks may recompile)
            return super().__call__(*args, **kwargs)

    @contextlib.contextmanager
    def _recompile_scope(self):
        """Around a compiled model's calls: torch._dynamo's recompile limit raised to RECOMPILE_LIMIT for their
        duration only (each batch size and cache length is a graph of its own, and torch's default of 8 failed the
        9th), and that limit's error as one SdquantError line. Nothing for a model compile_decode has not compiled."""
        if not getattr(self, "_compiled", False):
            yield
            return
        cfg = torch._dynamo.config
        old = cfg.recompile_limit
        cfg.recompile_limit = max(old, RECOMPILE_LIMIT)
        try:
            yield
        except Exception as e:
            _raise_if_recompile_limit(e, self)
            raise
        finally:
            cfg.recompile_limit = old

    # ------------------------------------------------------------------------------------------ compile
    def compile_decode(self, mode: Optional[str] = "reduce-overhead", fullgraph: bool = True, backend="inductor",
                       scope: str = "model", dynamic: bool = False, pdl: Optional[bool] = None,
                       options: Optional[dict] = None):
        """torch.compile the decode path.

        scope="model": the whole forward as one graph (mode="reduce-overhead" captures it in a CUDA graph).
        scope="block": one compiled block reused by every layer (compiles in seconds instead of minutes for
            32 layers), without inductor's CUDA graphs whatever the mode (they cannot chain one graph through the
            layers); wrap the step in ``CUDAGraphStep`` to replay a whole token as one graph.
        pdl: programmatic dependent launch (Hopper+): inductor's kernels (``triton.enable_pdl``, passed as this
            compile's options, not a global setting) and sdquant's INT4 GEMM and decode attention kernels
            (``int4_cuda.set_pdl`` / ``decode_attention.set_pdl``, process-wide) start while the previous kernel
            finishes and wait on the device for its results, so launch latency and the GEMM's first weight loads
            overlap the kernel before. None (default): on where it can run (inductor, a CUDA device of compute
            capability >= 9, a torch whose inductor has the option); True where it cannot is a ConfigError.
            Measured on the H200 (docs/benchmarks/decode.md, e2e runs 12-19), INT4 Llama-3-8B shapes at batch 1:
            399-403 tokens/s with it (and PDL_DECODE_OPTIONS), 365-370 without.
        options: extra inductor options (torch.compile's ``options``), merged with ``mode``'s. With PDL the decode
            step also gets ``PDL_DECODE_OPTIONS`` (given options win); with scope="block", prompts (S > 1) then run
            a block compiled without them.
        """
        if scope not in ("model", "block"):
            raise ConfigError("scope", f"must be 'model' or 'block', got {scope!r}")
        why_not = pdl_unsupported(self.norm.device, backend)
        if pdl and why_not:
            raise ConfigError("pdl", f"programmatic dependent launch cannot run here: {why_not}")
        pdl = not why_not if pdl is None else bool(pdl)
        base = dict(options or {})
        if scope == "block" and backend == "inductor":
            # inductor's CUDA graphs (mode="reduce-overhead") cannot serve one compiled block chained through every
            # layer: its cudagraph trees overwrite the outputs that the next layer reads ("accessing tensor output
            # of CUDAGraphs that has been overwritten", H200, bench/compile_smoke.py, run 20). The block compiles
            # without them; CUDAGraphStep replays the whole step as one graph instead.
            base["triton.cudagraphs"] = False
        decode_opts = {**PDL_DECODE_OPTIONS, **base} if pdl else base

        def compile_kwargs(opts, dyn=dynamic):
            kwargs = dict(fullgraph=fullgraph, backend=backend, dynamic=dyn)
            if pdl or opts:
                kwargs["options"] = {**inductor_options(mode, pdl=pdl), **opts}
            else:
                kwargs["mode"] = mode
            return kwargs
        if pdl:
            from sdquant.kernels import decode_attention, int4_cuda
            int4_cuda.set_pdl(True, early_trigger=True)
            decode_attention.set_pdl(True, early_trigger=True)
        self.pdl = pdl
        self._compiled = True
        self.drop_decode_graphs()
        self.graph_decode = scope == "block"
        if scope == "model":   # prompts run eager (forward); the compiled forward serves decode steps
            self._decode = torch.compile(self.forward, **compile_kwargs(decode_opts))
        else:
            self._block_fn = torch.compile(_block_call, **compile_kwargs(decode_opts))
            self._fused_block_fn = torch.compile(_fused_block_call, **compile_kwargs(decode_opts))
            # the step's glue before the first block and after the last (decode only: forward routes prompts to the
            # plain functions): ~25 eager kernels a step become a few inductor kernels (H200, docs/benchmarks/decode.md)
            self._embed_fn = torch.compile(_embed_call, **compile_kwargs(decode_opts))
            self._head_fn = torch.compile(_head_call, **compile_kwargs(decode_opts))
            # prompts (S > 1) in a block of their own, without the decode-only options and with torch.compile's
            # automatic dynamic shapes (dynamic=None): a second prompt length compiles one graph for every length, where
            # static shapes compiled a graph a length until torch's recompile limit (8) failed the call
            self._prefill_block_fn = torch.compile(_prefill_block_call,
                                                   **compile_kwargs(base, True if dynamic else None))
            self._decode = self.forward
        return self


# Inductor options compile_decode adds to the decode step when PDL is on. multi_kernel: the 4096-wide RMSNorm
# reductions are above inductor's 1024-element limit for a one-pass (persistent) reduction, so it would emit only a
# two-pass looped one; with multi-kernel it emits both and keeps the faster after timing them on the first call.
# H200, INT4 with PDL, same run: 402.8 vs 390.6 tok/s at batch 1 (e2e run 16), 402.1 vs 389.8 (run 17); unchanged at
# batch 8 and 32. Not for prompts: the 2048-token prefill ran 55.2 vs 51.3 ms with it (run 17). Not without PDL:
# torch 2.11's inductor failed to compile the batch-1 step with multi-kernel and no PDL ("'NoneType' object does not
# support the context manager protocol", run 17).
PDL_DECODE_OPTIONS = {"triton.multi_kernel": 1}


def pdl_unsupported(device, backend: str = "inductor") -> Optional[str]:
    """Why programmatic dependent launch cannot be used for a model on ``device`` (None: it can)."""
    device = torch.device(device)
    if backend != "inductor":
        return f"backend {backend!r} is not inductor"
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA device"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return f"{torch.cuda.get_device_name(device)} is older than Hopper (compute capability 9)"
    import torch._inductor.config as inductor_config
    if not hasattr(inductor_config.triton, "enable_pdl"):
        return f"torch {torch.__version__}: inductor has no triton.enable_pdl"
    return None


def inductor_options(mode: Optional[str], pdl: bool) -> dict:
    """torch.compile ``options`` equivalent to ``mode`` (torch accepts mode or options, not both), plus
    inductor's programmatic dependent launch when ``pdl``."""
    from torch._inductor import list_mode_options
    opts = dict(list_mode_options(mode or "default"))
    if pdl:
        opts["triton.enable_pdl"] = True
    return opts


RECOMPILE_LIMIT = 64   # graphs a compiled function may hold in a compiled model's calls (Transformer._recompile_scope)


def _raise_if_recompile_limit(e: Exception, rt: "Transformer") -> None:
    """torch.compile's recompile limit, hit by a compiled step's new static shape (a batch size or cache length it has
    not seen, one graph each), as a one-line SdquantError saying what to do instead of dynamo's own error."""
    if type(e).__name__ != "FailOnRecompileLimitHit":
        return
    raise SdquantError(
        f"compiled model: batch {rt.max_batch} over a {rt.max_seq}-slot cache needed a new graph past torch.compile's "
        f"recompile limit ({torch._dynamo.config.recompile_limit} a function; each batch size and cache length is a "
        "graph of its own): serve fewer batch sizes (pad requests to a few), or raise "
        "sdquant.runtime.model.RECOMPILE_LIMIT") from None


class CUDAGraphStep:
    """Capture ``fn(idx [B,1], input_pos [1])`` once for a batch size and replay it per token (the same thing
    mode="reduce-overhead" does, without torch.compile owning the graph, so a block-compiled model works).

    ``feedback=True`` is for a greedy step whose output is the next token, [B, 1] integers: the graph itself then
    copies that output into its ``idx`` input and advances its position by one, so a greedy loop is ``step()`` per
    token with no copy launched between replays (set ``step.pos`` once, or pass ``input_pos`` to move it). Without
    it, each call copies ``idx`` and ``input_pos`` into the graph's inputs before the replay."""

    def __init__(self, fn, batch: int, device, warmup: int = 2, feedback: bool = False):
        self.idx = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.feedback = feedback
        if feedback and warmup < 1:
            raise ValueError("CUDAGraphStep(feedback=True): needs warmup >= 1 (the step's output is checked there)")
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(warmup):
                out = fn(self.idx, self.pos)
        torch.cuda.current_stream(device).wait_stream(s)
        why = feedback_why_not(out, self.idx) if feedback else None
        if why:
            raise ValueError(f"CUDAGraphStep(feedback=True): {why}")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(self.idx, self.pos)
            if feedback:
                self.idx.copy_(self.out)
                self.pos.add_(1)

    def __call__(self, idx: Optional[torch.Tensor] = None, input_pos: Optional[torch.Tensor] = None):
        if not self.feedback and (idx is None or input_pos is None):
            raise ValueError("CUDAGraphStep: idx and input_pos are required unless the step was captured with "
                             "feedback=True")
        if idx is not None:
            self.idx.copy_(idx)
        if input_pos is not None:
            self.pos.copy_(input_pos)
        self.graph.replay()
        return self.out


def feedback_why_not(out, idx: torch.Tensor) -> Optional[str]:
    """Why a step's output cannot be fed back as its next input (CUDAGraphStep(feedback=True)); None when it can: an
    integer tensor of idx's shape."""
    if not isinstance(out, torch.Tensor):
        return f"the step returned {type(out).__name__}, not a tensor of tokens"
    if out.shape != idx.shape:
        return (f"the step returned shape {tuple(out.shape)}, but its token input is {tuple(idx.shape)} "
                "(a greedy step returns [B, 1])")
    if out.dtype.is_floating_point or out.dtype.is_complex or out.dtype == torch.bool:
        return f"the step returned {out.dtype}, not integer tokens (feed back a greedy step, not logits)"
    return None


# ------------------------------------------------------------------------------------------- generation
def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator=None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
        logits = torch.where(logits < v[..., -1:], torch.full_like(logits, -float("inf")), logits)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[..., 0]


CACHE_STEP = 256


def cache_len_for(total: int, table: int) -> int:
    """The cache length ``generate`` allocates for ``total`` positions: a multiple of a quarter of the largest power of
    two <= total, at least CACHE_STEP slots (so at most 25% more slots than needed past 4 * CACHE_STEP, and four lengths
    an octave: a compiled model meets a few cache lengths, not one a request), capped at the RoPE table's ``table``
    positions (past it, setup_caches names the limit)."""
    t = max(total, 1)
    step = max(CACHE_STEP, (1 << (t.bit_length() - 1)) >> 2)
    return max(total, min(-(-t // step) * step, table))


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: Optional[int] = None, eos_token_id: Optional[int] = None, generator=None) -> torch.Tensor:
    """prompt [B, S] (equal lengths, no padding) -> [B, S + n] tokens. Greedy when temperature == 0."""
    b, s = prompt.shape
    total = s + max_new_tokens
    if b != model.max_batch or total > model.max_seq:
        # the cache batch is exact (static shapes); its length grows in steps (cache_len_for, at most the RoPE table),
        # so a compiled model meets a few cache lengths rather than one a request
        model.setup_caches(b, max(cache_len_for(total, model.rope_cos.shape[0]), model.max_seq))
    dev = model.norm.device
    prompt = prompt.to(dev)
    greedy = temperature <= 0   # then each step returns its argmax (inside the compiled step), not the logits
    # a block-compiled CUDA model replays each decode step as one CUDA graph (captured before the prompt: the capture's
    # warm-up writes cache slot 0), a greedy one feeding its own token and position
    graph = model.decode_graph(greedy) if max_new_tokens > 1 and _graphs_here(model) else None
    model.clear_caches(s)   # slots an earlier request left (the prompt overwrites the first s)
    res = model(prompt, torch.arange(s, device=dev), last_only=True, greedy=greedy)[:, -1]   # [B] or [B, V]
    out = [prompt]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    for i in range(max_new_tokens):
        # a greedy step's token is the step's own output, which the next replay (of inductor's CUDA graphs or of
        # decode_graph's) overwrites: keep a copy
        nxt = res.clone() if greedy else _sample(res, temperature, top_k, generator)        # [B]
        out.append(nxt[:, None])
        if eos_token_id is not None:
            done |= nxt == eos_token_id
            if bool(done.all()):
                break
        if i + 1 == max_new_tokens:
            break
        if graph is None:
            res = model.decode_step(nxt[:, None], torch.tensor([s + i], device=dev), greedy=greedy)
        elif greedy:
            if i == 0:   # from here on the graph feeds itself
                graph.idx.copy_(nxt[:, None])
                graph.pos.fill_(s)
            res = graph()[:, 0]
        else:
            res = graph(nxt[:, None], torch.tensor([s + i], device=dev))
    return torch.cat(out, dim=1)


def _graphs_here(model: Transformer) -> bool:
    """Whether generate replays model.decode_graph: a model compiled with scope="block", on a CUDA device."""
    return model.graph_decode and model.norm.is_cuda
