"""What a prepared QuantLinear keeps on its device (issue 6: INT4 weights <= 4.5 GB on the GPU).

Plans are forced through ``table=`` dicts (a given table plans on the CPU too). Triton layouts run in Triton's
interpreter on CPU tensors; the CUDA C++ kernel's layout is real (``int4_layout.repack_cuda``) and its op
evaluates the layout with PyTorch on CPU tensors, so ``_cuda_kernel_runs`` is substituted to let prepare build
it here. Outputs are compared with the reference op over the canonical tensors at one M per bucket.
"""
import contextlib
import os
import warnings

import pytest
import torch

from sdquant.errors import ConfigError
from sdquant.kernels import int4_layout, linear
from sdquant.kernels.linear import QuantLinear
from sdquant.quant.qtensor import QuantizedWeight

pytest.importorskip("triton")

BUCKETS = [1, 16, 64, 256, 4096]
N, K, GS = 128, 256, 64
DT = torch.float16
MS = (1, 16, 40, 70)  # one M per bucket of the tables below (70 > 64: the large-M bucket)

# us per bucket; the decode kernel at M=1 differs between the tables
CUDA_TRITON_DEQUANT = {"cuda": [5, 6, 20, 80, 900], "triton": [7, 7, 12, 60, 800], "dequant": [20, 20, 21, 30, 300]}
TRITON_CUDA_DEQUANT = {"cuda": [9, 6, 20, 80, 900], "triton": [7, 7, 30, 60, 800], "dequant": [20, 20, 21, 30, 300]}
# H100-like 4096x4096 (crossover_h100.json): Triton wins M = 1 by 1%, CUDA the buckets above, dequant the last
NEAR_TIE_AT_1 = {"cuda": [8.2, 8.5, 14.9, 22.6, 62.0], "triton": [8.1, 10.3, 13.7, 29.7, 92.0],
                 "dequant": [25.3, 25.9, 24.9, 32.6, 58.4]}
CUDA_ONLY = {"cuda": [5, 6, 7, 8, 9], "triton": [7, 7, 12, 60, 800], "dequant": [20, 20, 21, 30, 300]}


def _table(us, n=N, k=K):
    return {"version": 1, "device": "test", "buckets": BUCKETS,
            "entries": [{"kind": "int4", "N": n, "K": k, "dtype": "float16", "us": us}]}


@pytest.fixture
def gpu_like(monkeypatch):
    """Triton in its interpreter and the CUDA kernel's layout built on the host (see module docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_cuda_kernel_runs", lambda device: True)


def _qw(bits=4, sym=False, act=True, n=N, k=K, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    groups = k // GS
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.05 + 0.01).half()
    zeros = None if sym else torch.randint(0, 1 << bits, (n, groups), generator=g, dtype=torch.uint8)
    g_idx = (torch.randperm(k, generator=g) // GS).to(torch.int32) if act else None
    return QuantizedWeight.from_codes(codes, scales, zeros, bits, GS, g_idx)


def _layer(qw):
    return QuantLinear(qw, (torch.randn(qw.out_features, generator=torch.Generator().manual_seed(1)) * 0.1).to(DT))


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@contextlib.contextmanager
def _no_interpreter():
    """dequant_triton wraps its kernel at import (test_fp8_triton runs it interpreted in a child process), so
    the canonical dequant path must not see TRITON_INTERPRET=1 here: it then runs the PyTorch reference."""
    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


def _check_outputs(layer, qw, expect_kernels):
    x = torch.randn(max(MS), qw.in_features, generator=torch.Generator().manual_seed(2)).to(DT)
    for m, want in zip(MS, expect_kernels):
        assert layer.plan.select(m)[0] == want, (m, layer.kernel)
        ref = torch.ops.sdquant.int_linear(x[:m].double(), qw.qweight, qw.scales, qw.zeros, qw.g_idx,
                                           layer.bias.double(), qw.bits, qw.group_size, qw.in_features)
        canonical_dequant = want == "dequant" and layer._dequant_from is None
        with _no_interpreter() if canonical_dequant else contextlib.nullcontext():
            y = layer(x[:m])
        assert y.dtype == DT and y.shape == (m, qw.out_features)
        assert float((y.double() - ref).norm() / ref.norm()) < 2e-3, (m, want)


def _layouts(layer):
    return sorted({b.split("_")[1] for b, _ in layer.named_buffers() if b.startswith("_")})


# ------------------------------------------------------------------------------------- the default: one layout
@pytest.mark.parametrize("us,kept,kernels_at_ms", [
    # the table wants cuda, triton, dequant: triton's buckets go to cuda (M<=64 here) and dequant
    (CUDA_TRITON_DEQUANT, "cuda", ("cuda", "cuda", "cuda", "dequant")),
    # triton is the decode kernel: it is kept, cuda's bucket goes to triton
    (TRITON_CUDA_DEQUANT, "triton", ("triton", "triton", "dequant", "dequant")),
    # a near-tie at M = 1 does not decide alone: the plan with the CUDA layout is faster over the buckets
    (NEAR_TIE_AT_1, "cuda", ("cuda", "cuda", "cuda", "cuda")),
])
def test_one_layout_serves_every_bucket(gpu_like, us, kept, kernels_at_ms):
    qw = _qw()
    layer = _layer(qw)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.prepare("cpu", DT, table=_table(us))
    assert _layouts(layer) == [kept]
    assert layer._dequant_from == kept and f"(dequant from the {kept} layout)" in layer.kernel
    assert not layer.canonical_on_device
    layout = (int4_layout.repack_cuda if kept == "cuda" else int4_layout.repack_triton)(qw, DT)
    assert layer.device_bytes() == _nbytes(layout.values()) + _nbytes([layer.bias])
    _check_outputs(layer, qw, kernels_at_ms)
    # the canonical tensors are untouched: state_dict (what export reads) is exactly the package's
    sd = layer.state_dict()
    assert sorted(sd) == sorted(before) and all(torch.equal(sd[k], before[k]) for k in before)


def test_all_layouts_keeps_the_fastest_kernel_per_bucket(gpu_like):
    qw = _qw()
    layer = _layer(qw).prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT), layouts="all")
    assert _layouts(layer) == ["cuda", "triton"] and layer.canonical_on_device and layer._dequant_from is None
    canonical = _nbytes([qw.qweight, qw.scales, qw.zeros, qw.g_idx])
    both = _nbytes(int4_layout.repack_cuda(qw, DT).values()) + _nbytes(int4_layout.repack_triton(qw, DT).values())
    assert layer.device_bytes() == both + canonical + _nbytes([layer.bias])
    _check_outputs(layer, qw, ("cuda", "cuda", "triton", "dequant"))
    # and back to one layout: the second prepare drops what the first built
    layer.prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT))
    assert _layouts(layer) == ["cuda"] and not layer.canonical_on_device
    with pytest.raises(ConfigError, match="layouts"):
        layer.prepare("cpu", DT, layouts="fastest")


def test_a_kernel_fast_at_every_m_needs_nothing_else(gpu_like):
    qw = _qw(sym=True, act=False)
    layer = _layer(qw).prepare("cpu", DT, table=_table(CUDA_ONLY))
    assert layer.plan.kernels == ("cuda",) and _layouts(layer) == ["cuda"] and layer._dequant_from is None
    assert "dequant" not in layer.kernel and not layer.canonical_on_device
    assert layer.device_bytes() == _nbytes(int4_layout.repack_cuda(qw, DT).values()) + _nbytes([layer.bias])
    _check_outputs(layer, qw, ("cuda",) * 4)


@pytest.mark.parametrize("kernels,layout,canonical", [
    ("cuda", "cuda", False), ("triton", "triton", False), ("torch", None, True), ("reference", None, True)])
def test_forced_modes(gpu_like, kernels, layout, canonical):
    qw = _qw()
    layer = _layer(qw).prepare("cpu", DT, kernels=kernels)
    assert _layouts(layer) == ([layout] if layout else []) and layer.canonical_on_device is canonical
    want = _nbytes([qw.qweight, qw.scales, qw.zeros, qw.g_idx]) if canonical else 0
    if layout:
        want += _nbytes((int4_layout.repack_cuda if layout == "cuda" else int4_layout.repack_triton)(qw, DT).values())
    assert layer.device_bytes() == want + _nbytes([layer.bias])
    _check_outputs(layer, qw, ({"torch": "dequant"}.get(kernels, kernels),) * 4)


def test_without_the_cuda_kernel_triton_is_the_one_layout(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # _cuda_kernel_runs is the real one: False on a CPU
    qw = _qw()
    layer = _layer(qw).prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT))
    assert "cuda" not in layer.available_kernels(torch.device("cpu"), DT)
    assert _layouts(layer) == ["triton"] and layer._dequant_from == "triton"
    _check_outputs(layer, qw, ("triton", "triton", "triton", "dequant"))


def test_a_layout_the_shape_refuses_is_planned_around(gpu_like):
    qw = _qw(n=96)  # N % 64 != 0: the CUDA layout refuses, Triton's (N % 32) accepts
    layer = _layer(qw)
    with pytest.warns(UserWarning, match="int4 cuda kernel unavailable .* planning without it"):
        layer.prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT, n=96))
    assert _layouts(layer) == ["triton"] and layer._dequant_from == "triton" and not layer.canonical_on_device
    _check_outputs(layer, qw, ("triton", "triton", "triton", "dequant"))


def test_non_4bit_layers_keep_the_canonical_tensors(gpu_like):
    qw = _qw(bits=8)
    layer = _layer(qw).prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT))
    assert layer.plan.kernels == ("dequant",) and _layouts(layer) == [] and layer.canonical_on_device
    assert layer.device_bytes() == _nbytes([qw.qweight, qw.scales, qw.zeros, qw.g_idx, layer.bias])
    _check_outputs(layer, qw, ("dequant",) * 4)


def test_auto_on_a_cpu_without_a_table_is_the_reference():
    qw = _qw()
    layer = _layer(qw).prepare("cpu", torch.float32)
    assert layer.plan.kernels == ("reference",) and layer.canonical_on_device
    assert layer.device_bytes() == _nbytes([qw.qweight, qw.scales, qw.zeros, qw.g_idx, layer.bias])


# ------------------------------------------------------------------------ host-kept canonical tensors stay put
def test_module_to_leaves_host_kept_canonical_tensors(gpu_like):
    qw = _qw()
    layer = _layer(qw).prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT))
    layer.to("meta")  # stands in for .cuda(): layouts move, the host-kept canonical tensors do not
    assert layer._cuda_qweight.device.type == "meta" and layer.bias.device.type == "meta"
    assert all(t.device.type == "cpu" for t in (layer.qweight, layer.scales, layer.zeros, layer.g_idx))
    assert torch.equal(layer.qweight, qw.qweight)


def test_prepared_model_exports_the_canonical_tensors(gpu_like, tmp_path):
    """export_model (what `sdquant export` runs on a loaded model) reads weight_q: host-kept canonical tensors
    export exactly, whichever layouts prepare built."""
    transformers = pytest.importorskip("transformers")
    from sdquant.export.hf import export_model, import_hf_checkpoint
    from sdquant.runtime.testing import quantize_model_rtn
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = quantize_model_rtn(transformers.LlamaForCausalLM(cfg).eval(), 4, 32, symmetric=True)
    qmods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    want = {n: m.weight_q for n, m in qmods.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k/v_proj [32x64]: the CUDA layout refuses N=32, Triton serves them
        for m in qmods.values():
            m.prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT, m.out_features, m.in_features))
    assert all(not m.canonical_on_device and len(m._layout_keys) == 1 for m in qmods.values())
    ck = import_hf_checkpoint(export_model(model, tmp_path / "gptq", format="gptq"))
    for n, w in want.items():
        got = ck.quant_layers[n][0]
        assert torch.equal(got.codes(), w.codes()) and torch.equal(got.scales, w.scales), n


def test_compile_fullgraph_over_cuda_and_layout_dequant(gpu_like):
    qw = _qw()
    layer = _layer(qw).prepare("cpu", DT, table=_table(CUDA_TRITON_DEQUANT))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for m in (3, 70):  # the cuda bucket and the dequant-from-layout bucket
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(DT)
        torch.testing.assert_close(compiled(x), layer(x))


def test_layout_dequant_is_timed_by_its_own_column_where_measured(gpu_like):
    us = {"cuda": [5, 6, 40, 80, 900], "triton": [7, 7, 12, 60, 800], "dequant": [20, 20, 21, 30, 300]}
    qw = _qw()
    layer = _layer(qw).prepare("cpu", DT, table=_table(us))
    assert [layer.plan.select(m)[0] for m in (16, 40, 200)] == ["cuda", "dequant", "dequant"]
    # dequantizing from the CUDA layout measured slower than from the canonical tensors: cuda keeps M <= 256
    layer.prepare("cpu", DT, table=_table(dict(us, dequant_cuda=[20, 20, 45, 90, 310])))
    assert [layer.plan.select(m)[0] for m in (16, 40, 200, 300)] == ["cuda", "cuda", "cuda", "dequant"]
    assert _layouts(layer) == ["cuda"] and layer._dequant_from == "cuda"
    # the column is only a timing source: layouts="all" dequantizes the canonical tensors, timed by "dequant"
    layer.prepare("cpu", DT, table=_table(dict(us, dequant_cuda=[20, 20, 45, 90, 310])), layouts="all")
    assert [layer.plan.select(m)[0] for m in (16, 40, 200)] == ["cuda", "triton", "dequant"]


@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_layout_dequant_ops_pass_opcheck(name):
    from sdquant.kernels import layout_dequant  # noqa: F401  (registers the ops)
    qw = _qw()
    lay = (int4_layout.repack_cuda if name == "cuda" else int4_layout.repack_triton)(qw, DT)
    third = lay["zeros"] if name == "cuda" else lay["zs"]
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0)).to(DT)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DT)
    op = getattr(torch.ops.sdquant, f"w4a16_dequant_{name}")
    torch.library.opcheck(op.default, (x, lay["qweight"], lay["scales"], third, lay["perm"], bias))
    ref = x.double() @ qw.dequantize(torch.float64).t() + bias.double()
    y = op(x, lay["qweight"], lay["scales"], third, lay["perm"], bias)
    assert float((y.double() - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("n,k,gs,sym,act", [(128, 256, 64, True, False), (192, 512, 32, False, True),
                                            (64, 128, -1, False, False)])
def test_layout_dequant_kernels_are_exact(monkeypatch, n, k, gs, sym, act):
    """The Triton kernels (interpreted) write exactly the layout's meaning, K in the layout's permuted order."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from sdquant.kernels import layout_dequant as D
    g = torch.Generator().manual_seed(n)
    groups = 1 if gs == -1 else k // gs
    qw = QuantizedWeight.from_codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                                    (torch.rand(n, groups, generator=g) * 0.1 + 0.01).half(),
                                    None if sym else torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8),
                                    4, gs, (torch.randperm(k, generator=g) // gs).to(torch.int32) if act else None)
    lt, lc = int4_layout.repack_triton(qw, torch.bfloat16), int4_layout.repack_cuda(qw, torch.bfloat16)
    wt = D.dequant_triton_layout(lt["qweight"], lt["scales"], lt["zs"], torch.float32)       # [K, N]
    wc = D.dequant_cuda_layout(lc["qweight"], lc["scales"], lc["zeros"], torch.float32)      # [N, K]
    assert torch.equal(wt.t(), int4_layout.dequantize_triton(dict(lt, perm=None)))
    assert torch.equal(wc, int4_layout.dequantize_cuda(dict(lc, perm=None)))
    # the CUDA layout keeps fp16 scales and integer zeros: exactly the canonical dequantization
    perm = torch.arange(k) if lc["perm"] is None else lc["perm"].long()
    assert torch.equal(wc, qw.dequantize(torch.float32)[:, perm])
