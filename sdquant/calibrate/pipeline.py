"""The one block walker for every architecture.

    capture: run the model once with every block replaced by a recorder -> block-0 inputs and the extra
             kwargs each block receives (attention masks, rotary embeddings), per calibration batch
    for each block:  move it to the device -> recipe (statistics, search, quantize; leaves the dequantized
             weights in the block) -> run the *quantized* block to produce the next block's inputs ->
             save its result in the work folder (resume) -> move it back to the CPU

Peak device memory is one block plus the calibration activations, so a model much larger than the device
calibrates with the rest in CPU memory. The algorithms live in recipes/rtn and never see hooks or devices.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from sdquant.calibrate._util import map_leaves
from sdquant.calibrate.distributed import SINGLE, Dist
from sdquant.config import LayerSpec, QuantConfig, layer_spec
from sdquant.errors import SdquantError
from sdquant.models.adapters import Adapter, get_blocks, resolve_groups

log = logging.getLogger("sdquant.calibrate")


class _Stop(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for a block during capture: records the call, passes hidden states through."""

    def __init__(self, index: int, original: nn.Module, sink: list, last: bool):
        super().__init__()
        self.index, self.sink, self.last = index, sink, last
        # model forwards may read plain attributes of their layers (e.g. attention_type for mask choice)
        for k, v in vars(original).items():
            if not k.startswith("_") and isinstance(v, (str, int, bool, float, type(None))) and k != "training":
                setattr(self, k, v)

    def forward(self, *args, **kwargs):
        self.sink.append((self.index, args, kwargs))
        if self.last:
            raise _Stop
        return args[0] if args else kwargs["hidden_states"]


def _move(obj, device):
    return map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, obj)


def _detach(obj):
    return map_leaves(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, obj)


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _with_hidden(args: tuple, kwargs: dict, h: torch.Tensor):
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _call_model(model: nn.Module, batch):
    # no KV cache during capture: a cache object in the blocks' kwargs would carry state between calls
    extra = {"use_cache": False} if _accepts(model, "use_cache") else {}
    if isinstance(batch, dict):
        return model(**batch, **extra)
    return model(input_ids=batch, **extra)


def _accepts(model, name: str) -> bool:
    import inspect
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def capture_block_inputs(model: nn.Module, adapter: Adapter, batches: list, device) -> list:
    """Returns per block a list (over batches) of (args, kwargs) with block 0's hidden states in place and
    the other blocks' hidden-state slots to be filled by the walker."""
    blocks = get_blocks(model, adapter)
    parent_name, _, leaf = adapter.blocks.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    n = len(blocks)
    sink: list = []
    recorders = nn.ModuleList([_Recorder(i, b, sink, i == n - 1) for i, b in enumerate(blocks)])
    setattr(parent, leaf, recorders)
    rest_device = next(model.parameters()).device
    try:
        model.to(device)
        per_block: list = [[] for _ in range(n)]
        for batch in batches:
            sink.clear()
            try:
                _call_model(model, _move(batch, device))
            except _Stop:
                pass
            if len(sink) != n:
                raise SdquantError(f"capture saw {len(sink)} of {n} blocks: the model's forward does not call "
                                   f"{adapter.blocks} in order")
            for i, args, kwargs in sink:
                kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values")}
                per_block[i].append((args, kwargs))
    finally:
        setattr(parent, leaf, blocks)
        model.to(rest_device)
    return per_block


@dataclass
class BlockContext:
    """What a recipe sees of one block (see sdquant/calibrate/recipes.py)."""
    block: nn.Module
    block_index: int
    prefix: str
    inputs: list                       # [(args, kwargs)] per calibration batch, on device
    groups: list                       # [ScalingGroup]
    targets: dict                      # full name -> nn.Linear to quantize
    qcfg: QuantConfig
    keep: tuple
    device: torch.device
    dtype: torch.dtype
    log: logging.Logger = log
    progress: Optional[Callable[[int], None]] = None
    dist: Dist = SINGLE                # data parallel: ctx.inputs is this rank's shard; reduce statistics with
                                       # ctx.dist.sum_(tensor) / sum_float(x) before using them

    def spec(self, name: str) -> LayerSpec:
        s = layer_spec(self.qcfg, name, self.keep)
        if s is None:
            raise KeyError(f"{name} is kept in high precision")
        return s

    @torch.no_grad()
    def run(self, hooks: Optional[dict] = None) -> list:
        """Run the block on every calibration batch with forward hooks hook(module, args, kwargs, output);
        returns the block's hidden-state output per batch (this rank's batches under data parallelism)."""
        if self.dist.active and hooks:
            return self._run_data_parallel(hooks)
        handles = [m.register_forward_hook(fn, with_kwargs=True) for m, fn in (hooks or {}).items()]
        try:
            return [_hidden(self.block(*a, **k)) for a, k in self.inputs]
        finally:
            for h in handles:
                h.remove()

    def _run_data_parallel(self, hooks: dict) -> list:
        """Forward passes run on each rank's own batches; the hook calls they trigger (module inputs) are
        gathered and replayed on every rank in global batch order (batch j*world + r), so statistics are
        accumulated in exactly the order of a single-process run and every rank ends bitwise identical.
        Hooks receive output=None on replay: statistics hooks must read inputs only."""
        import torch.distributed as tdist
        mods = list(hooks)
        index = {id(m): i for i, m in enumerate(mods)}
        n_local = len(self.inputs)
        n_steps = torch.tensor([n_local], dtype=torch.int64, device=self.dist.device())
        tdist.all_reduce(n_steps, op=tdist.ReduceOp.MAX)
        outputs = []
        for j in range(int(n_steps.item())):
            calls: list = []

            def rec(mod, args, kwargs, out):
                calls.append((index[id(mod)], _detach(args), _detach(kwargs)))
            handles = [m.register_forward_hook(rec, with_kwargs=True) for m in mods]
            try:
                if j < n_local:
                    a, k = self.inputs[j]
                    outputs.append(_hidden(self.block(*a, **k)))
            finally:
                for h in handles:
                    h.remove()
            # the recorded module inputs travel device to device (one buffer per rank), not through pickle
            for rank_calls in self.dist.all_gather_tree(calls, self.device):   # rank order == batch order
                for i, a, k in rank_calls:
                    hooks[mods[i]](mods[i], a, k, None)
        return outputs


@dataclass
class PipelineResult:
    weights: dict = field(default_factory=dict)
    smooth: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    scales: dict = field(default_factory=dict)
    seconds: float = 0.0
    resumed_blocks: int = 0
    peak_device_bytes: int = 0


def block_targets(block: nn.Module, prefix: str, qcfg: QuantConfig, keep: tuple) -> dict:
    return {prefix + n: m for n, m in block.named_modules()
            if isinstance(m, nn.Linear) and layer_spec(qcfg, prefix + n, keep) is not None}


def _quantize_block(ctx: BlockContext):
    try:
        from sdquant.calibrate import recipes
    except ImportError:
        recipes = None
    if recipes is not None and hasattr(recipes, "quantize_block"):
        return recipes.quantize_block(ctx)
    from sdquant.calibrate.rtn import rtn_block
    methods = {ctx.spec(n).method for n in ctx.targets}
    if methods - {"rtn", "fp8"}:
        raise SdquantError(f"quant.method: {sorted(methods)} needs sdquant.calibrate.recipes, which is missing")
    return rtn_block(ctx)


def run_pipeline(model: nn.Module, adapter: Adapter, batches: list, qcfg: QuantConfig, *, device="cpu",
                 work_dir: Optional[Path] = None, fingerprint: str = "", resume: bool = False,
                 progress: Optional[Callable[[str, int, int], None]] = None,
                 stop_after: Optional[int] = None, dist: Dist = SINGLE) -> PipelineResult:
    """Quantize every block of ``model`` in place (folded scales, dequantized weights) and return the
    quantized weights. ``stop_after`` ends after that many blocks (used to test resume). Under
    torch.distributed, ``batches`` is this rank's shard and only rank 0 writes the work folder."""
    t0 = time.perf_counter()
    device = torch.device(device)
    keep = tuple(adapter.keep)
    blocks = get_blocks(model, adapter)
    dtype = next(model.parameters()).dtype
    if work_dir is not None:
        if dist.is_main:
            _prepare_work_dir(Path(work_dir), fingerprint, resume)
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    per_block = capture_block_inputs(model, adapter, batches, device)
    res = PipelineResult()
    hidden = [_hidden(a[0] if a else k["hidden_states"]) for a, k in per_block[0]]
    peak_all = 0
    for i, block in enumerate(blocks):
        if stop_after is not None and i >= stop_after:
            break
        if device.type == "cuda":                       # a peak window per block, for the per-layer table
            peak_all = max(peak_all, torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        prefix = f"{adapter.blocks}.{i}."
        inputs = [_with_hidden(a, k, h) for (a, k), h in zip(per_block[i], hidden)]
        home = next(block.parameters()).device        # the block goes back where it came from
        block.to(device)
        targets = block_targets(block, prefix, qcfg, keep)
        saved = Path(work_dir) / f"block_{i:04d}.safetensors" if work_dir is not None else None
        if resume and saved is not None and saved.is_file():
            br = _load_block(saved, block, prefix)
            res.resumed_blocks += 1
        else:
            ctx = BlockContext(block, i, prefix, inputs, resolve_groups(block, prefix, adapter, targets),
                               targets, qcfg, keep, device, dtype, dist=dist)
            br = _quantize_block(ctx)
            if saved is not None and dist.is_main:
                _save_block(saved, block, prefix, br)
        res.weights.update(br.weights)
        res.smooth.update(getattr(br, "smooth", {}) or {})
        res.rows.extend(getattr(br, "rows", []) or [])
        res.scales.update(getattr(br, "scales", {}) or {})
        with torch.no_grad():
            hidden = [_hidden(block(*a, **k)) for a, k in inputs]
        peak = _block_peak_bytes(device)
        for row in getattr(br, "rows", []) or []:
            row.setdefault("peak_mb", round(peak / 2**20, 1))
        block.to(home)
        if progress:
            progress("blocks", i + 1, len(blocks))
    if device.type == "cuda":
        res.peak_device_bytes = max(peak_all, torch.cuda.max_memory_allocated(device))
    res.seconds = time.perf_counter() - t0
    return res


def _block_peak_bytes(device: torch.device) -> int:
    """Peak device memory since the block started (CUDA), or the process's peak resident memory so far (CPU,
    where no per-block window exists)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024     # Linux: KiB
    except (ImportError, OSError):
        return 0


# ------------------------------------------------------------------------------------------ resume
def _prepare_work_dir(d: Path, fingerprint: str, resume: bool) -> None:
    d.mkdir(parents=True, exist_ok=True)
    fp = d / "fingerprint.json"
    if fp.is_file():
        old = json.loads(fp.read_text()).get("fingerprint")
        if resume and old != fingerprint:
            raise SdquantError(f"--resume: {d} was made with a different model, data or quant config "
                               f"(fingerprint {old[:12]} != {fingerprint[:12]}); delete it or choose another "
                               f"pipeline.work_dir")
        if not resume:
            for f in d.glob("block_*.safetensors"):
                f.unlink()
    _atomic_write(fp, json.dumps({"fingerprint": fingerprint}).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _save_block(path: Path, block: nn.Module, prefix: str, br) -> None:
    """The block's whole float state (folded scales, dequantized weights) + its quantized weights, so a
    resumed run continues from exactly the same numbers."""
    from safetensors.torch import save_file
    from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight

    tensors = {f"state.{k}": v.detach().cpu().contiguous() for k, v in block.state_dict().items()}
    meta = {}
    for name, w in br.weights.items():
        if isinstance(w, QuantizedWeight):
            parts = {"qweight": w.qweight, "scales": w.scales, "zeros": w.zeros, "g_idx": w.g_idx}
            meta[name] = {"type": "int", "bits": w.bits, "group_size": w.group_size, "in_features": w.in_features}
        else:
            parts = {"weight": w.weight, "weight_scale": w.weight_scale, "input_scale": w.input_scale}
            meta[name] = {"type": "fp8"}
        for k, t in parts.items():
            if t is not None:
                tensors[f"q.{name}.{k}"] = t.detach().cpu().contiguous()
    for name, t in (getattr(br, "smooth", {}) or {}).items():
        tensors[f"smooth.{name}"] = t.detach().cpu().contiguous()
    info = {"weights": meta, "rows": getattr(br, "rows", []), "scales": _jsonable(getattr(br, "scales", {}))}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"sdquant": json.dumps(info)})
    os.replace(tmp, path)


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _load_block(path: Path, block: nn.Module, prefix: str):
    from safetensors import safe_open
    from sdquant.calibrate.rtn import BlockResult
    from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight

    with safe_open(str(path), framework="pt") as f:
        info = json.loads(f.metadata()["sdquant"])
        keys = set(f.keys())
        state = {k[len("state."):]: f.get_tensor(k) for k in keys if k.startswith("state.")}
        block.load_state_dict(state)
        br = BlockResult(rows=info["rows"], scales=info["scales"])
        for name, m in info["weights"].items():
            g = lambda k: f.get_tensor(f"q.{name}.{k}") if f"q.{name}.{k}" in keys else None  # noqa: E731
            if m["type"] == "int":
                br.weights[name] = QuantizedWeight(g("qweight"), g("scales"), g("zeros"), m["bits"],
                                                   m["group_size"], m["in_features"], g("g_idx"))
            else:
                br.weights[name] = Fp8Weight(g("weight"), g("weight_scale"), g("input_scale"))
        br.smooth = {k[len("smooth."):]: f.get_tensor(k) for k in keys if k.startswith("smooth.")}
    return br


def fingerprint_of(model: nn.Module, data_fp: str, qcfg: QuantConfig) -> str:
    h = hashlib.sha256()
    h.update(data_fp.encode())
    h.update(json.dumps(_jsonable(_plain(qcfg)), sort_keys=True).encode())
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        flat = p.detach().reshape(-1)
        h.update(flat[:: max(1, flat.numel() // 64)].float().cpu().numpy().tobytes())
    return h.hexdigest()


def _plain(obj):
    import dataclasses
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
