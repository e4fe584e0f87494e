"""GPTQ: error-compensating rounding of one linear's weight against the Hessian of its inputs.

Pure functions on tensors. For a linear y = x Wᵀ with W [N, K] and calibration inputs x [T, K], the layer
reconstruction loss of a quantized Q is  L(Q) = tr((W − Q) H (W − Q)ᵀ) / N  with  H = 2/T · xᵀx  [K, K].
GPTQ quantizes W column by column and spreads each column's rounding error over the not-yet-quantized columns
through the inverse Hessian (OBS update), in lazy blocks of ``block_size`` columns.

    H, n = accumulate_hessian(None, x1, 0); H, n = accumulate_hessian(H, x2, n)   # streaming, float32
    qw, stats = gptq_quantize(W, H, bits=4, group_size=64, symmetric=False, act_order="static")
    stats.loss <= stats.rtn_loss   # the property the tests check

Quantization parameters come from ``sdquant.quant.qtensor.compute_qparams`` and codes are fitted against the
*stored* fp16 scales, so the dequantized result is exactly what a package will hold.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from sdquant.errors import ConfigError, SdquantError
from sdquant.quant.qtensor import QuantizedWeight, check_shape, compute_qparams, effective_group_size

ACT_ORDERS = ("none", "static", "group")
# Rows of W are independent given H. Every operation that mixes rows inside one kernel call (the lazy block
# update's GEMM, the range-fit reductions) runs on fixed tiles of ROW_TILE rows, so a row's result does not
# depend on how many rows are solved together: data-parallel calibration hands each rank whole tiles and is
# bitwise equal to one process.
ROW_TILE = 1024
# Hessians at least this large wait in host memory during the solve (2 K² on the device at the Cholesky instead
# of 3 K²). The round trip through pageable host memory cost ~2.4 s per 70B block on the H200 (3.3 GB down_proj
# Hessian) while that solve was not the block's peak, so it starts above the 70B size (K ≥ ~32k, e.g. 405B).
HOST_HESSIAN_BYTES = 4 << 30
# Below that, a Hessian of at least this size waits on the device as a bfloat16 copy (half the bytes) for the
# final losses while the factorisation and the sweep run (70B down_proj: 3.3 GB fp32 -> 1.6 GB). The losses are
# a report (the per-layer table); the solve itself always uses the fp32 Hessian.
LOSS_HESSIAN_HALF_BYTES = 1 << 30
_log = logging.getLogger("sdquant.calibrate.gptq")


class CholeskyError(SdquantError):
    """The damped Hessian stayed non positive-definite up to ``damp_max`` (never silently replaced by RTN)."""


@dataclass
class GptqStats:
    loss: float                 # tr(ΔW H ΔWᵀ)/N of the GPTQ result
    rtn_loss: float             # the same loss for plain round-to-nearest with the same quantizer
    damp: float                 # damping fraction finally used (of the mean Hessian diagonal)
    escalations: int = 0        # how many times damping was raised because Cholesky failed
    dead_columns: int = 0       # input channels that never saw a non-zero activation
    damp_history: list = field(default_factory=list)


def accumulate_hessian(H: Optional[torch.Tensor], x: torch.Tensor, n_seen: int):
    """Fold a batch of inputs x [..., K] into the running mean Hessian H = 2/T Σ xᵀx (float32).

    Returns (H [K, K] float32, n_seen + number of rows of x). H=None starts a new accumulator. The running
    mean (rather than a sum) keeps the magnitude independent of the number of calibration tokens.
    """
    x = x.reshape(-1, x.shape[-1])  # [T, K]
    t, k = x.shape
    if H is None:
        H = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    if t == 0:
        return H, n_seen
    total = n_seen + t
    H.mul_(n_seen / total)
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        # half inputs, fp32 accumulation and output on the tensor cores (products of half values are exact
        # in fp32); avoids a [T, K] fp32 copy and fp32 SIMT matmuls
        try:
            # the fp32 product is a temporary as large as H: for a large K it is made in column blocks
            step = k if k * k * 4 < (1 << 30) else 4096
            for c0 in range(0, k, step):
                H[:, c0:c0 + step].add_(torch.mm(x.t(), x[:, c0:c0 + step], out_dtype=torch.float32),
                                        alpha=2.0 / total)
            return H, total
        except (RuntimeError, TypeError):
            pass
    x = x.float() * math.sqrt(2.0 / total)
    H.addmm_(x.t(), x)
    return H, total


def layer_loss(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor, perm: Optional[torch.Tensor] = None) -> float:
    """tr((W − Q) H (W − Q)ᵀ) / N: the expected squared output error per output row. ``perm``: H is in this
    column order (the columns of W − Q are permuted to match). Rows go in ROW_TILE chunks, so the
    temporaries stay small next to a 57k-row fused weight."""
    tot = 0.0
    for r0 in range(0, W.shape[0], ROW_TILE):
        d = W[r0:r0 + ROW_TILE].float() - Q[r0:r0 + ROW_TILE].float()
        if perm is not None:
            d = d[:, perm]
        tot += float(((d @ H) * d).sum())
    return tot / W.shape[0]


def rtn_dequant(W: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                clip_ratio: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Round-to-nearest W [N, K] with the canonical quantizer; returns the dequantized float32 weight."""
    n, k = W.shape
    gs = effective_group_size(k, group_size)
    scale, zero = compute_qparams(W, bits, group_size, symmetric, 1.0 if clip_ratio is None else clip_ratio)
    s = scale.float().repeat_interleave(gs, 1)
    z = (torch.full_like(s, float(1 << (bits - 1))) if zero is None else zero.float().repeat_interleave(gs, 1))
    q = torch.clamp(torch.round(W.float() / s) + z, 0, (1 << bits) - 1)
    return (q - z) * s


def mse_clip_ratio(w: torch.Tensor, bits: int, symmetric: bool, grid: int = 10, max_shrink: float = 0.5,
                   norm: float = 2.4, row_chunk: Optional[int] = None) -> torch.Tensor:
    """Per-row range shrink for one group w [N, gs] minimising Σ|w − Q(w)|^norm over a grid of ratios
    (1, 1 − max_shrink/grid, …). At low bits a full min/max range wastes levels on one outlier.

    row_chunk: evaluate in chunks of this many rows. The error sums are reductions whose order a kernel may
    pick by the number of rows, so fixed-size chunks make each row's result independent of which other rows
    share the call (data-parallel calibration splits rows across ranks and must match one process)."""
    if row_chunk is not None and w.shape[0] > row_chunk:
        return torch.cat([mse_clip_ratio(w[r0:r0 + row_chunk], bits, symmetric, grid, max_shrink, norm)
                          for r0 in range(0, w.shape[0], row_chunk)], 0)
    n = w.shape[0]
    best = torch.ones(n, 1, device=w.device)
    best_err = torch.full((n,), float("inf"), device=w.device)
    for i in range(grid + 1):
        r = 1.0 - max_shrink * i / grid
        ratio = torch.full((n, 1), r, device=w.device)
        err = (rtn_dequant(w, bits, -1, symmetric, ratio) - w).abs().pow(norm).sum(1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best[better] = r
    return best


def _damped_inverse_cholesky(box: list, damp: float, damp_max: float, log: logging.Logger, name: str,
                             rebuild=None):
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp · mean(diag H), H = box[0]; raise damp ×10 (capped
    at damp_max) each time a factorisation fails, logging every escalation. H's diagonal is damped in place
    and restored (a 28672² Hessian is 3.3 GB: no extra copies). With ``rebuild`` (a callable returning H
    again), H is dropped from the device (box[0] = None) as soon as its factor exists, so the peak is two
    K² matrices instead of three; it is rebuilt only if damping has to escalate after that point."""
    H = box[0]
    mean_diag = float(H.diagonal().mean())
    cur, escalations, history = damp, 0, []
    while True:
        history.append(cur)
        if H is None:
            H = box[0] = rebuild()
        lam = cur * mean_diag
        diag = H.diagonal()
        diag.add_(lam)
        L, info = torch.linalg.cholesky_ex(H)
        diag.sub_(lam)
        del diag
        if int(info) == 0:
            if rebuild is not None:
                H = box[0] = None
            Hinv = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            del Hinv
            if int(info) == 0 and bool(torch.isfinite(U).all()):
                return U, cur, escalations, history
        if cur >= damp_max:
            raise CholeskyError(f"{name or 'layer'}: Hessian not positive definite even with damp={cur:g} "
                                f"(damp_max={damp_max:g}); raise quant.damp_max or check the calibration data")
        nxt = min(cur * 10.0, damp_max)
        escalations += 1
        log.warning("%s: Cholesky failed at damp=%g, escalating to damp=%g (escalation %d)",
                    name or "layer", cur, nxt, escalations)
        cur = nxt


def _sweep_column(j, WbT, ST, ZT, Ub, invd, QT, ET, maxq):
    """Quantize column j of the block (row j of the transposed block) and push its error onto the later
    columns of the block: ~10 kernels, no host synchronisation."""
    w = WbT[j]
    q = (w / ST[j]).round_().add_(ZT[j]).clamp_(0, maxq)
    QT[j] = q
    err = torch.addcmul(w, q.sub_(ZT[j]), ST[j], value=-1.0).mul_(invd[j])   # (w − dq) / U[j, j]
    if j + 1 < WbT.shape[0]:
        WbT[j + 1:].addr_(Ub[j, j + 1:], err, alpha=-1.0)
    ET[j] = err


def _sweep_block(WbT, ST, ZT, Ub, QT, ET, maxq):
    invd = 1.0 / torch.diagonal(Ub)
    for j in range(WbT.shape[0]):
        _sweep_column(j, WbT, ST, ZT, Ub, invd, QT, ET, maxq)


class _Sweeps:
    """Fully fitted block sweeps, eager or as CUDA graphs captured once per (B, N) shape. A block sweep is
    B×~10 tiny kernels whose cost is launch overhead; a graph replays them with one launch."""

    def __init__(self, enabled: bool, log: logging.Logger):
        self.enabled, self.log, self.graphs = enabled, log, {}

    def run(self, WbT, ST, ZT, Ub, maxq):
        QT, ET = torch.empty_like(WbT), torch.empty_like(WbT)
        if not self.enabled:
            _sweep_block(WbT, ST, ZT, Ub, QT, ET, maxq)
            return WbT, QT, ET
        key = (tuple(WbT.shape), maxq)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(WbT, ST, ZT, Ub, maxq)
            if g is None:
                self.enabled = False
                _sweep_block(WbT, ST, ZT, Ub, QT, ET, maxq)
                return WbT, QT, ET
            # first use: the replay must match the eager sweep bit for bit
            ref = [t.clone() for t in (WbT, ST, ZT, Ub)]
            rq, re = torch.empty_like(WbT), torch.empty_like(WbT)
            _sweep_block(ref[0], ref[1], ref[2], ref[3], rq, re, maxq)
            out = self._replay(g, WbT, ST, ZT, Ub)
            if not (torch.equal(out[1], rq) and torch.equal(out[2], re)):
                self.log.warning("GPTQ CUDA-graph sweep differs from eager; using eager sweeps")
                self.enabled = False
                return ref[0], rq, re
            return tuple(t.clone() for t in out)
        return tuple(t.clone() for t in self._replay(g, WbT, ST, ZT, Ub))

    @staticmethod
    def _replay(g, WbT, ST, ZT, Ub):
        buf = g["buf"]
        for name, t in (("WbT", WbT), ("ST", ST), ("ZT", ZT), ("Ub", Ub)):
            buf[name].copy_(t)
        g["graph"].replay()
        return buf["WbT"], buf["QT"], buf["ET"]

    def _capture(self, WbT, ST, ZT, Ub, maxq):
        try:
            buf = {"WbT": WbT.clone(), "ST": ST.clone(), "ZT": ZT.clone(), "Ub": Ub.clone(),
                   "QT": torch.empty_like(WbT), "ET": torch.empty_like(WbT)}
            args = (buf["WbT"], buf["ST"], buf["ZT"], buf["Ub"], buf["QT"], buf["ET"], maxq)
            side = torch.cuda.Stream(device=WbT.device)
            side.wait_stream(torch.cuda.current_stream(WbT.device))
            with torch.cuda.stream(side):                      # warm-up outside the capture
                _sweep_block(*args)
            torch.cuda.current_stream(WbT.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _sweep_block(*args)
            return {"graph": graph, "buf": buf}
        except Exception as e:  # noqa: BLE001 - any capture problem means: run eagerly
            self.log.warning("GPTQ CUDA-graph capture failed (%s); using eager sweeps", e)
            return None


def gptq_quantize(W: torch.Tensor, H, bits: int = 4, group_size: int = 128,
                  symmetric: bool = False, act_order: str = "none", damp: float = 0.01,
                  block_size: int = 128, damp_max: float = 1.0, clip_ratio: Optional[torch.Tensor] = None,
                  mse_grid: int = 0, name: str = "", log: Optional[logging.Logger] = None,
                  overwrite_h: bool = False, use_graphs: bool = True):
    """Quantize W [N, K] against H [K, K] (float32). Returns (QuantizedWeight, GptqStats).

    act_order: "none" — columns in natural order, group parameters fitted when GPTQ reaches a group (on the
    already error-updated weights). "static" — columns processed in decreasing diag(H) order, but groups stay
    contiguous (no g_idx); their parameters are fitted up front on the original weights. "group" — columns in
    decreasing diag(H) order and groups formed in that order (needs g_idx; parameters fitted when reached).
    clip_ratio [N, G] (optional): range shrink per group from a clipping search, applied when parameters are
    fitted. use_graphs: on CUDA, replay fully fitted column sweeps as captured CUDA graphs (checked
    bit-for-bit against the eager sweep on first use; any mismatch or capture failure falls back, logged).
    overwrite_h: H may be modified and released (saves a K² copy for large layers). To really release it, hand
    it over as a one-element list ``[H]``: the function takes it out, so no caller frame keeps the K² matrix
    alive during the solve (a plain tensor argument stays referenced by the caller). mse_grid > 0 (instead of clip_ratio): each group's range is shrunk per row to minimise its own
    weight error when it is fitted (helps at 2-3 bits). Raises CholeskyError when even damp_max cannot make H positive-definite.
    """
    log = log or _log
    if isinstance(H, list):                                      # handed over: hold the only reference here
        H = H.pop()
    if act_order not in ACT_ORDERS:
        raise ConfigError("quant.act_order", f"must be one of {ACT_ORDERS}, got {act_order!r}")
    n, k = W.shape
    check_shape(name or "gptq", k, bits, group_size)
    if tuple(H.shape) != (k, k):
        raise SdquantError(f"{name or 'gptq'}: Hessian shape {list(H.shape)} does not match in_features {k}")
    gs = effective_group_size(k, group_size)
    ngroups = k // gs
    maxq = (1 << bits) - 1
    dev = W.device
    W0 = W.detach().float()
    Wf = W0.clone()
    H = H.detach().float()
    if not overwrite_h:
        H = H.clone()

    # an input channel that never fired carries no information: pin its weight to zero, keep H invertible
    dead = torch.diag(H) == 0
    n_dead = int(dead.sum())
    if n_dead:
        H[dead, dead] = 1.0
        Wf[:, dead] = 0.0

    if act_order == "none":
        perm = torch.arange(k, device=dev)
    else:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    invperm = torch.argsort(perm)
    # group of each column in processing order
    if act_order == "group":
        gpos = torch.arange(k, device=dev) // gs                 # groups formed along the permuted order
    else:
        gpos = perm // gs                                        # contiguous groups of the original order

    cr = None if clip_ratio is None else clip_ratio.to(dev).float().reshape(n, ngroups)
    scales = torch.empty(n, ngroups, dtype=torch.float16, device=dev)
    zeros = None if symmetric else torch.empty(n, ngroups, dtype=torch.uint8, device=dev)
    fitted = torch.zeros(ngroups, dtype=torch.bool)
    if act_order == "static":
        # fitted once on the original weights so the contiguous groups need no g_idx
        if cr is None and mse_grid > 0:
            # all groups at once: [N·G, gs] rows
            cr = mse_clip_ratio(Wf.reshape(n * ngroups, gs), bits, symmetric, mse_grid,
                                row_chunk=ROW_TILE * ngroups).reshape(n, ngroups)
        s_all, z_all = compute_qparams(Wf, bits, group_size, symmetric, 1.0 if cr is None else cr)
        scales.copy_(s_all)
        if zeros is not None:
            zeros.copy_(z_all)
        fitted[:] = True

    Wp = Wf[:, perm].contiguous()                                # [N, K] in processing order
    del Wf
    if act_order == "none":
        Hp = H
    else:                                                        # two steps: one K² temporary, not two
        Hp = H.index_select(0, perm)
        del H
        Hp = Hp.index_select(1, perm)
    H = None                                                     # losses are computed in processing order
    # a large Hessian waits in host memory while the factorisation and the sweep run (70B down_proj: 3.3 GB
    # of the device peak); it comes back for the final losses and for a damping escalation
    H_host = Hp.to("cpu") if Hp.is_cuda and Hp.numel() * 4 >= HOST_HESSIAN_BYTES else None
    H_half = None
    rebuild = None
    if H_host is not None:
        rebuild = lambda: H_host.to(dev)                         # noqa: E731
    elif Hp.numel() * 4 >= LOSS_HESSIAN_HALF_BYTES:
        H_half = Hp.to(torch.bfloat16)

        def rebuild():                                           # only if damping escalates after the factor
            log.warning("%s: damping escalated after the fp32 Hessian was released; re-factorising from its "
                        "bfloat16 copy", name or "layer")
            return H_half.float()
    box = [Hp]
    del Hp
    U, used_damp, escalations, history = _damped_inverse_cholesky(box, damp, damp_max, log, name, rebuild=rebuild)
    Hp = box.pop()
    codes_p = torch.empty(n, k, dtype=torch.uint8, device=dev)
    gpos_cpu = gpos.cpu()

    # Column sweep. Rows of the transposed block are the columns being quantized (contiguous vectors), and
    # every column costs ~10 small kernels: on a GPU the sweep is bound by launch overhead, not arithmetic.
    zero_sym = float(1 << (bits - 1))
    sweeps = _Sweeps(use_graphs and W.is_cuda, log)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        B = b1 - b0
        WbT = Wp[:, b0:b1].t().contiguous()                     # [B, N]
        QT = torch.empty_like(WbT)                               # codes (as floats) of this block
        ET = torch.empty_like(WbT)                               # scaled errors, for the lazy update
        Ub = U[b0:b1, b0:b1]
        invd = 1.0 / torch.diagonal(Ub)                          # [B]
        gb = gpos[b0:b1]
        ST = scales[:, gb].float().t().contiguous()              # [B, N] scale of each column
        ZT = (zeros[:, gb].float().t().contiguous() if zeros is not None
              else torch.full_like(ST, zero_sym))
        if bool(fitted[gpos_cpu[b0:b1]].all()):
            # every group of this block is fitted (static act-order, or a later block of a group): no
            # data-dependent Python in the sweep, so on CUDA it can be one captured graph
            WbT, QT, ET = sweeps.run(WbT, ST, ZT, Ub, maxq)
        else:
            for j in range(B):
                g = int(gpos_cpu[b0 + j])
                if not fitted[g]:
                    # fit this group's parameters on the current (error-updated) weights of its columns
                    # (only reached for "none"/"group": a group is the next gs columns in processing order)
                    src = torch.cat([WbT[j:].t(), Wp[:, b1:]], 1)[:, :gs]
                    ratio = cr[:, g:g + 1] if cr is not None else (
                        mse_clip_ratio(src, bits, symmetric, mse_grid, row_chunk=ROW_TILE)
                        if mse_grid > 0 else 1.0)
                    s_g, z_g = compute_qparams(src, bits, -1, symmetric, ratio)
                    scales[:, g] = s_g[:, 0]
                    ST[j:j + gs] = s_g[:, 0].float()
                    if zeros is not None:
                        zeros[:, g] = z_g[:, 0]
                        ZT[j:j + gs] = z_g[:, 0].float()
                    fitted[g] = True
                _sweep_column(j, WbT, ST, ZT, Ub, invd, QT, ET, maxq)
        codes_p[:, b0:b1] = QT.t().to(torch.uint8)
        # lazy update of all later columns with this block's accumulated errors
        if b1 < k:
            Ub1 = U[b0:b1, b1:]
            for r0 in range(0, n, ROW_TILE):                    # fixed row tiles: see ROW_TILE
                r1 = min(r0 + ROW_TILE, n)
                Wp[r0:r1, b1:].addmm_(ET[:, r0:r1].t().contiguous(), Ub1, alpha=-1.0)

    del Wp
    codes = codes_p[:, invperm]
    del codes_p
    g_idx = None
    if act_order == "group":
        g_idx = torch.empty(k, dtype=torch.int32, device=dev)
        g_idx[perm] = (torch.arange(k, device=dev) // gs).to(torch.int32)
    qw = QuantizedWeight.from_codes(codes, scales, zeros, bits, group_size, g_idx)
    del U
    if Hp is None:
        Hp = H_host.to(dev) if H_host is not None else H_half.float()
    H_half = None
    deq = qw.dequantize(torch.float32)
    loss = rtn_loss = 0.0
    for r0 in range(0, n, ROW_TILE):                            # row chunks: small temporaries
        w = W0[r0:r0 + ROW_TILE]
        loss += layer_loss(w, deq[r0:r0 + ROW_TILE], Hp, perm) * w.shape[0] / n
        rtn_loss += layer_loss(w, rtn_dequant(w, bits, group_size, symmetric), Hp, perm) * w.shape[0] / n
    del deq
    stats = GptqStats(loss=loss, rtn_loss=rtn_loss, damp=used_damp, escalations=escalations,
                      dead_columns=n_dead, damp_history=history)
    return qw, stats
