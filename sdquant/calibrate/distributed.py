"""Data-parallel calibration on torch.distributed (torchrun; NCCL on GPUs, gloo on CPUs).

Each rank holds a shard of the calibration batches (batch i goes to rank i % world) and runs every block on
it. Statistics that the recipes accumulate over batches (Hessians, mean |x|, search losses, activation
ranges) are summed across ranks in float64 so every rank reaches the same scales and quantized weights as a
single process; the independent solves of a block (GPTQ per linear) are spread over the ranks and their
results broadcast. Only rank 0 writes files.

Nothing here runs at import time: the process group is created by ``init_from_env`` when the CLI or the
API is started under torchrun (WORLD_SIZE > 1), never by importing sdquant.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sdquant.calibrate._util import map_leaves

# NVLink SHARP / multicast stays off: the lent machines' fabric does not support it reliably
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence) -> list:
        """This rank's share: items rank, rank + world, ... (a fixed assignment, independent of timing)."""
        return list(items[self.rank::self.world])

    def owner(self, index: int) -> int:
        return index % self.world

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum across ranks, reduced in float64 so the order of ranks does not change the result
        at float32 precision."""
        if not self.active:
            return t
        import torch.distributed as dist
        buf = t.to(self.device(), torch.float64)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        t.copy_(buf.to(t.dtype))
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return t
        import torch.distributed as dist
        buf = t.to(self.device())
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        if buf is not t:
            t.copy_(buf)
        return t

    def sum_float(self, x: float, device=None) -> float:
        if not self.active:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=device or self.device())
        return float(self.sum_(t).item())

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if not self.active:
            return t
        import torch.distributed as dist
        buf = t.to(self.device())                   # gloo with GPU tensors: through the host
        dist.broadcast(buf, src=src)
        if buf is not t:
            t.copy_(buf)
        return t

    def broadcast_object(self, obj, src: int = 0):
        if not self.active:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_tree(self, obj, device: Optional[torch.device] = None) -> list:
        """Every rank's ``obj`` (nested tuples/lists/dicts holding tensors), in rank order; this rank's entry is
        ``obj`` itself. Tensors travel as one flat byte buffer per rank through ``broadcast`` (NCCL: GPU to GPU
        over NVLink, no host copy, no pickling); only the small skeleton (shapes, dtypes, non-tensor leaves)
        is pickled. Received tensors land on ``device`` (default: the collective's device)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist
        comm = self.device()
        device = device or comm
        tensors: list = []
        skeleton = _strip(obj, tensors)
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        metas: list = [None] * self.world
        dist.all_gather_object(metas, (skeleton, specs))
        out = []
        for r in range(self.world):
            skel, sp = metas[r]
            sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in sp]
            total = sum(sizes)
            if r == self.rank:
                if total:
                    buf = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(comm)
                                     for t in tensors if t.numel()])
                    dist.broadcast(buf, src=r)
                    del buf
                out.append(obj)
                continue
            buf = torch.empty(total, dtype=torch.uint8, device=comm)
            if total:
                dist.broadcast(buf, src=r)
            got, off = [], 0
            for (shape, dtype), n in zip(sp, sizes):
                got.append(buf[off:off + n].view(dtype).reshape(shape).to(device, copy=True))
                off += n
            del buf
            out.append(_fill(skel, got))
        return out

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist
            dist.barrier()

    def device(self) -> torch.device:
        import torch.distributed as dist
        if self.active and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


SINGLE = Dist()


class _TensorSlot:
    """Placeholder for the i-th tensor of a skeleton (see Dist.all_gather_tree)."""

    def __init__(self, i: int):
        self.i = i


def _strip(obj, tensors: list):
    """obj with every tensor replaced by a _TensorSlot; the tensors are appended to ``tensors`` in order."""
    def slot(t):
        if not isinstance(t, torch.Tensor):
            return t
        tensors.append(t)
        return _TensorSlot(len(tensors) - 1)
    return map_leaves(slot, obj)


def _fill(obj, tensors: list):
    return map_leaves(lambda x: tensors[x.i] if isinstance(x, _TensorSlot) else x, obj)


def lpt_assign(costs: Sequence[float], world: int) -> list:
    """Owner rank of each task: longest task first onto the least-loaded rank (ties: lower task index, lower
    rank). Deterministic, so every rank computes the same assignment without communicating."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-float(costs[j]), j)):
        r = min(range(world), key=lambda q: (load[q], q))
        owner[i] = r
        load[r] += float(costs[i])
    return owner


def current() -> Dist:
    """The Dist of an initialised process group, or the single-process one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size())
    return SINGLE


def init_from_env(device: Optional[str] = None) -> Dist:
    """Create the process group when launched by torchrun (WORLD_SIZE > 1); otherwise single-process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    import torch.distributed as dist
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and (device is None or str(device).startswith(("cuda", "auto")))
        # SDQUANT_DIST_BACKEND=gloo: collectives through the host even with GPUs (e.g. several ranks sharing
        # one GPU to check results where NCCL, which wants a GPU per rank, cannot run)
        backend = os.environ.get("SDQUANT_DIST_BACKEND") or ("nccl" if use_cuda else "gloo")
        if use_cuda:
            for k, v in NCCL_DEFAULTS.items():
                os.environ.setdefault(k, v)
            torch.cuda.set_device(_local_gpu())
        dist.init_process_group(backend=backend)
    return current()


def _local_gpu() -> int:
    # more ranks than GPUs (only sensible with the gloo backend) share them round-robin
    return int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())


def rank_device(device: torch.device, d: Dist) -> torch.device:
    """Each rank uses its own GPU (LOCAL_RANK) when the configured device is CUDA."""
    if d.active and device.type == "cuda":
        return torch.device("cuda", _local_gpu())
    return device


def gptq_quantize_dp(d: Dist, W: torch.Tensor, H, *, bits: int, group_size: int, symmetric: bool,
                     clip_ratio: Optional[torch.Tensor] = None, unit_shift: int = 0, **kw):
    """``gptq_quantize`` with W's rows [N, K] solved across the ranks: rows are independent given H, so rank r
    solves the ROW_TILE-row units u with (u + unit_shift) % world == r, and every rank receives all rows.
    GPTQ runs its row-mixing operations on the same fixed tiles, so the result is bitwise that of one
    process. Returns (QuantizedWeight, GptqStats) on every rank; the losses are the row-weighted means.
    H may be handed over as ``[H]`` (see ``gptq_quantize``): it is passed on, so this frame holds no reference."""
    from sdquant.calibrate.gptq import ROW_TILE, GptqStats, gptq_quantize
    from sdquant.quant.qtensor import QuantizedWeight, effective_group_size
    if not d.active:
        return gptq_quantize(W, H, bits, group_size, symmetric, clip_ratio=clip_ratio, **kw)
    n, k = W.shape
    dev = W.device
    units = [(r0, min(r0 + ROW_TILE, n)) for r0 in range(0, n, ROW_TILE)]
    owner = [(u + unit_shift) % d.world for u in range(len(units))]

    def rows_of(r):
        us = [units[u] for u in range(len(units)) if owner[u] == r]
        return torch.cat([torch.arange(a, b, device=dev) for a, b in us]) if us else None

    mine = rows_of(d.rank)
    comm = d.device()
    stats = torch.zeros(5, dtype=torch.float64, device=comm)    # loss·rows, rtn·rows, damp, escalations, dead
    qw = None
    if mine is not None:
        qw, st = gptq_quantize(W[mine], H, bits, group_size, symmetric,
                               clip_ratio=None if clip_ratio is None else clip_ratio[mine], **kw)
        stats.copy_(torch.tensor([st.loss * mine.numel(), st.rtn_loss * mine.numel(), st.damp, st.escalations,
                                  st.dead_columns], dtype=torch.float64))
    G = k // effective_group_size(k, group_size)
    qweight = torch.empty(n, k * bits // 8, dtype=torch.uint8, device=dev)
    scales = torch.empty(n, G, dtype=torch.float16, device=dev)
    zeros = None if symmetric else torch.empty(n, G, dtype=torch.uint8, device=dev)
    for r in range(d.world):
        rows = rows_of(r)
        if rows is None:
            continue
        for full, name in ((qweight, "qweight"), (scales, "scales"), (zeros, "zeros")):
            if full is None:
                continue
            buf = (getattr(qw, name).contiguous().to(comm) if r == d.rank else
                   torch.empty(rows.numel(), full.shape[1], dtype=full.dtype, device=comm))
            full[rows] = d.broadcast_(buf, r).to(dev)
    g_idx = None
    if str(kw.get("act_order", "none")) == "group":          # a function of H alone: the same on every rank
        g_idx = qw.g_idx.to(comm) if owner[0] == d.rank else torch.empty(k, dtype=torch.int32, device=comm)
        g_idx = d.broadcast_(g_idx, owner[0]).to(dev)
    import torch.distributed as dist
    sums = stats[:2].clone()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    maxes = stats[2:].clone()
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    out = QuantizedWeight(qweight, scales, zeros, bits, group_size, k, g_idx)
    return out, GptqStats(loss=float(sums[0]) / n, rtn_loss=float(sums[1]) / n, damp=float(maxes[0]),
                          escalations=int(maxes[1]), dead_columns=int(maxes[2]))
