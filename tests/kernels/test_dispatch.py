"""Dispatch decisions from a given crossover table (pure logic), table validation and atomic writing,
QuantLinear / Fp8Linear.prepare on CPU, and torch.compile(fullgraph=True) over a multi-bucket plan."""
import json
import math

import pytest
import torch

from sdquant.errors import ConfigError
from sdquant.kernels import dispatch
from sdquant.kernels.linear import Fp8Linear, QuantLinear
from sdquant.quant.qtensor import QuantizedWeight, compute_qparams, quantize_codes, quantize_fp8_weight

BUCKETS = [1, 16, 64, 256, 4096]


def _table(**extra):
    fp8 = {"kind": "fp8", "N": 4096, "K": 14336, "dtype": "bfloat16",
           "us": {"bf16": [33, 34, 40, 90, 1000], "triton": [15, 16, 25, 95, 2000],
                  "scaled_mm": [30, 31, 33, 60, 540], "dequant": [80, 80, 85, 120, 1100]},
           "triton_config": [[64, 16, 256, 4, 4, 4], [64, 16, 256, 2, 4, 4], [128, 64, 256, 1, 4, 3], None, None]}
    fp8_big = dict(fp8, N=28672, K=8192, us={"triton": [50, 50, 90, 300, 9000], "scaled_mm": [60, 61, 62, 100, 1400]},
                   triton_config=None)
    int4 = {"kind": "int4", "N": 4096, "K": 4096, "dtype": "bfloat16",
            "us": {"cuda": [5, 6, 20, 80, 900], "triton": [7, 7, 12, 60, 800], "dequant": [20, 20, 21, 30, 300]}}
    t = {"version": 1, "device": "test", "buckets": BUCKETS, "entries": [fp8, fp8_big, int4]}
    t.update(extra)
    return t


ALL_FP8 = ("reference", "dequant", "scaled_mm", "triton")


def test_plan_picks_fastest_per_bucket_and_merges_ranges():
    plan = dispatch.plan_layer("fp8", 4096, 14336, ALL_FP8, _table())
    assert plan.source == "table:4096x14336"
    # 1, 16 and 64 share the kernel but not the tile config, so they stay separate ranges
    assert plan.kernels == ("triton", "triton", "triton", "scaled_mm")
    assert plan.bounds == (1, 16, 64, 4096)
    assert plan.select(1) == ("triton", (64, 16, 256, 4, 4, 4))
    assert plan.select(2) == ("triton", (64, 16, 256, 2, 4, 4))
    assert plan.select(64) == ("triton", (128, 64, 256, 1, 4, 3))
    assert plan.select(65)[0] == "scaled_mm" and plan.select(10 ** 6)[0] == "scaled_mm"


def test_plan_compresses_identical_neighbours():
    t = _table()
    t["entries"][0]["triton_config"] = None
    plan = dispatch.plan_layer("fp8", 4096, 14336, ALL_FP8, t)
    assert plan.bounds == (64, 4096) and plan.kernels == ("triton", "scaled_mm")
    assert plan.describe() == "M1-64:triton M65+:scaled_mm"


def test_unavailable_kernels_are_skipped():
    plan = dispatch.plan_layer("fp8", 4096, 14336, ("reference", "dequant", "scaled_mm"), _table())
    assert set(plan.kernels) == {"scaled_mm"}
    plan = dispatch.plan_layer("int4", 4096, 4096, ("reference", "dequant"), _table())
    assert plan.kernels == ("dequant",)
    plan = dispatch.plan_layer("int4", 4096, 4096, ("reference", "dequant", "triton", "cuda"), _table())
    assert [plan.select(m)[0] for m in (1, 16, 64, 256, 5000)] == ["cuda", "cuda", "triton", "dequant", "dequant"]


def test_dense_copy_wins_where_bf16_is_fastest():
    # the fp8 entry's bf16 column beats everything at M=4096 only... except scaled_mm: never dense there
    plan = dispatch.plan_layer("fp8", 4096, 14336, ALL_FP8 + ("dense",), _table())
    assert "dense" not in plan.kernels
    t = _table()
    t["entries"][2]["us"]["bf16"] = [30, 30, 30, 20, 200]  # int4: bf16 fastest from M=256 on
    plan = dispatch.plan_layer("int4", 4096, 4096, ("reference", "dequant", "triton", "cuda", "dense"), t)
    assert [plan.select(m)[0] for m in (1, 64, 200, 5000)] == ["cuda", "triton", "dense", "dense"]
    plan = dispatch.plan_layer("int4", 4096, 4096, ("reference", "dequant", "triton", "cuda"), t)
    assert plan.select(5000)[0] == "dequant"  # without the opt-in copy


def test_nearest_shape_is_used_for_unmeasured_layers():
    t = _table()
    assert dispatch.nearest_entry(t, "fp8", 4000, 14000)["N"] == 4096
    assert dispatch.nearest_entry(t, "fp8", 30000, 8000)["N"] == 28672
    assert dispatch.nearest_entry(t, "int8", 1, 1) is None
    plan = dispatch.plan_layer("fp8", 28000, 8192, ALL_FP8, t)
    assert plan.source == "table:28672x8192" and plan.select(1)[0] == "triton" and plan.select(64)[0] == "scaled_mm"


def test_defaults_without_table():
    plan = dispatch.plan_layer("fp8", 64, 64, ALL_FP8, None)
    assert plan.select(1)[0] == "triton" and plan.select(64)[0] == "triton" and plan.select(65)[0] == "scaled_mm"
    plan = dispatch.plan_layer("int4", 64, 64, ("reference", "dequant", "triton", "cuda"), None)
    assert [plan.select(m)[0] for m in (1, 16, 17, 64, 65)] == ["cuda", "cuda", "triton", "triton", "dequant"]
    plan = dispatch.plan_layer("int3", 64, 64, ("reference", "dequant"), _table())
    assert plan.kernels == ("dequant",)


def test_forced_modes_and_errors():
    assert dispatch.plan_layer("fp8", 8, 8, ALL_FP8, _table(), mode="cuda").kernels == ("scaled_mm",)
    assert dispatch.plan_layer("int4", 8, 8, ("reference", "dequant"), None, mode="torch").kernels == ("dequant",)
    with pytest.raises(ConfigError, match="kernels"):
        dispatch.plan_layer("fp8", 8, 8, ALL_FP8, None, mode="fastest")
    with pytest.raises(ConfigError, match="cuda int4 kernel, which cannot run"):
        dispatch.plan_layer("int4", 8, 8, ("reference", "dequant"), None, mode="cuda")


@pytest.mark.parametrize("mutate,field", [
    (lambda t: t.update(version=2), "kernels.table"),
    (lambda t: t.update(buckets=[4, 1]), "kernels.table.buckets"),
    (lambda t: t["entries"][0]["us"].update(triton=[1, 2]), "kernels.table.entries[0].us.triton"),
    (lambda t: t["entries"][0]["us"].update(triton=[1, 2, 3, 4, -5]), "kernels.table.entries[0].us.triton"),
    (lambda t: t["entries"][1].update(N=0), "kernels.table.entries[1].N"),
    (lambda t: t["entries"][2].update(kind="int5"), "kernels.table.entries[2]"),
    (lambda t: t["entries"][0].update(triton_config=[[1, 2]] * 5), "kernels.table.entries[0].triton_config"),
])
def test_bad_tables_are_rejected(mutate, field):
    t = _table()
    mutate(t)
    with pytest.raises(ConfigError) as e:
        dispatch.validate_table(t)
    assert e.value.field == field


def test_write_and_load_roundtrip(tmp_path):
    p = dispatch.write_table(_table(), tmp_path / "sub" / "t.json")
    assert dispatch.load_table(p) == _table()
    assert [f.name for f in p.parent.iterdir()] == ["t.json"]  # no temp file left behind
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        dispatch.load_table(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="does not exist"):
        dispatch.load_table(tmp_path / "missing.json")
    with pytest.raises(ConfigError):  # invalid tables are never written
        dispatch.write_table({"version": 1}, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_shipped_table_is_valid():
    if not dispatch.SHIPPED_TABLE.exists():
        pytest.skip("no measured table shipped yet")
    t = dispatch.load_table()
    assert t["entries"] and all(e["kind"] in ("fp8", "int4") for e in t["entries"])


# ------------------------------------------------------------------------------------------ modules
def _int4_layer(bias=True, smooth=False):
    g = torch.Generator().manual_seed(0)
    n, k, gs = 48, 128, 32
    w = torch.randn(n, k, generator=g)
    s, z = compute_qparams(w, 4, gs, False)
    qw = QuantizedWeight.from_codes(quantize_codes(w, s, z, 4, gs), s, z, 4, gs)
    return QuantLinear(qw, torch.randn(n, generator=g) if bias else None,
                       torch.rand(k, generator=g) + 0.5 if smooth else None)


def _fp8_layer(bias=True, smooth=False, static=False):
    g = torch.Generator().manual_seed(0)
    n, k = 48, 128
    fw = quantize_fp8_weight(torch.randn(n, k, generator=g) / math.sqrt(k),
                             torch.tensor(0.01) if static else None)
    return Fp8Linear(fw, torch.randn(n, generator=g) if bias else None,
                     torch.rand(k, generator=g) + 0.5 if smooth else None)


@pytest.mark.parametrize("make", [_int4_layer, _fp8_layer])
def test_prepare_on_cpu(make):
    layer = make(smooth=True)
    keys = sorted(layer.state_dict())
    x = torch.randn(2, 7, layer.in_features)
    before = layer(x)  # unprepared = reference op
    assert layer.prepare("cpu") is layer and layer.plan.kernels == ("reference",)
    torch.testing.assert_close(layer(x), before)
    layer.prepare("cpu", torch.float32, kernels="torch")
    assert layer.plan.kernels == ("dequant",)
    torch.testing.assert_close(layer(x), before, rtol=1e-4, atol=1e-4)
    assert sorted(layer.state_dict()) == keys  # kernel layouts never enter the state dict
    assert "kernel=M1+:dequant" in repr(layer)
    with pytest.raises(ConfigError):
        layer.prepare("cpu", torch.int8)


@pytest.mark.parametrize("make", [_int4_layer, _fp8_layer])
def test_dense_path_on_cpu(make):
    layer = make(smooth=True)
    x = torch.randn(5, layer.in_features)
    ref = layer(x)
    layer._set_dense(True, torch.float32)
    layer._set_plan(dispatch.uniform("dense", "test"))
    # int4: same weights exactly; fp8 dense is W8A16 (activations unquantized), so only close
    tol = 1e-5 if isinstance(layer, QuantLinear) else 5e-2
    assert float((layer(x) - ref).norm() / ref.norm()) < tol
    assert "_dense_weight" not in layer.state_dict()


def test_prepare_rejects_missing_kernels_on_cpu():
    with pytest.raises(ConfigError, match="cannot run"):
        _int4_layer().prepare("cpu", torch.bfloat16, kernels="cuda")


@pytest.mark.parametrize("make,kernels", [(_fp8_layer, ("reference", "dequant", "scaled_mm")),
                                         (_int4_layer, ("reference", "dequant"))])
def test_compile_fullgraph_over_a_multi_bucket_plan(make, kernels):
    layer = make(smooth=True)
    t = _table()
    for e in t["entries"]:
        e.update(N=layer.out_features, K=layer.in_features)
        e["us"] = {"reference": [1, 1, 9, 9, 9], "dequant": [9, 9, 1, 1, 1], "scaled_mm": [5, 5, 5, 5, 5]}
        e.pop("triton_config", None)
    kind = "fp8" if isinstance(layer, Fp8Linear) else "int4"
    layer._set_plan(dispatch.plan_layer(kind, layer.out_features, layer.in_features, kernels, t))
    assert layer.plan.describe() == "M1-16:reference M17+:dequant"
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for m in (3, 40):  # one shape per range: both branches are traced
        x = torch.randn(m, layer.in_features)
        torch.testing.assert_close(compiled(x), layer(x))


def test_compile_with_dynamic_batch():
    layer = _fp8_layer()
    t = _table()
    for e in t["entries"]:
        e.update(N=layer.out_features, K=layer.in_features)
        e["us"] = {"reference": [1, 1, 9, 9, 9], "dequant": [9, 9, 1, 1, 1]}
        e.pop("triton_config", None)
    layer._set_plan(dispatch.plan_layer("fp8", layer.out_features, layer.in_features, ("reference", "dequant"), t))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (2, 5, 17, 70):
        x = torch.randn(m, layer.in_features)
        torch.testing.assert_close(compiled(x), layer(x))


def test_measure_crossovers_without_gpu_is_a_config_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        dispatch.measure_crossovers(tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_wrong_input_width_is_a_shape_error():
    from sdquant.errors import ShapeError
    with pytest.raises(ShapeError, match="expects 128"):
        _fp8_layer()(torch.randn(2, 64))


# ------------------------------------------------------------------- which table a GPU layer plans from
def test_the_table_named_by_the_environment_replaces_the_shipped_one(tmp_path, monkeypatch):
    """$SDQUANT_KERNEL_TABLE (e.g. the output of `sdquant tune-kernels`) is what a GPU layer with no table passed
    plans from; a missing file is a ConfigError naming the variable. (No GPU is touched: the table is only read.)"""
    from sdquant.kernels import linear
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(_table(device="NVIDIA H100 80GB HBM3")))
    monkeypatch.setenv(linear.TABLE_ENV, str(path))
    got = linear._table_for(torch.device("cuda"), "auto", None)
    assert got["device"] == "NVIDIA H100 80GB HBM3" and got["buckets"] == BUCKETS
    assert linear._table_for(torch.device("cpu"), "auto", None) is None      # a CPU layer keeps the reference op
    assert linear._table_for(torch.device("cuda"), "reference", None) is None
    monkeypatch.setenv(linear.TABLE_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(ConfigError) as e:
        linear._table_for(torch.device("cuda"), "auto", None)
    assert e.value.field == linear.TABLE_ENV and "absent.json" in str(e.value)


def test_a_gpu_unlike_the_shipped_tables_is_warned_once(monkeypatch):
    """Planning from the shipped table on another GPU model warns once a process and model, naming both GPUs and the
    way to measure this one; the table's own GPU, or a table passed in, is not warned about."""
    from sdquant.kernels import linear
    if not dispatch.SHIPPED_TABLE.exists():
        pytest.skip("this build ships no crossover table")
    monkeypatch.delenv(linear.TABLE_ENV, raising=False)
    monkeypatch.setattr(linear, "_WARNED_DEVICES", set())
    shipped = dispatch.load_table()["device"]
    name = {"gpu": "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["gpu"])
    with pytest.warns(UserWarning, match=f"measured on {shipped}, this GPU is NVIDIA A100-SXM4-80GB") as rec:
        linear._table_for(torch.device("cuda"), "auto", None)
    assert "tune-kernels" in str(rec[0].message) and linear.TABLE_ENV in str(rec[0].message)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear._table_for(torch.device("cuda"), "auto", None)            # the same model: no second warning
        linear._table_for(torch.device("cuda"), "auto", _table())          # a table passed in: none
        name["gpu"] = shipped
        linear._table_for(torch.device("cuda"), "auto", None)            # the table's own GPU: none


def test_each_gpu_model_plans_from_the_shipped_table_measured_on_it(tmp_path, monkeypatch):
    """Shipped tables (crossover_*.json) are chosen by the GPU model they name: an H100 plans from the H100's table
    with no warning, a model no table names falls back to the default (the H200's) with the warning, and files that
    are not tables are never chosen by name. (No GPU is touched: the device name is patched.)"""
    from sdquant.kernels import linear
    monkeypatch.delenv(linear.TABLE_ENV, raising=False)
    monkeypatch.setattr(linear, "_WARNED_DEVICES", set())
    (tmp_path / "crossover_h200.json").write_text(json.dumps(_table(device="NVIDIA H200")))
    h100 = _table(device="NVIDIA H100 80GB HBM3")
    h100["entries"][2]["us"]["cuda"] = [4, 5, 19, 79, 899]  # tell the two tables apart
    (tmp_path / "crossover_h100.json").write_text(json.dumps(h100))
    (tmp_path / "crossover_junk.json").write_text("[1, 2")
    monkeypatch.setattr(dispatch, "SHIPPED_DIR", tmp_path)
    name = {"gpu": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["gpu"])
    assert dispatch.shipped_table("NVIDIA H100 80GB HBM3") == tmp_path / "crossover_h100.json"
    assert dispatch.shipped_table("NVIDIA A100-SXM4-80GB") == tmp_path / "crossover_h200.json"
    assert dispatch.shipped_table(None) == tmp_path / "crossover_h200.json"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = linear._table_for(torch.device("cuda"), "auto", None)
    assert got["device"] == "NVIDIA H100 80GB HBM3" and got["entries"][2]["us"]["cuda"][0] == 4
    name["gpu"] = "NVIDIA A100-SXM4-80GB"
    with pytest.warns(UserWarning, match="measured on NVIDIA H200, this GPU is NVIDIA A100-SXM4-80GB"):
        got = linear._table_for(torch.device("cuda"), "auto", None)
    assert got["device"] == "NVIDIA H200"


# ------------------------------------------------------------------- tune-kernels over several runs
def test_a_resumed_tuning_run_keeps_what_the_earlier_one_measured(tmp_path):
    """`sdquant tune-kernels --resume`: an earlier run's table on the same GPU model, buckets, dtype and group size
    is kept and only the missing (shape, kind) pairs are measured; a table from anything else is a ConfigError
    naming --resume and what differs; no file is nothing to keep. (The timing itself needs a GPU; this is the
    bookkeeping around it.)"""
    from sdquant.kernels import crossover
    path = tmp_path / "t.json"
    assert dispatch.resumable_entries(path, "NVIDIA H100 80GB HBM3", BUCKETS) == []
    earlier = _table(device="NVIDIA H100 80GB HBM3", meta={"dtype": "bfloat16", "group_size": 128})
    dispatch.write_table(earlier, path)
    kept = dispatch.resumable_entries(path, "NVIDIA H100 80GB HBM3", BUCKETS)
    assert [(e["kind"], e["K"], e["N"]) for e in kept] == [("fp8", 14336, 4096), ("fp8", 8192, 28672),
                                                           ("int4", 4096, 4096)]
    shapes = [(14336, 4096), (4096, 4096), (8192, 28672)]
    assert crossover.todo(shapes, ("fp8", "int4"), kept, "bfloat16") == [(14336, 4096, "int4"), (4096, 4096, "fp8"),
                                                                      (8192, 28672, "int4")]
    assert len(crossover.todo(shapes, ("fp8", "int4"), kept, "float16")) == 6  # other-dtype entries do not count
    for args, what in [(("NVIDIA H200", BUCKETS), "GPU NVIDIA H100 80GB HBM3"),
                       (("NVIDIA H100 80GB HBM3", [1, 16, 64]), "buckets"),
                       (("NVIDIA H100 80GB HBM3", BUCKETS, "float16"), "dtype bfloat16"),
                       (("NVIDIA H100 80GB HBM3", BUCKETS, "bfloat16", 64), "group size 128")]:
        with pytest.raises(ConfigError) as e:
            dispatch.resumable_entries(path, *args)
        assert e.value.field == "--resume" and what in str(e.value)


def test_cuda_tail_rows_from_the_table_times():
    """cuda_tail_rows: the largest of 16 / 32 / 64 rows whose launch plus 128 rows' stays under 0.9 of one 256-row
    launch by the table; none where a bucket it needs is missing or untimed."""
    b = [1, 16, 32, 64, 128, 256, 1024]
    #            1   16  32  64  128  256  1024
    wide = [38, 50, 60, 77, 92, 188, 700]     # H100-like 8192x28672: 142 / 152 / 169 against 0.9 x 188 = 169.2
    assert dispatch.cuda_tail_rows(b, wide) == 64
    assert dispatch.cuda_tail_rows(b, [38, 50, 60, 80, 92, 188, 700]) == 32       # 172 is over the margin
    assert dispatch.cuda_tail_rows(b, [7, 10, 12, 15, 17, 22, 60]) == 0           # narrow: 27 > 0.9 x 22
    assert dispatch.cuda_tail_rows(b, [38, 50, 60, 77, 92, None, 700]) == 0       # 256 not timed
    assert dispatch.cuda_tail_rows(b, [38, None, 60, 80, 92, 188, 700]) == 32     # 16 not timed: the others still count
    assert dispatch.cuda_tail_rows([1, 16, 64, 256, 4096], [5, 6, 20, 80, 900]) == 0  # no 32 / 128 bucket


def test_the_plan_carries_the_cuda_tail_only_where_the_cuda_kernel_serves_256_rows():
    b = [1, 16, 32, 64, 128, 256, 1024]
    int4 = {"kind": "int4", "N": 28672, "K": 8192, "dtype": "bfloat16",
            "us": {"cuda": [38, 50, 60, 77, 92, 188, 700], "triton": [44, 75, 94, 99, 170, 265, 1000],
                   "dequant": [300, 300, 300, 310, 330, 400, 600]}}
    t = {"version": 1, "device": "test", "buckets": b, "entries": [int4]}
    dispatch.validate_table(t)
    av = ("reference", "dequant", "triton", "cuda")
    plan = dispatch.plan_layer("int4", 28672, 8192, av, t)
    assert plan.cuda_tail == 64 and plan.select(144)[0] == "cuda"
    assert plan.describe() == "M1-256:cuda M257+:dequant (cuda M129-256: a last tile of <= 64 rows split off)"
    assert dispatch.plan_layer("int4", 28672, 8192, ("reference", "dequant", "triton"), t).cuda_tail == 0
    int4["us"]["dequant"][5] = 150                      # dequantize + cuBLAS serves M = 129-256: no tail
    assert dispatch.plan_layer("int4", 28672, 8192, av, t).cuda_tail == 0
    assert dispatch.plan_layer("int4", 28672, 8192, av, t, mode="cuda").cuda_tail == 0   # forced: as measured alone


def test_the_shipped_tables_split_tails_on_the_wide_layers_only():
    """With the shipped H100 table: the wide Llama layers (N = 28672 or K = 28672) split a short last tile at
    M = 129-256, the N = 4096 / 6144 ones never (their 256-row launch costs well under two 128-row ones)."""
    t = dispatch.load_table(dispatch.SHIPPED_DIR / "crossover_h100.json")
    av = ("reference", "dequant", "triton", "cuda")
    tails = {(n, k): dispatch.plan_layer("int4", n, k, av, t).cuda_tail
             for n, k in [(28672, 8192), (28672, 4096), (8192, 28672), (4096, 4096), (6144, 4096), (4096, 14336)]}
    assert tails[(28672, 8192)] > 0 and tails[(28672, 4096)] > 0 and tails[(8192, 28672)] > 0
    assert tails[(4096, 4096)] == tails[(6144, 4096)] == tails[(4096, 14336)] == 0


@pytest.mark.parametrize("table", ["crossover_h100.json", "crossover_h200.json"])
def test_the_shipped_tables_keep_the_cuda_kernel_for_batch_one_decode(table):
    """A layer holding one int4 layout (the default) plans the CUDA kernel at M = 1-8 on every Llama-8B decode shape
    with either shipped table: the fused decode-block ends (RMSNorm, SiLU * up, the residual, RoPE) exist only in that
    kernel (QuantLinear.fused_why_not), and issue 6's batch-1 decode target was measured with them. A re-measured
    table that moved a decode bucket elsewhere would drop them silently."""
    t = dispatch.load_table(dispatch.SHIPPED_DIR / table)
    av = ("reference", "dequant", "triton", "cuda")
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1024, 4096)]:
        plan = dispatch.plan_one_layout(lambda a, cols: dispatch.plan_layer("int4", n, k, a, t, columns=cols), av)
        assert [plan.select(m)[0] for m in (1, 2, 4, 8)] == ["cuda"] * 4, (table, n, k, plan.describe())


def test_one_layout_plan_replans_each_used_kernel_with_its_own_dequant_column():
    """plan_one_layout: the full plan calls triton at M = 1 and cuda above; each kernel's plan reads dequantize+cuBLAS
    from its own layout's column, and the decode tie rule keeps the one faster over all buckets."""
    t = _table()
    e = next(x for x in t["entries"] if x["kind"] == "int4" and (x["N"], x["K"]) == (4096, 4096))
    e["us"] = {"bf16": [9, 9, 14, 40, 200], "triton": [4.9, 9, 30, 90, 900], "cuda": [5, 6, 12, 35, 500],
               "dequant": [20, 20, 20, 45, 210], "dequant_cuda": [21, 21, 21, 44, 211],
               "dequant_triton": [25, 25, 25, 60, 260]}
    calls = []

    def plan_fn(a, cols):
        calls.append((a, cols))
        return dispatch.plan_layer("int4", 4096, 4096, a, t, columns=cols)
    plan = dispatch.plan_one_layout(plan_fn, ("dequant", "triton", "cuda"))
    assert calls[0] == (("dequant", "triton", "cuda"), None)
    assert sorted(calls[1:]) == [(("dequant", "cuda"), {"dequant": "dequant_cuda"}),
                                 (("dequant", "triton"), {"dequant": "dequant_triton"})]
    assert [plan.select(m)[0] for m in t["buckets"]] == ["cuda", "cuda", "cuda", "cuda", "dequant"]
    only_ref = dispatch.plan_one_layout(lambda a, cols: dispatch.uniform("reference", "cpu"), ("reference",))
    assert only_ref.kernels == ("reference",)


def test_the_layer_hands_its_plans_tail_to_the_cuda_op():
    """QuantLinear matches the CUDA op's arguments by name: a plan's cuda_tail reaches the op's ``tail``, and an op
    without that argument (the Triton ones) never sees it."""
    layer = _int4_layer(bias=False)
    seen = []

    def op(x, tail):
        seen.append(tail)
        return x.new_zeros((*x.shape[:-1], layer.out_features))

    layer.plan = dispatch.Plan((4096,), ("cuda",), ((),), "test", 32)
    layer._int4_ops["cuda"], layer._layout_keys["cuda"] = (op, ("x", "tail")), {}
    assert layer(torch.randn(144, layer.in_features)).shape == (144, layer.out_features) and seen == [32]
    layer._int4_ops["cuda"] = (lambda x: x.new_zeros((*x.shape[:-1], layer.out_features)), ("x",))
    layer(torch.randn(3, layer.in_features))   # no tail argument: called without one


def test_a_table_column_runs_dequantize_from_an_attached_layout():
    """`sdquant tune-kernels` times "dequant_<layout>" (dequantize+cuBLAS reading an attached int4 layout, what a
    layouts="one" layer runs in its dequantize buckets) through crossover.run_column: the same product as the
    canonical path, the layer left routed as it was, and an unattached layout refused by name."""
    from sdquant.kernels import crossover
    layer = crossover.random_int4_layer(128, 256, "cpu").prepare("cpu", torch.bfloat16, kernels="reference")
    assert layer.attach_int4("triton", torch.device("cpu"), torch.bfloat16)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    ref = crossover.run_column(layer, "reference", x).float()
    got = crossover.run_column(layer, "dequant_triton", x).float()
    assert layer._dequant_from is None  # routed back to the canonical tensors
    assert crossover.rel_err(got, ref) < 1e-2
    assert crossover.rel_err(crossover.run_column(layer, "dequant", x).float(), ref) < 1e-2
    with pytest.raises(ConfigError, match="no cuda layout is attached"):
        crossover.run_column(layer, "dequant_cuda", x)
    assert layer._dequant_from is None


def test_one_layout_keeps_the_decode_kernel_unless_another_ties_there_and_is_faster_overall():
    def plan(*us):
        return dispatch.Plan((4096,), ("cuda",), ((),), "test", bucket_us=None if None in us else us)
    decode, other = plan(5, 6, 20, 30, 300), plan(7, 7, 12, 30, 300)   # other: faster overall, 40% slower at M=1
    assert dispatch.pick_one_layout([decode, other]) == 0
    tie = plan(5.2, 6, 12, 30, 300)                                      # within DECODE_TIE at M=1
    assert dispatch.pick_one_layout([decode, tie]) == 1
    assert dispatch.pick_one_layout([tie, decode]) == 0
    assert dispatch.pick_one_layout([decode, plan(5, 6, 20, 30, 300)]) == 0  # equal: the earlier
    assert dispatch.pick_one_layout([plan(5, None, 20, 30, 300), tie]) == 0  # an untimed bucket: the decode kernel
    assert dispatch.pick_one_layout([decode]) == 0
    # plan_layer fills the times from the table; default plans carry none
    p = dispatch.plan_layer("int4", 4096, 4096, ("cuda", "triton", "dequant"), _table())
    assert p.bucket_us == (5, 6, 12, 30, 300)
    assert dispatch.plan_layer("int4", 4096, 4096, ("cuda", "dequant"), None).bucket_us is None
