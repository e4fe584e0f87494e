"""The block walker: resume after an interruption gives exactly the uninterrupted result; a mismatched
resume is refused; the CLI resume path."""
import pytest
import torch

import sdquant
from sdquant.config import load_config
from sdquant.errors import SdquantError


def _cfg(method, **over):
    return load_config(None, {"model.kind": "builtin", "model.name": "tiny-llama", "quant.method": method,
                              "quant.group_size": 32, "device": "cpu", "pipeline.batch_size": 2,
                              "quant.awq.grid": 4, "quant.awq.clip_grid": 4, **over})


IDS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def _same(a, b):
    assert set(a.weights) == set(b.weights)
    for n in a.weights:
        wa, wb = a.weights[n], b.weights[n]
        assert torch.equal(wa.qweight, wb.qweight) and torch.equal(wa.scales, wb.scales), n
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


@pytest.mark.parametrize("method", ["rtn", "awq+gptq"])
def test_resume_equals_uninterrupted(method, tmp_path):
    full = sdquant.calibrate(config=_cfg(method), data=IDS)
    work = tmp_path / "work"
    part = sdquant.calibrate(config=_cfg(method), data=IDS, work_dir=work, stop_after=1)  # "killed" after block 0
    assert len(part.weights) == 7 and len(list(work.glob("block_*.safetensors"))) == 1
    resumed = sdquant.calibrate(config=_cfg(method), data=IDS, work_dir=work, resume=True)
    assert resumed.resumed_blocks == 1
    _same(full, resumed)


def test_resume_refuses_a_different_config(tmp_path):
    work = tmp_path / "work"
    sdquant.calibrate(config=_cfg("rtn"), data=IDS, work_dir=work, stop_after=1)
    with pytest.raises(SdquantError, match="different model, data or quant config"):
        sdquant.calibrate(config=_cfg("rtn", **{"quant.bits": 3}), data=IDS, work_dir=work, resume=True)
    with pytest.raises(SdquantError, match="different model, data or quant config"):
        sdquant.calibrate(config=_cfg("rtn"), data=IDS + 1, work_dir=work, resume=True)


def test_keep_patterns_and_overrides_apply(tmp_path):
    cfg = _cfg("rtn", **{"quant.ignore": [r"o_proj$"], "quant.overrides": [{"pattern": "down_proj", "bits": 8}]})
    res = sdquant.calibrate(config=cfg, data=IDS)
    assert not any(n.endswith("o_proj") for n in res.weights)
    assert all(w.bits == (8 if "down_proj" in n else 4) for n, w in res.weights.items())
    assert "lm_head" not in res.weights


@pytest.mark.parametrize("weights", ["channel", "tensor"])
def test_fp8_override_in_an_rtn_run_follows_fp8_weights(weights):
    """A layer overridden to fp8 inside an RTN run is quantized with quant.fp8.weights' granularity."""
    from sdquant.quant.qtensor import Fp8Weight
    cfg = _cfg("rtn", **{"quant.overrides": [{"pattern": "down_proj", "method": "fp8"}], "quant.fp8.weights": weights})
    res = sdquant.calibrate(config=cfg, data=IDS)
    fp8 = {n: w for n, w in res.weights.items() if isinstance(w, Fp8Weight)}
    assert fp8 and all("down_proj" in n for n in fp8)
    assert all(bool((w.weight_scale == w.weight_scale[0]).all()) == (weights == "tensor") for w in fp8.values())


def test_progress_callback_and_silence(capsys):
    seen = []
    sdquant.calibrate(config=_cfg("rtn"), data=IDS, progress=lambda what, i, n: seen.append((i, n)))
    assert seen == [(1, 2), (2, 2)]
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # library use prints nothing unless asked


def test_rows_carry_peak_memory_and_the_cli_prints_the_layer_table(tmp_path, capsys):
    res = sdquant.calibrate(config=_cfg("awq+gptq"), data=IDS)
    assert res.rows and all(r["peak_mb"] > 0 for r in res.rows)
    assert all(r["loss"] <= r["rtn_loss"] for r in res.rows if r.get("rtn_loss") is not None)
    from pathlib import Path
    from sdquant.cli import main
    tpl = Path(__file__).resolve().parents[1] / "templates" / "tiny-rtn.yaml"
    assert main(["calibrate", "--config", str(tpl), "--set", f"output={tmp_path}/m.sd2",
                 "--no-progress", "--set", "report.max_new_tokens=0"]) == 0
    out = capsys.readouterr().out
    assert "loss rtn -> final" in out and "model.layers.1.mlp.down_proj" in out
