"""AWQ's per-block search, spread over data-parallel ranks: the loss function a scaling group is searched
against, the grouping of scaling groups into waves that can be searched before any of them is folded, and the
wave search itself (grid candidates and per-channel ratio refinements assigned to ranks). Called by
sdquant.calibrate.recipes; the math is in sdquant.calibrate.awq."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from sdquant.calibrate import awq as awq_math
from sdquant.calibrate._util import cfg, map_leaves, out_tensor
from sdquant.calibrate.distributed import lpt_assign


def _slice_batch(obj, b: int, i: int):
    """Sequence i of a call's arguments: tensors of two or more dims whose first dim is the batch b."""
    return map_leaves(lambda t: t[i:i + 1] if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == b
                      else t, obj)


def make_loss_fn(inspect: nn.Module, pnames, calls, refs, dtype):
    """loss(weights) = mean squared error of inspect's output with the group's weights replaced.

    For an attention inspect module the function also carries ``parts``: per-sequence closures returning
    the summed squared error of one sequence, and ``count``: the number of output elements, so a gradient
    step can be taken one sequence at a time (what the math attention backend needs to stay small)."""
    def sse(ws, a, kw, ref):
        params = {pn: w.to(dtype) for pn, w in zip(pnames, ws)}
        out = out_tensor(functional_call(inspect, params, a, kw)).float()
        return (out - ref).pow(2).sum()

    def loss_fn(ws):
        tot, cnt = 0.0, 0
        for (a, kw), ref in zip(calls, refs):
            tot = tot + sse(ws, a, kw, ref)
            cnt += ref.numel()
        return tot / max(cnt, 1)

    loss_fn.count = max(sum(r.numel() for r in refs), 1)
    if calls and any(k in calls[0][1] for k in ("position_embeddings", "attention_mask")):
        parts = []
        for (a, kw), ref in zip(calls, refs):
            b = ref.shape[0]
            for i in range(b):
                parts.append(lambda ws, a=_slice_batch(a, b, i), kw=_slice_batch(kw, b, i), ref=ref[i:i + 1]:
                             sse(ws, a, kw, ref))
        loss_fn.parts = parts
    return loss_fn


@dataclass
class AwqJob:
    gi: int
    g: Any
    names: list
    lins: list
    spec: Any
    refine: bool
    result: Any = None
    seconds: float = 0.0

    def reads(self) -> set:
        mods = [self.g.inspect] if self.g.inspect is not None else []
        return {id(p) for m in mods for p in m.parameters()} | {id(l.weight) for l in self.lins}

    def writes(self) -> set:
        prev = [self.g.prev] if isinstance(self.g.prev, nn.Module) else []
        return {id(p) for m in prev for p in m.parameters()} | {id(l.weight) for l in self.lins}

    def eval_cost(self) -> float:
        m = self.g.inspect
        return float(sum(p.numel() for p in m.parameters()) if m is not None else
                     sum(l.weight.numel() for l in self.lins))


def _deterministic_attention(device):
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


def awq_waves(jobs: list) -> list:
    """Consecutive groups whose searches read nothing that an earlier group of the same wave folds into:
    searching a whole wave before folding any of it gives exactly the sequential result (for the usual
    decoder block — norm→qkv, v→o, norm→gate/up, up→down — the whole block is one wave)."""
    waves: list = []
    for job in jobs:
        if waves and not any(prev.writes() & job.reads() for prev in waves[-1]):
            waves[-1].append(job)
        else:
            waves.append([job])
    return waves


def search_wave(ctx, wave: list, xsum: dict, samplers: dict, dtype, ascfg, d) -> None:
    """Grid search, then per-channel ratio refinement, for every group of a wave. Under data parallelism
    the grid candidates are spread over the ranks (losses summed exactly: each is computed once) and each
    group's refinement runs on one rank (longest first) and is broadcast, so every rank ends with the
    same scales as one process."""
    q = ctx.qcfg
    grid, duo = int(cfg(q, "awq.grid", 20)), bool(cfg(q, "awq.duo_scaling", True))
    for job in wave:
        s_sum, cnt = xsum[job.gi]
        job.x_mean = s_sum / max(cnt, 1)
        job.ws = [l.weight.detach().float() for l in job.lins]
        job.cands = awq_math.awq_candidates(job.x_mean, job.ws, job.spec.group_size, grid, duo)
        job._loss_fn = None

    def loss_fn(job):
        if job._loss_fn is None:                 # full-precision targets, built only where they are used
            g = job.g
            pn = {m: n for n, m in g.inspect.named_modules()}
            pnames = [(pn[l] + ".weight").lstrip(".") for l in job.lins]
            calls = samplers[job.gi].calls
            with torch.no_grad():
                refs = [out_tensor(g.inspect(*a, **kw)).float() for a, kw in calls]
            job._loss_fn = make_loss_fn(g.inspect, pnames, calls, refs, dtype)
        return job._loss_fn

    tasks = [(job, c) for job in wave for c in range(len(job.cands))]
    owner = lpt_assign([job.eval_cost() for job, _ in tasks], d.world) if d.active else [0] * len(tasks)
    losses = torch.zeros(len(tasks), dtype=torch.float64)
    for t, ((job, c), o) in enumerate(zip(tasks, owner)):
        if o == d.rank:
            t1 = time.perf_counter()
            sp = job.spec
            losses[t] = awq_math.candidate_loss(job.cands[c][1], job.ws, loss_fn(job), sp.bits, sp.group_size,
                                                sp.symmetric)
            job.seconds += time.perf_counter() - t1
    if d.active:                                 # every loss was computed on exactly one rank: the sum is exact
        losses = d.sum_(losses.to(d.device())).cpu()
    t = 0
    for job in wave:
        n = len(job.cands)
        job.result = awq_math.awq_pick(job.cands, losses[t:t + n].tolist())
        t += n
    refiners = [job for job in wave if job.refine]
    r_owner = lpt_assign([job.eval_cost() for job in refiners], d.world) if d.active else [0] * len(refiners)
    for job, o in zip(refiners, r_owner):
        r = job.result
        if o == d.rank:
            t1 = time.perf_counter()
            sp = job.spec
            req = [p.requires_grad for p in ctx.block.parameters()]
            for p in ctx.block.parameters():
                p.requires_grad_(False)
            fn = loss_fn(job)                    # targets built like the grid search's (default attention)
            try:
                # gradients through attention use the math SDPA backend, whose backward has no atomics, so a
                # run is reproducible (and a data-parallel run equals one process)
                s, loss, _ = awq_math.refine_channel_ratio(
                    r.scales, job.x_mean, job.ws, fn, sp.bits, sp.group_size, sp.symmetric, r.loss,
                    init_ratio=float(cfg(ascfg, "init_ratio", 1.0)),
                    ratio_range=tuple(cfg(ascfg, "ratio_range", (0.8, 1.2))),
                    granularity=int(cfg(ascfg, "granularity", 1)),
                    method=str(cfg(ascfg, "method", "ste")), steps=int(cfg(ascfg, "steps", 8)),
                    grad_context=(lambda: _deterministic_attention(ctx.device))
                    if torch.device(ctx.device).type == "cuda" else None)
            finally:
                for p, rq in zip(ctx.block.parameters(), req):
                    p.requires_grad_(rq)
            job.seconds += time.perf_counter() - t1
        else:
            s, loss = torch.empty_like(r.scales), 0.0
        if d.active:
            s = d.broadcast_(s.contiguous(), o)
            loss = float(d.broadcast_(torch.tensor([loss], dtype=torch.float64, device=d.device()), o).item())
        r.scales, r.ratio_loss = s, loss        # r.loss stays the plain AWQ loss (reported beside it)
    for job in wave:
        job._loss_fn = job.ws = job.cands = None
