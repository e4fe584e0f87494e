"""AWQ: activation-aware per-input-channel scaling, searched with the final quantizer inside the loss.

Pure functions on tensors. A scaling group is a set of linears that read the same input x [T, K] (e.g. q/k/v
after the input norm). For a scale s [K] > 0 the group computes  x Wᵀ = (x / s)(W · s)ᵀ  exactly; quantizing
W · s instead of W protects the channels with large activations. The search tries

    s(α) = x̄^α / w̄^(1−α)   (duo scaling; plain AWQ uses x̄^α),  α ∈ {0, 1/grid, …, (grid−1)/grid}

and the unscaled s = 1, and keeps the scale whose *quantized* group output is closest (MSE) to full precision.
``loss_fn`` receives the candidate effective weights Q(W · s) / s (one per linear) and returns that MSE, so
the caller decides what module output is the target (the attention block, the MLP, the linear itself).

Per-channel activation scaling (``refine_channel_ratio``): a per-channel multiplier r on the searched scale,
s' = s · r, r initialised at ``init_ratio`` and kept inside ``ratio_range``, optimised on the same loss with a
few straight-through (STE) gradient steps or a bucketed coordinate search. It is accepted only if it lowers
the loss, so the refined loss is never above the plain AWQ loss.

Clipping (``clip_search``): per (output row, group) shrink of the quantization range that minimises the
group's output error on sampled inputs.

Folding (``fold_into_norm`` / ``fold_into_linear`` / ``scale_linear_inputs``): in-place tensor updates that
move 1/s into the op that produces x, so the exported model needs no extra multiply.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from sdquant.calibrate.gptq import rtn_dequant
from sdquant.errors import ConfigError
from sdquant.quant.qtensor import effective_group_size

LossFn = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass
class AwqSearchResult:
    scales: torch.Tensor        # [K] float32, the chosen per-input-channel scale (x is divided by it)
    alpha: float                # chosen grid point (-1.0 = unscaled was best)
    loss: float                 # group loss with the chosen scale
    loss_unscaled: float        # group loss with s = 1 (plain RTN)
    ratio_loss: Optional[float] = None   # loss after per-channel ratio refinement (None = not run)


# ------------------------------------------------------------------------------------------ statistics
def channel_absmean(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> mean |x| per channel [K] (float32)."""
    return x.reshape(-1, x.shape[-1]).float().abs().mean(0)


def weight_absmean(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |W| normalised by its group's absmax, for the stacked weights [ΣN, K] -> [K].
    The normalisation makes the statistic reflect a channel's size *relative to its quantization group*."""
    w = torch.cat([t.detach().float() for t in weights], 0)
    n, k = w.shape
    gs = effective_group_size(k, group_size)
    wg = w.abs().reshape(n, k // gs, gs)
    wg = wg / wg.amax(-1, keepdim=True).clamp(min=1e-8)
    return wg.reshape(n, k).mean(0)


def scale_candidate(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float, duo_scaling: bool) -> torch.Tensor:
    """s(α) normalised so that sqrt(max·min) = 1 (keeps the folded norm/linear in a sane range)."""
    xm = x_mean.float().clamp(min=1e-4)
    if duo_scaling:
        s = xm.pow(alpha) / w_mean.float().clamp(min=1e-4).pow(1.0 - alpha)
    else:
        s = xm.pow(alpha)
    s = s.clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s)).clamp(min=1e-4, max=1e4)


# ------------------------------------------------------------------------------------------ quantizers
def scaled_fake_quant(W: torch.Tensor, s: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                      clip_ratio: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Effective weight of a scaled-then-quantized linear in the *original* input coordinates:
    Q(W · s) / s, W [N, K], s [K]."""
    Ws = W.float() * s[None, :]
    return rtn_dequant(Ws, bits, group_size, symmetric, clip_ratio) / s[None, :]


def _ste_effective(w: torch.Tensor, s: torch.Tensor, bits: int, group_size: int, symmetric: bool):
    return ste_fake_quant(w * s[None, :], bits, group_size, symmetric) / s[None, :]


def _round_ste(v: torch.Tensor) -> torch.Tensor:
    return v + (torch.round(v) - v).detach()


def ste_fake_quant(W: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> torch.Tensor:
    """Differentiable min/max fake quantization (round with a straight-through gradient; the range, and so
    the step, stays differentiable — that is where the gradient with respect to a channel scale comes from)."""
    n, k = W.shape
    gs = effective_group_size(k, group_size)
    wg = W.reshape(n, k // gs, gs)
    maxq = (1 << bits) - 1
    if symmetric:
        step = (2 * wg.abs().amax(-1, keepdim=True) / maxq).clamp(min=1e-8)
        zero = float(1 << (bits - 1))
        q = torch.clamp(_round_ste(wg / step) + zero, 0, maxq)
        return ((q - zero) * step).reshape(n, k)
    wmax, wmin = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
    step = ((wmax - wmin) / maxq).clamp(min=1e-8)
    zero = torch.clamp(torch.round(-wmin / step), 0, maxq).detach()
    q = torch.clamp(_round_ste(wg / step) + zero, 0, maxq)
    return ((q - zero) * step).reshape(n, k)


# ---------------------------------------------------------------------------------------------- search
def awq_candidates(x_mean: torch.Tensor, weights: Sequence[torch.Tensor], group_size: int, grid: int = 20,
                   duo_scaling: bool = True) -> list:
    """The scales the grid search evaluates, in order: [(α, s [K])], first the unscaled (α = −1, s = 1),
    then α = 0, 1/grid, …. Each candidate's loss is independent of the others, so they can be evaluated
    anywhere (data-parallel calibration spreads them over ranks) and combined with ``awq_pick``."""
    if grid < 1:
        raise ConfigError("quant.awq.grid", f"must be >= 1, got {grid}")
    w_mean = weight_absmean(weights, group_size)
    out = [(-1.0, torch.ones_like(x_mean, dtype=torch.float32))]
    for i in range(grid):
        alpha = i / grid
        out.append((alpha, scale_candidate(x_mean, w_mean, alpha, duo_scaling)))
    return out


def candidate_loss(s: torch.Tensor, weights: Sequence[torch.Tensor], loss_fn: LossFn, bits: int,
                   group_size: int, symmetric: bool) -> float:
    with torch.no_grad():
        return float(loss_fn([scaled_fake_quant(w, s, bits, group_size, symmetric) for w in weights]))


def awq_pick(candidates: list, losses: Sequence[float]) -> AwqSearchResult:
    """The first candidate with the strictly lowest loss (the unscaled one unless a scale beats it)."""
    base = float(losses[0])
    best = (base, candidates[0][0], candidates[0][1])
    for (alpha, s), loss in zip(candidates[1:], losses[1:]):
        if loss < best[0]:
            best = (float(loss), alpha, s)
    return AwqSearchResult(scales=best[2], alpha=best[1], loss=best[0], loss_unscaled=base)


@torch.no_grad()
def awq_search_scales(x_mean: torch.Tensor, weights: Sequence[torch.Tensor], loss_fn: LossFn, bits: int,
                      group_size: int, symmetric: bool, grid: int = 20, duo_scaling: bool = True) -> AwqSearchResult:
    """Grid-search the per-input-channel scale of one scaling group (see the module docstring).

    x_mean [K]: mean |x| per input channel; weights: the group's weights [N_i, K]; loss_fn(effective weights)
    -> scalar MSE against full precision. The unscaled candidate is always evaluated, so the returned loss is
    never above plain RTN's.
    """
    cands = awq_candidates(x_mean, weights, group_size, grid, duo_scaling)
    losses = [candidate_loss(s, weights, loss_fn, bits, group_size, symmetric) for _, s in cands]
    return awq_pick(cands, losses)


def check_ratio_range(init_ratio: float, ratio_range, granularity: int, group_size: int, k: int) -> None:
    lo, hi = float(ratio_range[0]), float(ratio_range[1])
    if not (0.8 <= lo <= hi <= 1.2):
        raise ConfigError("quant.activation_scaling.ratio_range", f"must lie inside [0.8, 1.2], got [{lo}, {hi}]")
    if not lo <= init_ratio <= hi:
        raise ConfigError("quant.activation_scaling.init_ratio", f"{init_ratio} is outside ratio_range [{lo}, {hi}]")
    gs = effective_group_size(k, group_size)
    if granularity < 1 or gs % granularity or k % granularity:
        raise ConfigError("quant.activation_scaling.granularity",
                          f"{granularity} must divide group_size {group_size} (and in_features {k})")


def refine_channel_ratio(scales: torch.Tensor, x_mean: torch.Tensor, weights: Sequence[torch.Tensor],
                         loss_fn: LossFn, bits: int, group_size: int, symmetric: bool, base_loss: float,
                         init_ratio: float = 1.0, ratio_range=(0.8, 1.2), granularity: int = 1,
                         method: str = "ste", steps: int = 8, lr: float = 0.02, buckets: int = 8,
                         grad_context: Optional[Callable] = None):
    """Per-channel activation scaling: a multiplier r (one per ``granularity`` channels) on the AWQ scale.

    Returns (scales · r [K], loss, r [K]). ``method``: "ste" — Adam on r through a straight-through fake
    quantizer, r clamped to ratio_range after each step; "bucket" — channels are bucketed by activation size
    and one ratio per bucket is coordinate-searched over 5 values in the range. The result is kept only when
    its exact (non-STE) loss is below ``base_loss``; otherwise the plain scale comes back unchanged.
    ``grad_context``: a context-manager factory entered around each STE forward/backward only (e.g. a
    deterministic attention backend); exact evaluations run outside it, like the grid search's.
    """
    k = scales.numel()
    check_ratio_range(init_ratio, ratio_range, granularity, group_size, k)
    lo, hi = float(ratio_range[0]), float(ratio_range[1])
    ws = [w.detach().float() for w in weights]

    def exact(r_full):
        with torch.no_grad():
            s = scales * r_full
            return float(loss_fn([scaled_fake_quant(w, s, bits, group_size, symmetric) for w in ws]))

    best_r = torch.full_like(scales, float(init_ratio))
    best = exact(best_r) if init_ratio != 1.0 else base_loss
    if method == "ste":
        r = torch.full((k // granularity,), float(init_ratio), device=scales.device, requires_grad=True)
        opt = torch.optim.Adam([r], lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            r_full = r.repeat_interleave(granularity)
            s = scales * r_full
            # recompute each fake-quantized weight in the backward pass instead of keeping its ~6
            # weight-sized intermediates alive (70B MLP: 2 × 28672 × 8192 fp32 weights)
            if grad_context is not None and getattr(loss_fn, "parts", None):
                # one backward per sequence: the deterministic attention backend materialises the score
                # matrices, so the whole sample at once would hold tens of GB; gradients add up in order
                for part in loss_fn.parts:
                    with grad_context(), torch.enable_grad():
                        s = scales * r.repeat_interleave(granularity)     # a fresh graph per backward
                        eff = [checkpoint(_ste_effective, w, s, bits, group_size, symmetric, use_reentrant=False)
                               for w in ws]
                        (part(eff) / loss_fn.count).backward()
                        del eff
            else:
                with (grad_context() if grad_context is not None else contextlib.nullcontext()), \
                        torch.enable_grad():
                    eff = [checkpoint(_ste_effective, w, s, bits, group_size, symmetric, use_reentrant=False)
                           for w in ws]
                    loss = loss_fn(eff)
                    del eff
                    loss.backward()
            opt.step()
            with torch.no_grad():
                r.clamp_(lo, hi)
        # one exact (round-to-nearest, fp16 scales) evaluation of the final multiplier decides acceptance
        cand = r.detach().repeat_interleave(granularity)
        l_exact = exact(cand)
        if l_exact < best:
            best, best_r = l_exact, cand.clone()
    elif method == "bucket":
        # buckets by activation magnitude: channels with similar x̄ share one multiplier
        order = torch.argsort(x_mean.float().reshape(-1, granularity).mean(1))
        nb = min(buckets, order.numel())
        cur = best_r.reshape(-1, granularity)[:, 0].clone()
        values = torch.linspace(lo, hi, 5).tolist()
        for b in range(nb):
            idx = order[b * order.numel() // nb:(b + 1) * order.numel() // nb]
            for v in values:
                trial = cur.clone()
                trial[idx] = v
                l_t = exact(trial.repeat_interleave(granularity))
                if l_t < best:
                    best, cur = l_t, trial
        best_r = cur.repeat_interleave(granularity)
    else:
        raise ConfigError("quant.activation_scaling.method", f"must be 'ste' or 'bucket', got {method!r}")
    return scales * best_r, best, best_r


@torch.no_grad()
def clip_search(W: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                grid: int = 20, max_shrink: float = 0.5, max_tokens: int = 512,
                row_chunk: Optional[int] = None) -> torch.Tensor:
    """Per (row, group) range shrink r ∈ {1, 1 − max_shrink/grid, …} minimising Σ_t (Q_r(W_g) x_g − W_g x_g)²
    on sampled inputs x [T, K]. Returns the clip ratios [N, G] (float32) for compute_qparams."""
    n, k = W.shape
    gs = effective_group_size(k, group_size)
    g = k // gs
    x = x.reshape(-1, k).float()
    if x.shape[0] > max_tokens:
        idx = torch.linspace(0, x.shape[0] - 1, max_tokens, device=x.device).long()
        x = x[idx]
    xg = x.reshape(-1, g, gs)                                   # [T, G, gs]
    if row_chunk is None:                                       # bound the [rows, G, T] products to ~32M floats
        row_chunk = max(1, (32 << 20) // max(1, g * xg.shape[0]))
    ratios = [1.0 - max_shrink * i / grid for i in range(int(grid * 1.0) + 1) if 1.0 - max_shrink * i / grid > 0]
    out = torch.ones(n, g, device=W.device)
    for r0 in range(0, n, row_chunk):
        w = W[r0:r0 + row_chunk].float()                        # [n, K]
        wg = w.reshape(-1, g, gs)
        ref = torch.einsum("ngk,tgk->ngt", wg, xg)              # [n, G, T]
        best_err = torch.full(ref.shape[:2], float("inf"), device=W.device)
        best_r = torch.ones(ref.shape[:2], device=W.device)
        for r in ratios:
            wq = rtn_dequant(w, bits, group_size, symmetric, torch.full((w.shape[0], g), r, device=W.device))
            err = (torch.einsum("ngk,tgk->ngt", wq.reshape(-1, g, gs), xg) - ref).pow(2).mean(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_r = torch.where(better, torch.full_like(best_r, r), best_r)
        out[r0:r0 + row_chunk] = best_r
    return out


# ----------------------------------------------------------------------------------------------- folding
@torch.no_grad()
def fold_into_norm(weight: torch.Tensor, bias: Optional[torch.Tensor], s: torch.Tensor) -> None:
    """The norm's output becomes x / s: divide its affine weight (and bias) in place. weight/bias [K]."""
    weight.div_(s.to(weight.dtype))
    if bias is not None:
        bias.div_(s.to(bias.dtype))


@torch.no_grad()
def fold_into_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], s: torch.Tensor) -> None:
    """A producing linear's output rows become y / s: weight [K_out, K_in] rows and bias [K_out] in place."""
    weight.div_(s.to(weight.dtype)[:, None])
    if bias is not None:
        bias.div_(s.to(bias.dtype))


@torch.no_grad()
def scale_linear_inputs(weight: torch.Tensor, s: torch.Tensor) -> None:
    """A consuming linear sees x / s, so its columns are multiplied by s: weight [N, K] in place."""
    weight.mul_(s.to(weight.dtype)[None, :])
