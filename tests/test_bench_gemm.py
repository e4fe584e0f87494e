"""bench/gemm.py's dispatched-layer columns on the CPU: the providers build the layers as a user prepares them, run
them, and the table reads their ratios (the GPU timing itself runs only on the device)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
gemm = pytest.importorskip("gemm")


def test_layer_providers_run_the_prepared_layers():
    n, k = 64, 256
    which = {"bf16", "sdq_int4_layer", "sdq_fp8_layer", "sdq_fp8_tensor_layer"}
    provs, w_ref = gemm.build_providers(n, k, torch.device("cpu"), torch.float32, which, log_fn=pytest.fail)
    assert set(provs) == which and all(p is not None for p in provs.values())
    x = torch.randn(3, k)
    ref = x.double() @ w_ref.double().t()
    for name in ("sdq_int4_layer", "sdq_fp8_layer", "sdq_fp8_tensor_layer"):
        make, run, nbytes = provs[name]
        layer = make(0)
        assert layer is not make(1)  # one prepared layer a weight copy, so the calls rotate past L2
        y = run(layer, x)
        assert y.shape == (3, n)
        err = gemm.rel_err(y, ref.float())
        # int4: the layer computes the same dequantized weight; fp8: W8A8 adds its quantization error
        assert err < (1e-5 if name == "sdq_int4_layer" else 5e-2), (name, err)
        assert gemm.layer_plan(layer, 3) == "reference"  # a CPU layer plans the reference op at every M
    assert provs["sdq_int4_layer"][2] == n * k // 2 + n * (k // gemm.GS) * 4
    # the per-tensor recipe: one weight scale, and the static activation scale it was built with
    tl = provs["sdq_fp8_tensor_layer"][0](0)
    assert tl.weight_scale.unique().numel() == 1
    assert tl.input_scale is not None and float(tl.input_scale) == pytest.approx(gemm.STATIC_X_AMAX / 448.0)
    assert gemm.layer_plan(object(), 3) is None


def test_cuda_providers_are_left_out_without_the_extension():
    """On a machine without the CUDA extension the CUDA op's providers (the default launch and the PDL launch) are
    marked unavailable with the reason logged, and the other kernels of the sweep still build."""
    logged = []
    provs, _w = gemm.build_providers(64, 256, torch.device("cpu"), torch.float32,
                                     {"bf16", "sdq_cuda", "sdq_cuda_pdl", "sdq_cuda_pdl_late"}, log_fn=logged.append)
    assert provs["sdq_cuda"] is None and provs["sdq_cuda_pdl"] is None and provs["sdq_cuda_pdl_late"] is None
    assert provs["bf16"] is not None
    assert sum("not available" in ln for ln in logged) == 3


def test_pdl_columns_are_timed_up_to_pdl_max_m_only(monkeypatch):
    """Both PDL columns (with and without the early trigger) are timed at M <= pdl_max_m and left untimed, with the
    reason, above it; the other kernels are timed at every M."""
    real = gemm.build_providers

    def with_fake_pdl(n, k, dev, dtype, which, *a, **kw):
        provs, w = real(n, k, dev, dtype, which - set(gemm.PDL_KERNELS), *a, **kw)
        bf16 = provs["bf16"]
        for name in gemm.PDL_KERNELS:  # the bf16 call under the PDL columns' names: a CPU stand-in for the CUDA op
            provs[name] = bf16
        return provs, w
    monkeypatch.setattr(gemm, "build_providers", with_fake_pdl)
    monkeypatch.setattr(gemm, "time_rotating", lambda call, n_rot: (call(0), 1.0)[1])
    monkeypatch.setattr(gemm, "gpu_state", lambda: {})
    which = {"bf16", *gemm.PDL_KERNELS}
    rows = gemm.run_sweep([(256, 64)], [16, 32], torch.device("cpu"), torch.float32, which, 1.0, log_fn=lambda s: None)
    timed = {(r["M"], r["kernel"]) for r in rows if r["us"] is not None}
    assert timed == {(16, "bf16"), (16, "sdq_cuda_pdl"), (16, "sdq_cuda_pdl_late"), (32, "bf16")}
    assert all(r["note"] == "skipped (M>16)" for r in rows if r["us"] is None)
    rows = gemm.run_sweep([(256, 64)], [32], torch.device("cpu"), torch.float32, which, 1.0, log_fn=lambda s: None,
                          pdl_max_m=64)
    assert all(r["us"] == 1.0 for r in rows) and len(rows) == 3


def test_table_reads_the_layer_ratios():
    rows = [{"K": 4096, "N": 4096, "M": 16, "kernel": kn, "us": us}
            for kn, us in (("bf16", 12.0), ("fp8_tensorwise", 8.0), ("sdq_cuda", 6.0), ("sdq_int4_layer", 10.0),
                           ("sdq_fp8_layer", 10.0))]
    kernels = ["bf16", "fp8_tensorwise", "sdq_cuda", "sdq_int4_layer", "sdq_fp8_layer"]
    lines = gemm.table(rows, kernels).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = dict(zip(head, [c.strip() for c in lines[2].strip("|").split("|")]))
    assert cells["best sdq int4 kernel ×bf16"] == "2.00"
    assert cells["int4 layer ×bf16"] == "1.20"
    assert cells["fp8 layer ×bf16"] == "1.20"
    assert cells["fp8 layer ÷ tensorwise"] == "1.25"
    assert len(lines[1].strip("|").split("|")) == len(head)
    # without the layer columns asked for, the table keeps its old form
    assert "layer" not in gemm.table(rows, ["bf16", "sdq_cuda"]).splitlines()[0]


def test_issue4_targets_reads_each_target_from_one_run():
    targets = pytest.importorskip("issue4_targets")
    rows = []

    def add(k, n, m, **us):
        rows.extend({"K": k, "N": n, "M": m, "kernel": kn, "us": v} for kn, v in us.items())
    add(8192, 28672, 1, bf16=110.0, sdq_cuda=36.0, sdq_triton=50.0, sdq_int4_layer=37.0)
    add(8192, 28672, 16, bf16=110.0, sdq_cuda=49.5, sdq_triton=60.0, sdq_int4_layer=50.0)
    add(8192, 28672, 64, bf16=120.0, sdq_cuda=61.0, sdq_int4_layer=61.0)
    add(8192, 28672, 128, bf16=130.0, sdq_cuda=99.0, sdq_int4_layer=99.0)
    add(8192, 28672, 4096, bf16=2400.0, sdq_cuda=3300.0, sdq_int4_layer=2600.0, fp8_tensorwise=1400.0,
        sdq_fp8_layer=1600.0, sdq_fp8_tensor_layer=1450.0)
    add(14336, 4096, 16, bf16=33.0, sdq_cuda=17.6, sdq_cuda_pdl=16.9, fp8_rowwise=38.0, sdq_fp8_layer=25.0)
    add(4096, 4096, 1, bf16=12.0, sdq_cuda=7.5, sdq_cuda_pdl=6.5)
    got = {(t, where): ok for t, where, _val, ok in targets.verdicts(rows)}
    # the PDL launch (the decode runtime's mode) is read as a target line of its own, beside the default launch
    assert got[("INT4 M 1-16 <= 7 us", "4096x4096 M=1")] is False
    assert got[("INT4 M 1-16 <= 7 us, PDL launch", "4096x4096 M=1")] is True
    assert got[("INT4 M 1-16 <= 10 us, PDL launch", "14336x4096 M=16")] is False
    assert ("INT4 M 1-16 <= 37 us, PDL launch", "8192x28672 M=1") not in got  # not timed there
    assert got[("INT4 M 1-16 <= 37 us", "8192x28672 M=1")] is True
    assert got[("INT4 M 1-16 <= 37 us", "8192x28672 M=16")] is False
    assert got[("INT4 M 1-16 <= 10 us", "14336x4096 M=16")] is False
    assert got[("INT4 M 32-64 >= 2x bf16", "8192x28672 M=64")] is False  # 1.97x
    assert got[("INT4 M 128 >= 1.3x bf16", "8192x28672 M=128")] is True  # 1.31x
    assert got[("INT4 layer >= 1.0x bf16", "8192x28672 M=4096")] is False
    assert got[("Triton >= 75% of CUDA", "8192x28672 M=1")] is False and got[("Triton >= 75% of CUDA",
                                                                            "8192x28672 M=16")] is True
    assert got[("FP8 layer within 5% of tensorwise", "8192x28672 M=4096")] is False  # 1.143
    assert got[("FP8 layer >= 1.6x bf16", "8192x28672 M=4096")] is False  # 1.50x
    assert got[("FP8 per-tensor layer within 5% of tensorwise", "8192x28672 M=4096")] is True  # 1.036
    assert got[("FP8 per-tensor layer >= 1.6x bf16", "8192x28672 M=4096")] is True  # 1.66x
    assert got[("FP8 14336x4096 M<=64 >= 1.3x rowwise", "M=16")] is True  # 1.52x
    assert ("INT4 M 32-64 >= 2x bf16", "14336x4096 M=16") not in got  # only the large shapes, only M = 32-128
    summ = {t: (met, n, miss) for t, met, n, miss in targets.summary(targets.verdicts(rows))}
    assert summ["INT4 M 1-16 <= 37 us"] == (1, 2, ("8192x28672 M=16", "49.5 us"))
    assert summ["FP8 layer >= 1.6x bf16"][2] == ("8192x28672 M=4096", "1.50x")
    assert summ["FP8 per-tensor layer >= 1.6x bf16"][2] is None


def test_issue4_targets_states_the_gpu_clocks_of_the_run():
    targets = pytest.importorskip("issue4_targets")
    rows = [{"K": 4096, "N": 4096, "M": 1, "kernel": "bf16", "us": 13.0,
             "gpu": {"sm_mhz": 1980, "sm_mhz_min": 1905, "power_w_max": 410.5, "reasons": "0x0", "n": 3}},
            {"K": 4096, "N": 4096, "M": 1, "kernel": "sdq_cuda", "us": 7.3,
             "gpu": {"sm_mhz": 1755, "sm_mhz_min": 1650, "power_w_max": 690.0, "reasons": "0x4", "n": 2}},
            {"K": 4096, "N": 4096, "M": 2, "kernel": "sdq_cuda", "us": 7.9, "gpu": None}]
    assert targets.gpu_line(rows) == ("SM clock 1980 MHz median (lowest 1650), power up to 690 W, "
                                      "clock-event reasons 0x4")
    assert targets.gpu_line([{"K": 1, "N": 1, "M": 1, "kernel": "bf16", "us": 1.0}]) == ""


def test_rounds_time_the_kernels_of_a_point_round_robin_and_keep_each_median(monkeypatch):
    """run_sweep(rounds=3): bf16, layer | layer, bf16 | bf16, layer at one point (each round starts one kernel later);
    each kernel keeps the median of its rounds, the GPU state of that median round, and the speedup divides the two
    medians."""
    times = iter([10.0, 5.0, 30.0, 1.0, 20.0, 3.0])  # in call order
    states = iter(range(1, 7))
    calls = []

    def fake_time(call, n_rot):
        calls.append(n_rot)
        call(0)  # the kernel does run
        return next(times)
    monkeypatch.setattr(gemm, "time_rotating", fake_time)
    monkeypatch.setattr(gemm, "gpu_state", lambda: {"n": next(states)})
    logged = []
    rows = gemm.run_sweep([(256, 64)], [3], torch.device("cpu"), torch.float32, {"bf16", "sdq_int4_layer"}, 1.0,
                          log_fn=logged.append, rounds=3)
    assert len(calls) == 6 and not [line for line in logged if "FAILED" in line]
    by = {r["kernel"]: r for r in rows}
    assert [r["kernel"] for r in rows] == ["bf16", "sdq_int4_layer"]
    # bf16: calls 1, 4, 5 -> 10, 1, 20; the layer: calls 2, 3, 6 -> 5, 30, 3
    assert by["bf16"]["us"] == 10.0 and by["bf16"]["us_rounds"] == [1.0, 10.0, 20.0] and by["bf16"]["gpu"] == {"n": 1}
    assert by["sdq_int4_layer"]["us"] == 5.0 and by["sdq_int4_layer"]["us_rounds"] == [3.0, 5.0, 30.0]
    assert by["sdq_int4_layer"]["gpu"] == {"n": 2}
    assert by["sdq_int4_layer"]["speedup_vs_bf16"] == 2.0
    assert by["sdq_int4_layer"]["rel_err"] < 1e-5 and by["sdq_int4_layer"]["plan"] == "reference"
    # one round: the form of before (no us_rounds)
    times, states = iter([4.0, 2.0]), iter(range(2))
    rows = gemm.run_sweep([(256, 64)], [3], torch.device("cpu"), torch.float32, {"bf16", "sdq_int4_layer"}, 1.0,
                          log_fn=logged.append, check=False)
    assert [r["us"] for r in rows] == [4.0, 2.0] and "us_rounds" not in rows[0] and rows[1]["speedup_vs_bf16"] == 2.0


def test_pdl_on_sets_the_launch_mode_and_restores_it():
    """cuda_exp.pdl_on, which the PDL columns run their op in: mode 2 (the early trigger) by default, 1 without it,
    and the mode of before afterwards, also after an exception."""
    import cuda_exp
    from sdquant.kernels import int4_cuda
    old = int4_cuda.set_pdl(False)
    try:
        with cuda_exp.pdl_on():
            assert int4_cuda._PDL[0] == 2
        assert int4_cuda._PDL[0] == 0
        with pytest.raises(RuntimeError):
            with cuda_exp.pdl_on(early_trigger=False):
                assert int4_cuda._PDL[0] == 1
                raise RuntimeError("inside")
        assert int4_cuda._PDL[0] == 0
    finally:
        int4_cuda.set_pdl(bool(old), early_trigger=old == 2)
