"""QuantLinear / Fp8Linear: the one module every runtime path (eager, torch.compile, ONNX export) uses for a
quantized linear. They store the canonical tensors as buffers (what packages hold) and call torch.library
ops. Which kernel runs is chosen once per layer by ``prepare`` (per M bucket, from the measured crossover
table of ``dispatch``), never per call and never by a module-level flag. Before ``prepare`` a layer runs the
reference op, so an unprepared model is always correct.

    layer = QuantLinear(qw, bias).prepare("cuda", torch.bfloat16)     # kernels="auto": per-M choice
    layer.plan.describe()  ->  "M1-16:cuda M17-64:triton M65+:dequant"

Kernel layouts built by ``prepare`` are non-persistent buffers: ``state_dict`` keeps the canonical tensors.

Memory (what a prepared INT4 layer keeps on its device). ``prepare`` builds a kernel's layout only if some M
bucket of the plan calls it, and by default (``layouts="one"``) at most ONE int4 layout per layer: the layout
of the kernel the plan runs at the smallest M (decode; the CUDA C++ kernel on the H200), unless the other
kernel's plan is within 5% of it there and faster over all the table's buckets in geometric mean (each plan: the
kernel and dequantize+cuBLAS from its layout, per bucket the faster; ``dispatch.pick_one_layout``). So a
near-tie at M = 1 does not decide alone (H100, 4096x4096: Triton 8.1 against CUDA 8.2 us at M = 1, but 21
against 17 at M = 128 and 30 against 23 at M = 256). Buckets the table gave
to the other int4 kernel are re-planned among the kept kernel and dequantize+cuBLAS, and dequantize+cuBLAS
reads the kept layout (``layout_dequant``: a Triton kernel writes W from the layout, then one GEMM), so the
canonical tensors are not needed on the device. They then stay on the host (CPU memory, the package's exact
values) for ``state_dict``, ``weight_q`` and export; ``Module.to``/``cuda`` leave them there, and ``prepare``
copies them to the device only while it repacks. The canonical tensors stay on the device only when a bucket
reads them: the reference op, ``kernels="torch"``, bits != 4, or ``layouts="all"``. ``device_bytes()`` says what
a layer holds on its device. On the H200 table a Llama-3-8B-shaped layer plans cuda (M <= 4..32), triton
(up to M = 32..64) and dequant: ``layouts="one"`` keeps the CUDA layout (1.03x the canonical bytes) and moves the
triton buckets to cuda or dequant (the table says how much slower each bucket gets); ``layouts="all"`` keeps
both layouts and the canonical tensors (the fastest kernel at every M, about 3x the int4 bytes).
Re-run ``prepare`` after loading a state dict into a prepared layer: layouts are built from the canonical
tensors once.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from torch import nn

from sdquant.errors import ConfigError, ShapeError
from sdquant.kernels import dispatch
from sdquant.kernels import ops  # noqa: F401  (registers torch.ops.sdquant.*)
from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight

_INT4_KINDS = {"triton": ("w4a16_triton", "repack_triton"), "cuda": ("w4a16_cuda", "repack_cuda")}
_LAYOUT_DEQUANT = {"triton": "w4a16_dequant_triton", "cuda": "w4a16_dequant_cuda"}  # dequant from a layout
_CANONICAL = ("qweight", "scales", "zeros", "g_idx")
LAYOUT_MODES = ("one", "all")


def _resolve(device, dtype, like: torch.Tensor):
    dev = torch.device(device) if device is not None else like.device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ConfigError("dtype", f"activation dtype must be float16, bfloat16 or float32, got {dtype}")
    return dev, dtype


def _cuda_kernel_runs(device: torch.device) -> bool:
    """Whether the CUDA C++ int4 kernel can run on ``device`` (the CPU tests substitute this function to build
    its real layout on the host, where the op evaluates the layout with PyTorch)."""
    if device.type != "cuda":
        return False
    from sdquant.kernels import int4_cuda
    return int4_cuda.available()


def _interpreting() -> bool:
    try:
        import triton
        return bool(triton.knobs.runtime.interpret)
    except Exception:
        return False


TABLE_ENV = "SDQUANT_KERNEL_TABLE"  # a crossover table (JSON, e.g. from `sdquant tune-kernels`) used instead of the shipped one
_WARNED_DEVICES: set = set()  # GPU models already told that the shipped table was measured on another model


def _warn_other_gpu(here: str, table: dict) -> None:
    """One warning a process and GPU model when no shipped crossover table was measured on this GPU model (``here``)
    and the default one, from another model, is used: its crossovers (where dequantize + cuBLAS overtakes the
    kernels) are that GPU's, so a plan may pick the slower path."""
    measured = table.get("device")
    if measured and here != measured and here not in _WARNED_DEVICES:
        _WARNED_DEVICES.add(here)
        warnings.warn(f"the shipped kernel crossover table was measured on {measured}, this GPU is {here}: layers "
                      f"plan from it as they are; `sdquant tune-kernels --output T.json` measures this GPU's, and "
                      f"{TABLE_ENV}=T.json (or prepare(..., table=...)) uses it", stacklevel=3)


def _table_for(device: torch.device, mode: str, table):
    """The crossover table to plan from: for kernels="auto" on a GPU, or anywhere when one is passed. On a GPU
    without one passed: the file named by $SDQUANT_KERNEL_TABLE, else the shipped table of this GPU model
    (dispatch.shipped_table), else the default shipped table (with a warning)."""
    if mode != "auto" or (device.type != "cuda" and table is None):
        return None
    if isinstance(table, dict):
        dispatch.validate_table(table)
        return table
    if table is None and os.environ.get(TABLE_ENV):
        path = os.environ[TABLE_ENV]
        if not os.path.isfile(path):
            raise ConfigError(TABLE_ENV, f"crossover table {path} does not exist")
        return dispatch.load_table(path)
    if table is not None:
        return dispatch.load_table(table)
    here = torch.cuda.get_device_name(device)
    path = dispatch.shipped_table(here)
    if not path.exists():
        return None  # no measured table for this build: dispatch's defaults
    loaded = dispatch.load_table(path)
    _warn_other_gpu(here, loaded)
    return loaded


class _Prepared(nn.Module):
    kind = ""

    def _init_dispatch(self):
        self.plan: Optional[dispatch.Plan] = None
        self.kernel = "reference"
        self._device: Optional[torch.device] = None  # set by prepare
        self._host_keys: tuple = ()  # buffers prepare keeps on the host (for state_dict/export only)

    def device_bytes(self) -> int:
        """Bytes of the tensors this layer keeps on its compute device: kernel layouts, the canonical tensors
        when a bucket reads them, bias, smooth, the dense copy (storages counted once). Canonical tensors that
        ``prepare`` left on the host are not counted, even when the device is the CPU itself."""
        seen, total = set(), 0
        host = getattr(self, "_host_keys", ())
        for key, t in list(self._parameters.items()) + list(self._buffers.items()):
            if t is None or key in host:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    def _apply(self, fn, recurse=True):
        # Module.to / cuda / half leave host-kept canonical tensors where prepare put them (exact package values)
        held = {k: self._buffers[k] for k in getattr(self, "_host_keys", ())}
        for k in held:
            self._buffers[k] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers.update(held)

    def _set_plan(self, plan: dispatch.Plan):
        self.plan = plan
        self.kernel = plan.describe()

    def _set_dense(self, dense: bool, dtype: torch.dtype):
        """``dense=True`` keeps a dequantized x.dtype copy of W (non-persistent) for the M buckets where the
        table says plain F.linear beats every quantized path (large M, where the GEMM is compute-bound):
        it buys "never slower than bf16" with the bf16 weight's memory. Off by default."""
        if hasattr(self, "_dense_weight"):
            delattr(self, "_dense_weight")
        if dense:
            wq = self.weight_q
            if isinstance(wq, QuantizedWeight):
                from sdquant.kernels import dequant_triton
                w = dequant_triton.dequantize(wq, dtype)
            else:
                w = wq.dequantize(dtype)
            self.register_buffer("_dense_weight", w.contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ShapeError(f"{type(self).__name__}: input has {x.shape[-1]} features, layer expects "
                             f"{self.in_features}")
        if self.plan is None:
            return self._run("reference", x, ())
        m = x.numel() // self.in_features  # int, or a SymInt under dynamic shapes (one guard per bucket)
        name, cfg = self.plan.select(m)
        return self._run(name, x, cfg)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class QuantLinear(_Prepared):
    """W4A16-style weight-only integer linear (bits 2/3/4/8)."""
    kind = "int4"

    def __init__(self, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None,
                 smooth: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.bits, self.group_size = qw.bits, qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)
        self.register_buffer("g_idx", qw.g_idx)
        self.register_buffer("bias", bias)
        # an AWQ scale that could not be folded into the previous op: x is divided by it before the GEMM
        self.register_buffer("smooth", smooth)
        self._int4_ops: dict = {}      # kernel name -> (op, argument names), filled by prepare
        self._layout_keys: dict = {}   # kernel name -> layout keys registered as buffers
        self._dequant_from: Optional[str] = None  # layout the "dequant" buckets read (None: canonical tensors)
        self._dequant_op = None        # (op, argument names) of that layout's dequant+cuBLAS op
        self._init_dispatch()

    @property
    def weight_q(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                               self.in_features, self.g_idx)

    # ------------------------------------------------------------------------------------------ prepare
    def available_kernels(self, device: torch.device, dtype: torch.dtype) -> tuple:
        """Kernel names that can run this layer on ``device`` with ``dtype`` activations."""
        names = ["reference", "dequant"]
        if self.bits == 4 and dtype in (torch.float16, torch.bfloat16) and (device.type == "cuda" or _interpreting()):
            for name in ("triton", "cuda"):
                if self._int4_kernel(name, device, dtype, probe=True) is not None:
                    names.append(name)
        return tuple(names)

    def _int4_kernel(self, name: str, device, dtype, probe: bool = False):
        """(op, layout) for the int4 helper's kernel ``name``, or None (with the reason) where it cannot run."""
        op_name, repack_name = _INT4_KINDS[name]
        try:
            from sdquant.kernels import int4_layout
            if name == "cuda":
                from sdquant.kernels import int4_cuda  # noqa: F401  (registers its op)
                if not _cuda_kernel_runs(device):
                    return None
            else:
                from sdquant.kernels import int4_triton  # noqa: F401  (registers its op)
            op = getattr(torch.ops.sdquant, op_name)
            repack = getattr(int4_layout, repack_name)
        except (ImportError, AttributeError, RuntimeError):
            return None
        if probe:
            return op
        try:
            layout = repack(self.weight_q.to(device), dtype)
        except ShapeError:
            return None
        return op, layout

    def prepare(self, device=None, dtype=None, kernels: str = "auto", table=None,
                dense: bool = False, layouts: str = "one") -> "QuantLinear":
        """Move to ``device``, build the kernel layouts once and choose a kernel per M bucket.

        kernels: "auto" (measured table on a GPU, the reference op on a CPU unless ``table`` is given),
        "reference", "triton", "cuda", "torch" (dequantize + cuBLAS at every M). ``table``: a path or dict
        overriding the shipped table. ``dtype`` is the activation dtype the layer will see (default bf16 on a
        GPU, fp32 on a CPU). ``dense``: also keep a dequantized copy of W for the buckets where bf16 F.linear is
        fastest (see ``_set_dense``): the only way an int4 layer matches bf16 at large M, at the cost of W's
        bf16 memory. ``layouts``: "one" (default) keeps at most one int4 kernel layout, that of the plan's smallest-M
        kernel (or of the other where it ties there and is faster over all buckets), and dequantizes from it at
        large M, so the canonical tensors go back to the host; "all" keeps
        every layout the plan calls plus the canonical tensors for dequantize+cuBLAS (fastest at every M, about
        3x the memory). See the module docstring.
        """
        if layouts not in LAYOUT_MODES:
            raise ConfigError("layouts", f"unknown layouts mode {layouts!r} (choose from {', '.join(LAYOUT_MODES)})")
        device, dtype = _resolve(device, dtype, self._device_tensor())
        self._release()
        canon = {k: self._buffers[k] for k in _CANONICAL}
        # the repacks (and a dense copy) read the canonical tensors on the device; moved back below if unused
        for key in (*_CANONICAL, "bias", "smooth"):
            if self._buffers[key] is not None:
                self._buffers[key] = self._buffers[key].to(device)
        self._device = device
        available = self.available_kernels(device, dtype) + (("dense",) if dense else ())
        plan, failed = None, set()
        while True:
            av = tuple(k for k in available if k not in failed)

            def plan_fn(a, columns):
                return self._plan(a, device, dtype, kernels, table, columns)
            # one layout per layer: each int4 kernel's plan with dequantize+cuBLAS from its layout, the decode
            # (smallest-M) kernel's kept unless another is as fast there and faster over all buckets
            plan = dispatch.plan_one_layout(plan_fn, av, _INT4_KINDS) if layouts == "one" else plan_fn(av, None)
            used = [k for k in dict.fromkeys(plan.kernels) if k in _INT4_KINDS]
            bad = next((k for k in used if k not in self._layout_keys and not self.attach_int4(k, device, dtype)),
                       None)
            if bad is None:
                break
            if kernels != "auto":  # a forced kernel whose repack refused this shape
                warnings.warn(f"QuantLinear: int4 {bad} kernel unavailable for [{self.out_features}x"
                              f"{self.in_features}]; using dequantize+cuBLAS instead")
                plan = dispatch.Plan(plan.bounds, tuple("dequant" if k == bad else k for k in plan.kernels),
                                     plan.configs, plan.source)
                break
            warnings.warn(f"QuantLinear: int4 {bad} kernel unavailable for [{self.out_features}x"
                          f"{self.in_features}]; planning without it")
            failed.add(bad)
        for name in [k for k in self._layout_keys if k not in plan.kernels]:  # built, then planned away
            self._drop_layout(name)
        self.use_layout_dequant(next(iter(self._layout_keys)) if "dequant" in plan.kernels and layouts == "one"
                                and self._layout_keys else None)
        self._set_dense(dense and "dense" in plan.kernels, dtype)
        needs_canonical = "reference" in plan.kernels or ("dequant" in plan.kernels and self._dequant_from is None)
        if not needs_canonical:  # exact package values stay on the host for state_dict / export
            for key, t in canon.items():
                self._buffers[key] = None if t is None else t.to("cpu")
            self._host_keys = _CANONICAL
        self._set_plan(plan)
        if self._dequant_from is not None:
            self.kernel += f" (dequant from the {self._dequant_from} layout)"
        return self

    def _plan(self, available: tuple, device, dtype, kernels: str, table, columns=None) -> dispatch.Plan:
        if kernels == "auto" and device.type != "cuda" and table is None:  # a given table plans anywhere
            return dispatch.uniform("reference", "cpu")
        return dispatch.plan_layer("int4" if self.bits == 4 else f"int{self.bits}", self.out_features,
                                   self.in_features, available, _table_for(device, kernels, table),
                                   str(dtype).replace("torch.", ""), kernels, columns)

    def _device_tensor(self) -> torch.Tensor:
        """A tensor on the device the layer computes on (the canonical tensors may be kept on the host)."""
        if self._device is not None:
            return torch.empty(0, device=self._device)
        return self.qweight

    @property
    def canonical_on_device(self) -> bool:
        """Whether the canonical tensors are held on the compute device (False: host-kept, see prepare)."""
        return "qweight" not in self._host_keys

    def _release(self):
        """Forget an earlier prepare: drop its layouts and dense copy (canonical tensors stay where they are)."""
        for name in list(self._layout_keys):
            self._drop_layout(name)
        self._int4_ops, self._layout_keys, self._dequant_op, self._dequant_from = {}, {}, None, None
        self._host_keys = ()
        self._set_dense(False, torch.float32)

    def _drop_layout(self, name: str):
        for key in self._layout_keys.pop(name, ()):
            delattr(self, key)
        self._int4_ops.pop(name, None)

    def _attach_layout_dequant(self, name: str):
        from sdquant.kernels import layout_dequant  # noqa: F401  (registers the ops)
        op = getattr(torch.ops.sdquant, _LAYOUT_DEQUANT[name])
        self._dequant_op = (op, [a.name for a in op.default._schema.arguments])

    def use_layout_dequant(self, name: Optional[str]) -> None:
        """Route the "dequant" path through the attached layout ``name`` ("cuda"|"triton"), or back to the
        canonical tensors (None). ``prepare`` decides this itself; bench/layout_dequant.py times each source."""
        if name is not None and name not in self._layout_keys:
            raise ConfigError("layouts", f"no {name} layout is attached to this layer (attached: "
                                         f"{', '.join(self._layout_keys) or 'none'})")
        self._dequant_from, self._dequant_op = name, None
        if name is not None:
            self._attach_layout_dequant(name)

    def attach_int4(self, name: str, device, dtype) -> bool:
        """Build the int4 helper's layout for kernel ``name`` ("triton"|"cuda") as non-persistent buffers."""
        got = self._int4_kernel(name, device, dtype)
        if got is None:
            return False
        op, layout = got
        keys = []
        for key, t in layout.items():
            attr = f"_{name}_{key}"
            if hasattr(self, attr):
                delattr(self, attr)
            self.register_buffer(attr, t, persistent=False)
            keys.append(attr)
        self._layout_keys[name] = keys
        self._int4_ops[name] = (op, [a.name for a in op.default._schema.arguments])
        return True

    # ------------------------------------------------------------------------------------------ kernels
    def _run(self, name: str, x: torch.Tensor, cfg) -> torch.Tensor:
        if self.smooth is not None:
            x = x / self.smooth.to(x.dtype)
        if name == "reference":
            return torch.ops.sdquant.int_linear(x, self.qweight, self.scales, self.zeros, self.g_idx, self.bias,
                                                self.bits, self.group_size, self.in_features)
        if name == "dense":
            return torch.nn.functional.linear(x, self._dense_weight, None if self.bias is None else
                                              self.bias.to(x.dtype))
        if name == "dequant":
            if self._dequant_from is not None:
                return self._call_layout(self._dequant_op, self._dequant_from, x)
            return torch.ops.sdquant.int_linear_dequant(x, self.qweight, self.scales, self.zeros, self.g_idx,
                                                        self.bias, self.bits, self.group_size, self.in_features)
        return self._call_layout(self._int4_ops[name], name, x)

    def _call_layout(self, op_args, name: str, x: torch.Tensor) -> torch.Tensor:
        """Call ``op`` with the buffers of layout ``name`` matched to its schema's argument names."""
        op, arg_names = op_args
        values = {"x": x, "bias": self.bias, "group_size": self.group_size, "bits": self.bits,
                  "in_features": self.in_features, "out_features": self.out_features,
                  "tail": self.plan.cuda_tail if self.plan is not None else 0}
        for attr in self._layout_keys[name]:
            values[attr[len(name) + 2:]] = getattr(self, attr)
        return op(**{a: values[a] for a in arg_names if a in values})

    # ------------------------------------------------------------------------------- fused decode-block ends
    def fused_why_not(self, m: int) -> Optional[str]:
        """Why ``forward_fused`` cannot serve M = ``m`` rows (None: it can). It needs the CUDA layout, the plan's
        "cuda" kernel at this M, 4 bits, no act-order, bias or unfolded AWQ scale, and a shape the fused tight kernel
        takes (``int4_cuda.fused_supported``)."""
        if "cuda" not in self._layout_keys:
            return "no CUDA layout attached (prepare on an sm_90 GPU)"
        if self.plan is None or self.plan.select(m)[0] != "cuda":
            return f"the plan does not run the CUDA kernel at M={m}"
        if self.bits != 4 or self.g_idx is not None or self.bias is not None or self.smooth is not None:
            return "act-order, bias and unfolded AWQ scales are not fused"
        from sdquant.kernels import int4_cuda
        return int4_cuda.fused_supported(m, self.out_features, self.in_features, self.group_size)

    def forward_fused(self, x: torch.Tensor, rms_ss: Optional[torch.Tensor] = None, eps: float = 0.0,
                      silu: bool = False, resid: Optional[torch.Tensor] = None,
                      gamma: Optional[torch.Tensor] = None):
        """``sdquant::w4a16_cuda_fused`` on this layer's CUDA layout: (y, y2, ss), see ``int4_cuda``'s fused op. Check
        ``fused_why_not`` first; ``silu`` needs the gate/up rows interleaved (``int4_cuda.interleave_gate_up``)."""
        from sdquant.kernels import int4_cuda  # noqa: F401  (registers the op)
        lay = {attr[len("cuda") + 2:]: getattr(self, attr) for attr in self._layout_keys["cuda"]}
        m = x.numel() // self.in_features
        cfg = int4_cuda.fused_config(m, self.out_features, self.in_features, x.dtype) if x.is_cuda else -1
        return torch.ops.sdquant.w4a16_cuda_fused(x, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"],
                                                  rms_ss, float(eps), bool(silu), resid, gamma, cfg)

    def forward_fused_rope(self, x: torch.Tensor, rms_ss: Optional[torch.Tensor], eps: float, kv: torch.Tensor,
                           input_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_cols: int) -> torch.Tensor:
        """``sdquant::w4a16_cuda_fused_rope`` on this layer's CUDA layout (a qkv projection): y = [rope(q), rope(k), v]
        with rope(k), v written at slot input_pos of the cache kv. Check ``fused_why_not`` and
        ``int4_cuda.rope_why_not`` first."""
        from sdquant.kernels import int4_cuda  # noqa: F401  (registers the op)
        lay = {attr[len("cuda") + 2:]: getattr(self, attr) for attr in self._layout_keys["cuda"]}
        m = x.numel() // self.in_features
        cfg = int4_cuda.fused_config(m, self.out_features, self.in_features, x.dtype) if x.is_cuda else -1
        return torch.ops.sdquant.w4a16_cuda_fused_rope(x, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"],
                                                       rms_ss, float(eps), kv, input_pos, cos, sin, int(q_cols), cfg)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.zeros is None}, kernel={self.kernel}")


class Fp8Linear(_Prepared):
    """W8A8 e4m3 linear: per-channel (or per-tensor) weight scales, static or dynamic per-token activation scales.
    A per-tensor weight with a static activation scale runs the tensorwise ``torch._scaled_mm`` where the plan
    picks cuBLASLt (large M); every other path reads the [N] scales.

    ``fuse_act_quant`` (class default True): under torch.compile the activations are quantized by plain torch
    ops that inductor fuses into the producing kernel, and only the GEMM is an sdquant op (see
    ``_run_prequantized``); False keeps the quantize kernel inside the op (the same-run baseline of bench/e2e.py)."""
    kind = "fp8"
    fuse_act_quant = True
    # cuBLASLt ``use_fast_accum`` on the ``_scaled_mm`` path (large M): see bench/fp8_fast_accum.py and
    # docs/benchmarks/fp8.md for what it costs in accuracy and gains in time. Class default; settable per layer.
    fast_accum = False

    def __init__(self, fw: Fp8Weight, bias: Optional[torch.Tensor] = None, smooth: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features, self.out_features = fw.in_features, fw.out_features
        self.register_buffer("weight", fw.weight)
        self.register_buffer("weight_scale", fw.weight_scale)
        self.register_buffer("input_scale", fw.input_scale)
        self.register_buffer("bias", bias)
        self.register_buffer("smooth", smooth)
        self._init_dispatch()

    @property
    def weight_q(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.input_scale)

    def available_kernels(self, device: torch.device, dtype: torch.dtype) -> tuple:
        names = ["reference", "dequant"]
        aligned = self.in_features % 16 == 0 and self.out_features % 16 == 0
        if device.type == "cuda":
            fp8_mma = torch.cuda.get_device_capability(device) >= (8, 9)
        else:
            fp8_mma = True  # torch's CPU _scaled_mm; Triton on CPU only in its interpreter
        if aligned and fp8_mma:
            names.append("scaled_mm")
            from sdquant.kernels import fp8_triton
            if fp8_triton.available() and (device.type == "cuda" or _interpreting()):
                names.append("triton")
        return tuple(names)

    def prepare(self, device=None, dtype=None, kernels: str = "auto", table=None,
                dense: bool = False) -> "Fp8Linear":
        """As ``QuantLinear.prepare``; for fp8, kernels="cuda" means cuBLASLt ``torch._scaled_mm`` (rowwise).
        The weight needs no repacking: [N, K] row-major is the K-major operand every fp8 path reads."""
        device, dtype = _resolve(device, dtype, self.weight)
        self.to(device)
        self.weight_scale = self.weight_scale.float().contiguous()
        # a per-tensor weight (every channel's scale equal) with a static activation scale: the _scaled_mm path runs
        # cuBLASLt's tensorwise kernel, given the one scale (ops._scaled_mm_fp8); one host sync, here only
        ws = self.weight_scale.reshape(-1)
        tensorwise = self.input_scale is not None and ws.numel() > 0 and bool((ws == ws[0]).all())
        self.register_buffer("_mm_weight_scale", ws[:1].clone() if tensorwise else None, persistent=False)
        available = self.available_kernels(device, dtype) + (("dense",) if dense else ())
        if kernels == "auto" and device.type != "cuda":
            plan = dispatch.uniform("reference", "cpu")
        else:
            plan = dispatch.plan_layer("fp8", self.out_features, self.in_features, available,
                                       _table_for(device, kernels, table), str(dtype).replace("torch.", ""),
                                       kernels)
        self._set_dense(dense and "dense" in plan.kernels, dtype)
        self._set_plan(plan)
        return self

    def _run(self, name: str, x: torch.Tensor, cfg) -> torch.Tensor:
        if name == "reference":
            if self.smooth is not None:  # divide in fp32, as the fused quantize kernels do, then quantize
                return torch.ops.sdquant.fp8_linear(x.float() / self.smooth.float(), self.weight,
                                                    self.weight_scale, self.input_scale, self.bias).to(x.dtype)
            return torch.ops.sdquant.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)
        if name in ("triton", "scaled_mm") and self.fuse_act_quant and torch.compiler.is_compiling():
            return self._run_prequantized(name, x, cfg)
        if name == "triton":
            return torch.ops.sdquant.fp8_linear_triton(x, self.weight, self.weight_scale, self.input_scale,
                                                       self.bias, self.smooth, list(cfg))
        if name == "scaled_mm":
            return torch.ops.sdquant.fp8_linear_scaled_mm(x, self.weight, self._scaled_mm_scale(), self.input_scale,
                                                          self.bias, self.smooth, bool(self.fast_accum))
        if name == "dense":  # W8A16: the cached dequantized weight, activations not quantized
            if self.smooth is not None:
                x = x / self.smooth.to(x.dtype)
            return torch.nn.functional.linear(x, self._dense_weight, None if self.bias is None else
                                              self.bias.to(x.dtype))
        return torch.ops.sdquant.fp8_linear_dequant(x, self.weight, self.weight_scale, self.input_scale,
                                                    self.bias, self.smooth)

    def _scaled_mm_scale(self) -> torch.Tensor:
        """The weight scale the _scaled_mm ops get: one element for a per-tensor weight under a static activation
        scale (tensorwise cuBLASLt), else the [N] channel scales (rowwise)."""
        ws = getattr(self, "_mm_weight_scale", None)
        return self.weight_scale if ws is None else ws

    def _run_prequantized(self, name: str, x: torch.Tensor, cfg) -> torch.Tensor:
        """Under torch.compile: the activation quantization as plain torch ops (ops.quantize_act_torch), which
        inductor fuses into the kernel that produced x, then the fp8 GEMM alone. Eager calls keep the fused
        Triton quantize kernel (there the torch ops would be several launches)."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        xq, xs = ops.quantize_act_torch(x2, self.smooth, self.input_scale)
        if name == "triton":
            y = torch.ops.sdquant.fp8_gemm_triton(xq, xs, self.weight, self.weight_scale, self.bias, x.dtype,
                                                  list(cfg))
        else:
            y = torch.ops.sdquant.fp8_gemm_scaled_mm(xq, xs, self.weight, self._scaled_mm_scale(), self.bias,
                                                     x.dtype, bool(self.fast_accum))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        mode = "static" if self.input_scale is not None else "dynamic"
        tw = ", tensorwise" if getattr(self, "_mm_weight_scale", None) is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, act={mode}{tw}, "
                f"kernel={self.kernel}")
