"""Per-block recipes: what the block walker calls once per transformer block.

    result = quantize_block(ctx)          # ctx: see sdquant.calibrate.pipeline (block, inputs, groups, run, ...)

Recipes own the order of operations inside a block; the math lives in awq.py / gptq.py / joint.py / fp8.py.
For ``awq+gptq`` (the product's default):

    1. one full-precision pass: mean |x| per scaling group, a token-capped sample of every group's inspect
       input (for the AWQ loss), and the Hessian of every linear input (shared by linears that read the same x)
    2. per scaling group: AWQ grid search with the final quantizer in the loss, optional per-channel ratio
       refinement, fold s into the previous norm/linear (or keep it as an explicit ``smooth`` divisor)
    3. GPTQ stage by stage in execution order: the first stage uses the pass-1 Hessian moved into the scaled
       coordinates (H' = diag(1/s) H diag(1/s), exact); with ``true_sequential`` every later stage
       re-captures its Hessian from the block whose earlier stages are already quantized (and whose scales are
       folded, so it is in scaled coordinates by construction).
    4. every target linear's ``.weight`` is left holding its dequantized quantized weight, so the walker's
       run of the block produces the next block's inputs from the quantized model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from sdquant.calibrate import awq as awq_math
from sdquant.calibrate import fp8 as fp8_math
from sdquant.calibrate._util import cfg
from sdquant.calibrate.awq_search import AwqJob as _AwqJob
from sdquant.calibrate.awq_search import awq_waves as _awq_waves
from sdquant.calibrate.awq_search import search_wave as _awq_search_wave
from sdquant.calibrate.distributed import SINGLE, gptq_quantize_dp, lpt_assign
from sdquant.calibrate.gptq import accumulate_hessian, layer_loss, rtn_dequant
from sdquant.calibrate.joint import scale_hessian
from sdquant.errors import ConfigError
from sdquant.quant.qtensor import (Fp8Weight, QuantizedWeight, compute_qparams, quantize_codes)

INT_METHODS = ("rtn", "awq", "gptq", "awq+gptq")
AWQ_METHODS = ("awq", "awq+gptq")
GPTQ_METHODS = ("gptq", "awq+gptq")


@dataclass
class BlockResult:
    weights: dict = field(default_factory=dict)   # full name -> QuantizedWeight | Fp8Weight
    smooth: dict = field(default_factory=dict)    # full name -> [K] divisor applied to x before the GEMM
    rows: list = field(default_factory=list)      # per-layer table rows
    scales: dict = field(default_factory=dict)    # plain data: {"awq": [...], "fp8_smooth": [...]} for replay


# --------------------------------------------------------------------------------------------- helpers
def _spec(ctx, name):
    q = ctx.qcfg
    if hasattr(ctx, "spec"):
        return ctx.spec(name)
    return type("LayerSpec", (), dict(method=q.method, bits=q.bits, group_size=q.group_size,
                                      symmetric=q.symmetric))()


def _first_tensor(args, kwargs):
    if args and torch.is_tensor(args[0]):
        return args[0]
    for key in ("hidden_states", "x", "input"):
        if torch.is_tensor(kwargs.get(key)):
            return kwargs[key]
    raise ConfigError("model.adapter", "inspect module has no tensor input to sample")


@torch.no_grad()
def _stream(ctx, hooks: dict) -> None:
    """ctx.run for statistics only: the block's outputs are dropped batch by batch instead of being
    collected (for a 70B block, 128 × 2048 outputs are 4 GiB we never read)."""
    block, inputs = getattr(ctx, "block", None), getattr(ctx, "inputs", None)
    dist = getattr(ctx, "dist", None)
    if block is None or inputs is None or (dist is not None and dist.active):
        # data parallel: ctx.run replays every rank's hook calls in global batch order
        ctx.run(hooks)
        return
    handles = [m.register_forward_hook(fn, with_kwargs=True) for m, fn in hooks.items()]
    try:
        for a, k in inputs:
            block(*a, **k)
    finally:
        for h in handles:
            h.remove()


def _set_weight(lin: nn.Linear, w: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_(w.to(lin.weight.dtype))


def _split_rows(qw: QuantizedWeight, sizes: list) -> list:
    """Split a row-concatenated QuantizedWeight back into one per linear (g_idx is shared)."""
    out, r0 = [], 0
    for n in sizes:
        sl = slice(r0, r0 + n)
        out.append(QuantizedWeight(qw.qweight[sl].contiguous(), qw.scales[sl].contiguous(),
                                   None if qw.zeros is None else qw.zeros[sl].contiguous(), qw.bits,
                                   qw.group_size, qw.in_features, qw.g_idx))
        r0 += n
    return out


def _qweight_from_dequant_rtn(W: torch.Tensor, bits, group_size, symmetric, clip_ratio=None) -> QuantizedWeight:
    scales, zeros = compute_qparams(W, bits, group_size, symmetric, 1.0 if clip_ratio is None else clip_ratio)
    codes = quantize_codes(W, scales, zeros, bits, group_size)
    return QuantizedWeight.from_codes(codes, scales, zeros, bits, group_size)


class _Sampler:
    """Token-capped sample of a module's calls (whole calls: attention needs whole sequences) or rows."""

    def __init__(self, max_tokens: int, rows: bool):
        self.max_tokens, self.rows, self.calls, self.tokens = max_tokens, rows, [], 0

    def add(self, args, kwargs):
        if self.tokens >= self.max_tokens:
            return
        x = _first_tensor(args, kwargs)
        t = x.numel() // x.shape[-1]
        if self.rows:
            x2 = x.reshape(-1, x.shape[-1])
            take = min(t, self.max_tokens - self.tokens)
            idx = torch.linspace(0, t - 1, take, device=x.device).long()
            self.calls.append(((x2[idx].detach(),), {}))
            self.tokens += take
        else:
            self.calls.append((args, kwargs))
            self.tokens += t


def _fold(g, lins, s: torch.Tensor) -> None:
    """Consumers' columns × s, producer's output ÷ s. The adapter's ScalingGroup.fold knows the producer's
    parameterisation (plain norm weight, Gemma's 1 + w, a linear's rows); without it, fold by module type."""
    if hasattr(g, "fold"):
        g.fold(s)
        return
    for l in lins:
        awq_math.scale_linear_inputs(l.weight.data, s.to(l.weight.device))
    b = getattr(g.prev, "bias", None)
    b = b.data if torch.is_tensor(b) else None
    if isinstance(g.prev, nn.Linear):
        awq_math.fold_into_linear(g.prev.weight.data, b, s.to(g.prev.weight.device))
    else:
        awq_math.fold_into_norm(g.prev.weight.data, b, s.to(g.prev.weight.device))


# --------------------------------------------------------------------------------------------- recipes
def quantize_block(ctx) -> BlockResult:
    """Quantize every target linear of ctx.block according to its LayerSpec; see the module docstring."""
    specs = {name: _spec(ctx, name) for name in ctx.targets}
    methods = {s.method for s in specs.values()}
    res = BlockResult()
    fp8_names = [n for n, s in specs.items() if s.method == "fp8"]
    int_names = [n for n, s in specs.items() if s.method in INT_METHODS]
    unknown = [n for n, s in specs.items() if s.method not in INT_METHODS + ("fp8",)]
    if unknown:
        raise ConfigError("quant.method", f"{unknown[0]}: unknown method {specs[unknown[0]].method!r}")
    if fp8_names:
        _fp8_block(ctx, fp8_names, res)
    if int_names:
        _int_block(ctx, {n: specs[n] for n in int_names}, res)
    del methods
    return res


# ---------------------------------------------------------------------------------------- integer path
def _int_block(ctx, specs: dict, res: BlockResult) -> None:
    q = ctx.qcfg
    log = ctx.log
    targets = {n: ctx.targets[n] for n in specs}
    max_tokens = int(cfg(q, "awq.max_tokens", 8192))
    true_seq = bool(cfg(q, "true_sequential", True))
    clip_on = bool(cfg(q, "awq.clip_search", True))
    dtype = next(ctx.block.parameters()).dtype

    # scaling groups whose linears are all AWQ targets; input keys: linears that read the same x share a Hessian
    groups = []
    key_of: dict[str, str] = {}
    for gi, g in enumerate(ctx.groups):
        names = [n for n, _ in g.linears if n in targets]
        if not names:
            continue
        awq_on = all(specs[n].method in AWQ_METHODS for n, _ in g.linears if n in targets) and \
            len(names) == len(g.linears)
        groups.append((gi, g, names, awq_on))
        for n in names:
            key_of[n] = f"group{gi}"
    for n in targets:
        key_of.setdefault(n, n)
    key_first = {}
    for n in targets:
        key_first.setdefault(key_of[n], targets[n])
    gptq_keys = {key_of[n] for n in targets if specs[n].method in GPTQ_METHODS}
    awq_groups = [t for t in groups if t[3]]

    # ---- pass 1: full precision statistics
    order: list[str] = []
    first_key: list = []
    H: dict[str, Any] = {}
    xsum: dict[str, Any] = {}
    samplers: dict[int, _Sampler] = {}
    xsample: dict[int, _Sampler] = {}
    hooks = {}

    def order_hook(name):
        def h(mod, args, kwargs, out):
            if name not in order:
                order.append(name)
        return h

    def lin_hook(name):
        key = key_of[name]
        collect_h = key in gptq_keys
        gi = next((t[0] for t in awq_groups if name in t[2]), None)

        def h(mod, args, kwargs, out):
            if name not in order:
                order.append(name)
            x = _first_tensor(args, kwargs)
            # with true_sequential only the first stage uses pass-1 statistics: the others are re-captured
            # later, so do not hold their (possibly K² = GBs) Hessians now
            if collect_h and (not true_seq or not first_key or first_key[0] == key):
                if not first_key:
                    first_key.append(key)
                Hk, nk = H.get(key, (None, 0))
                H[key] = accumulate_hessian(Hk, x, nk)
            if gi is not None:
                s, c = xsum.get(gi, (0.0, 0))
                x2 = x.reshape(-1, x.shape[-1])
                xsum[gi] = (s + x2.abs().sum(0, dtype=torch.float32), c + x2.shape[0])
                xsample[gi].add(args, kwargs)
        return h

    for name, lin in targets.items():
        hooks[lin] = lin_hook(name) if key_first[key_of[name]] is lin else order_hook(name)
    for gi, g, names, _ in awq_groups:
        samplers[gi] = _Sampler(max_tokens, rows=isinstance(g.inspect, nn.Linear))
        xsample[gi] = _Sampler(min(max_tokens, 2048), rows=True)
        prev_hook = hooks.get(g.inspect)

        def insp_hook(mod, args, kwargs, out, _gi=gi, _prev=prev_hook):
            samplers[_gi].add(args, kwargs)
            if _prev is not None:
                _prev(mod, args, kwargs, out)
        hooks[g.inspect] = insp_hook
    t0 = time.perf_counter()
    _stream(ctx, hooks)
    t_pass1 = time.perf_counter() - t0
    rank = {n: i for i, n in enumerate(order)}

    # ---- AWQ: search and refine (spread over ranks), fold in order
    d = getattr(ctx, "dist", None) or SINGLE
    scale_of: dict[str, torch.Tensor] = {}     # key -> s applied to the group's inputs
    folded_keys: set = set()                   # keys whose producer now emits x / s
    clip_of: dict[str, torch.Tensor] = {}
    awq_rows = {}
    ascfg = cfg(q, "activation_scaling", None)
    clip_for_gptq = bool(cfg(q, "awq.clip_for_gptq", False))

    def needs_clip(n):                         # the clip search result is read by RTN, or by GPTQ on request
        return clip_on and (specs[n].method not in GPTQ_METHODS or clip_for_gptq)

    jobs = []
    for gi, g, names, _ in awq_groups:
        lins = [targets[n] for n in names]
        if g.prev is None and g.inspect is None:
            continue
        if isinstance(g.prev, nn.Linear) and g.prev.out_features != lins[0].in_features:
            log.info("%s: cannot fold into %s (out %d != in %d); group left unscaled", names[0], g.prev_name,
                     g.prev.out_features, lins[0].in_features)
            continue
        spec = specs[names[0]]
        mixed = any((specs[n].bits, specs[n].group_size, specs[n].symmetric) !=
                    (spec.bits, spec.group_size, spec.symmetric) for n in names)
        refine = ascfg is not None and bool(cfg(ascfg, "per_channel", True)) and not mixed
        jobs.append(_AwqJob(gi, g, names, lins, spec, refine))
    for wave in _awq_waves(jobs):
        _awq_search_wave(ctx, wave, xsum, samplers, dtype, ascfg, d)
        clip_jobs = [n for j in wave for n in j.names if needs_clip(n)]
        clip_owner = dict(zip(clip_jobs, lpt_assign([targets[n].weight.numel() for n in clip_jobs], d.world)))
        for job in wave:
            g, names, lins, r, s = job.g, job.names, job.lins, job.result, job.result.scales
            key = f"group{job.gi}"
            # fold: the producer emits x / s, the consumers hold W · s (exact in full precision)
            if g.prev is None:
                for l in lins:
                    awq_math.scale_linear_inputs(l.weight.data, s.to(l.weight.device))
                for n in names:
                    res.smooth[n] = s.detach().clone()
            else:
                _fold(g, lins, s)
                folded_keys.add(key)
            scale_of[key] = s
            # the clip search sees this group's folded weights before any later fold, as a sequential run does
            todo = [(n, l) for n, l in zip(names, lins) if n in clip_owner and clip_owner[n] == d.rank]
            if todo:
                xs = torch.cat([c[0][0] for c in xsample[job.gi].calls], 0).float() / s[None, :]
                for n, l in todo:
                    sp = specs[n]
                    clip_of[n] = awq_math.clip_search(l.weight.detach().float(), xs, sp.bits, sp.group_size,
                                                      sp.symmetric, grid=int(cfg(q, "awq.clip_grid", 20)),
                                                      max_shrink=float(cfg(q, "awq.clip_max_shrink", 0.5)))
            res.scales.setdefault(ctx.prefix + "awq", []).append({
                "prev": g.prev_name, "linears": names, "inspect": g.inspect_name, "alpha": r.alpha,
                "folded": g.prev is not None, "scales": s.detach().float().cpu().tolist()})
            for n in names:
                awq_rows[n] = dict(awq_loss_unscaled=r.loss_unscaled, awq_loss=r.loss, awq_ratio_loss=r.ratio_loss,
                                   alpha=r.alpha, awq_seconds=job.seconds / len(names))
            log.debug("%s: AWQ alpha=%.2f loss %.4g -> %.4g (ratio %s)", g.inspect_name, r.alpha, r.loss_unscaled,
                      r.loss, r.ratio_loss)
        if d.active:
            for n in clip_jobs:
                w = targets[n].weight
                gs_n = specs[n].group_size if specs[n].group_size > 0 else w.shape[1]
                buf = clip_of.get(n)
                if buf is None:
                    buf = torch.empty(w.shape[0], w.shape[1] // gs_n, dtype=torch.float32, device=w.device)
                clip_of[n] = d.broadcast_(buf, clip_owner[n])

    # ---- quantize, stage by stage in execution order
    unit_shift = 0
    keys_in_order = sorted({key_of[n] for n in targets}, key=lambda kk: min(rank.get(n, 1 << 30)
                                                                            for n in targets if key_of[n] == kk))
    for key in keys_in_order:
        names = sorted([n for n in targets if key_of[n] == key], key=lambda n: rank.get(n, 0))
        s = scale_of.get(key)
        Hk = None
        if key in gptq_keys:
            if key in H:                                    # pass-1 statistics: before any fold
                Hk = H.pop(key)[0]
                captured_scaled = False
            else:                                           # true_sequential: earlier stages are quantized
                acc = {}

                def hk(mod, args, kwargs, out, _acc=acc):
                    Hc, nc = _acc.get("h", (None, 0))
                    _acc["h"] = accumulate_hessian(Hc, _first_tensor(args, kwargs), nc)
                tr = time.perf_counter()
                _stream(ctx, {key_first[key]: hk})
                t_pass1 += time.perf_counter() - tr
                Hk = acc.pop("h")[0]
                captured_scaled = key in folded_keys        # the producer already emits x / s
            if s is not None and not captured_scaled:
                Hk = scale_hessian(Hk, s.to(Hk.device))     # H' = diag(1/s) H diag(1/s): exact
        quantized: dict = {}
        # linears that read the same x with the same quantizer are one GPTQ problem (rows are independent
        # given H): one column sweep for q/k/v or gate/up instead of two or three
        fused: dict = {}
        for n in names:
            sp = specs[n]
            if sp.method in GPTQ_METHODS:
                fused.setdefault((sp.bits, sp.group_size, sp.symmetric), []).append(n)
        for (bits, gs, sym), fnames in fused.items():
            t1 = time.perf_counter()
            # already W · s when scaled; one fp32 matrix for the fused problem, the per-linear rows are views
            W = torch.cat([targets[n].weight.detach().float() for n in fnames], 0) if len(fnames) > 1 else \
                targets[fnames[0]].weight.detach().float()
            sizes = [targets[n].weight.shape[0] for n in fnames]
            Ws = list(torch.split(W, sizes, 0))
            clip = None
            if bool(cfg(q, "awq.clip_for_gptq", False)) and all(n in clip_of for n in fnames):
                clip = torch.cat([clip_of[n] for n in fnames], 0)
            # a layer that alone uses this Hessian hands it over (no K² copy: 3.3 GB for a 70B down_proj)
            own = len(fused) == 1 and len(fnames) == 1 and all(specs[n].method in GPTQ_METHODS for n in names)
            box = [Hk]                                      # handed over: gptq_quantize takes it out
            if own:
                Hk = None
            unit_shift += 1                                 # rotate leftover row units over the ranks
            qw, st = gptq_quantize_dp(d, W, box, bits=bits, group_size=gs, symmetric=sym,
                                   unit_shift=unit_shift, act_order=str(cfg(q, "act_order", "static")),
                                   damp=float(cfg(q, "damp", 0.01)),
                                   block_size=int(cfg(q, "gptq_block_size", 128)),
                                   damp_max=float(cfg(q, "damp_max", 1.0)), clip_ratio=clip,
                                   mse_grid=0 if clip is not None else int(cfg(q, "gptq_mse_grid", 10)),
                                   name="+".join(fnames), log=log, overwrite_h=own)
            parts = _split_rows(qw, sizes)
            dt = (time.perf_counter() - t1) / len(fnames)
            for n, w, part in zip(fnames, Ws, parts):
                row = dict(damp=st.damp, escalations=st.escalations, gptq_seconds=dt)
                if len(fnames) == 1:
                    row.update(rtn_loss=st.rtn_loss, loss=st.loss)
                elif Hk is not None:
                    row.update(rtn_loss=layer_loss(w, rtn_dequant(w, bits, gs, sym), Hk),
                               loss=layer_loss(w, part.dequantize(torch.float32), Hk))
                quantized[n] = (part, row)
            del W, Ws, parts                                # the next stage's solve must not find them alive
        for n in names:
            t1 = time.perf_counter()
            lin, sp = targets[n], specs[n]
            row = dict(layer=n, method=sp.method, bits=sp.bits, group_size=sp.group_size)
            if n in quantized:
                qw, extra = quantized[n]
                row.update(extra)
            else:
                W = lin.weight.detach().float()
                qw = _qweight_from_dequant_rtn(W, sp.bits, sp.group_size, sp.symmetric, clip_of.get(n))
                if Hk is not None:
                    row.update(loss=layer_loss(W, qw.dequantize(torch.float32), Hk))
                del W
            deq = qw.dequantize(torch.float32)
            if n in res.smooth:                              # the module still sees x: keep Q(W·s)/s
                deq = deq / res.smooth[n].to(deq.device)[None, :]
            _set_weight(lin, deq)
            del deq
            res.weights[n] = qw
            row.update(awq_rows.get(n, {}))
            row["seconds"] = time.perf_counter() - t1 + row.get("awq_seconds", 0.0) + row.get("gptq_seconds", 0.0)
            res.rows.append(row)
            if hasattr(ctx, "progress") and callable(ctx.progress):
                ctx.progress(1)
        del Hk
    res.scales[ctx.prefix + "forward_seconds"] = t_pass1


# -------------------------------------------------------------------------------------------- fp8 path
def _fp8_block(ctx, names: list, res: BlockResult) -> None:
    q = ctx.qcfg
    targets = {n: ctx.targets[n] for n in names}
    static = str(cfg(q, "fp8.activations", "dynamic")) == "static"
    per_tensor = str(cfg(q, "fp8.weights", "channel")) == "tensor"
    smoothing = bool(cfg(q, "fp8.smoothing", False))
    alpha = float(cfg(q, "fp8.smooth_alpha", 0.5))
    amax: dict[str, Optional[torch.Tensor]] = {}
    t0 = time.perf_counter()
    if static or smoothing:
        def mk(n):
            def h(mod, args, kwargs, out):
                amax[n] = fp8_math.channel_absmax_update(amax.get(n), _first_tensor(args, kwargs))
            return h
        _stream(ctx, {lin: mk(n) for n, lin in targets.items()})
    smooth_of: dict[str, torch.Tensor] = {}
    if smoothing:
        for g in ctx.groups:
            gnames = [n for n, _ in g.linears if n in targets]
            if not gnames or len(gnames) != len(g.linears):
                continue
            lins = [targets[n] for n in gnames]
            if isinstance(g.prev, nn.Linear) and g.prev.out_features != lins[0].in_features:
                continue
            a = amax[gnames[0]]
            s = fp8_math.smooth_scales(a, [l.weight for l in lins], alpha)
            if g.prev is None:
                for l in lins:
                    awq_math.scale_linear_inputs(l.weight.data, s.to(l.weight.device))
                for n in gnames:
                    res.smooth[n] = s.clone()
            else:
                _fold(g, lins, s)
            for n in gnames:
                smooth_of[n] = s
            res.scales.setdefault(ctx.prefix + "fp8_smooth", []).append(
                {"prev": g.prev_name, "linears": gnames, "scales": s.float().cpu().tolist()})
    for n, lin in targets.items():
        t1 = time.perf_counter()
        W = lin.weight.detach().float()
        in_scale = None
        if static:
            a = amax[n]
            if n in smooth_of:
                a = a / smooth_of[n].to(a.device)
            in_scale = fp8_math.static_input_scale(a)
        fw: Fp8Weight = fp8_math.quantize_fp8(W, in_scale, per_tensor=per_tensor)
        deq = fw.dequantize(torch.float32)
        err = float((deq - W).pow(2).mean())
        if n in res.smooth:
            deq = deq / res.smooth[n].to(deq.device)[None, :]
        _set_weight(lin, deq)
        res.weights[n] = fw
        res.rows.append(dict(layer=n, method="fp8", weight_mse=err,
                             input_scale=None if in_scale is None else float(in_scale),
                             seconds=time.perf_counter() - t1))
    res.scales[ctx.prefix + "forward_seconds"] = time.perf_counter() - t0
