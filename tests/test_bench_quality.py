"""bench/quality.py's driver: variant parsing, the sweep preset's configs, fresh state per variant, the ids file."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from sdquant.config import from_dict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def Q():
    spec = importlib.util.spec_from_file_location("bench_quality", ROOT / "bench" / "quality.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_parse_variant_forms(Q):
    v = Q.parse_variant("j=awq+gptq:gptq_mse_grid=0,quant.awq.clip_for_gptq=true,"
                        "activation_scaling.ratio_range=[0.9, 1.1]")
    assert (v.name, v.method) == ("j", "awq+gptq")
    assert v.overrides == {"gptq_mse_grid": 0, "awq.clip_for_gptq": True,
                           "activation_scaling.ratio_range": [0.9, 1.1]}
    assert Q.parse_variant("joint") == Q.Variant("joint", "awq+gptq", {})
    assert Q.parse_variant("gptq") == Q.Variant("gptq", "gptq", {})
    for bad in ("nonsense", "x=awq+gtpq", "f=fp:bits=3"):
        with pytest.raises(SystemExit):
            Q.parse_variant(bad)


def test_sweep_preset_covers_the_required_table_and_every_config_is_valid(Q):
    jobs = Q.plan([], [4, 3], "sweep")
    Q.check_configs(jobs, 64, {}, "cuda")          # raises SystemExit naming the variant on a bad field
    got = {(v.method, b) for v, b in jobs if not v.overrides}
    need = {("fp", None)} | {(m, b) for m in ("rtn", "awq", "gptq", "awq+gptq") for b in (4, 3)}
    assert need <= got
    assert [v.method for v, _ in jobs].count("fp") == 1
    assert len({v.name + str(b) for v, b in jobs}) == len(jobs)
    # the "no ratio" variant really turns the per-channel ratio off in sdquant's config
    v = next(v for v, _ in jobs if v.name == "joint_noratio")
    cfg = from_dict(Q.quant_config(v.method, 4, 64, v.overrides))
    assert cfg.quant.activation_scaling.per_channel is False
    with pytest.raises(SystemExit, match="variant bad"):
        Q.check_configs([(Q.Variant("bad", "gptq", {"gptq_mse_grd": 0}), 4)], 64, {}, "cpu")


def test_smoke_run_restores_fp_state_for_every_variant(Q, tmp_path):
    out = tmp_path / "rows.jsonl"
    rows = Q.main(["--smoke", "--variants", "fp", "rtn", "joint", "rtn_again=rtn", "--bits", "4",
                   "--seq-len", "64", "--windows", "4", "--n-samples", "4", "--json", str(out)])
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"fp", "rtn", "joint", "rtn_again"}
    # rtn after joint sees the fp32 weights again (a calibrated model left behind would change it)
    assert by["rtn_again"]["ppl"] == by["rtn"]["ppl"]
    assert by["rtn"]["ppl"] != by["fp"]["ppl"] and math.isfinite(by["joint"]["ppl"])
    assert by["joint"]["layer_loss_vs_rtn"] < 1.0               # GPTQ beats RTN on its own objective
    # the fp row is sdquant.eval.perplexity of the untouched model on the same windows
    from sdquant.eval import perplexity
    model, _, ev = Q.smoke_model()
    assert by["fp"]["ppl"] == pytest.approx(perplexity(model, ev, seq_len=64, windows=4)["ppl"], rel=1e-12)
    assert [json.loads(line)["variant"] for line in out.read_text().splitlines()] == [r["variant"] for r in rows]
    table = Q.summary(rows)
    assert "rtn_again" in table and "0.0%" in table              # RTN closes 0% of its own gap


def test_ids_file_round_trip(Q, tmp_path, monkeypatch):
    from sdquant.models.hf import byte_tokenizer
    monkeypatch.setattr(Q, "SHARED", tmp_path)
    (tmp_path / "brown.txt").write_text("The jury said it did find that. " * 200)
    (tmp_path / "wikitext2_test.txt").write_text(" = Robert = \n\n Robert is an actor . " * 100)
    tok = byte_tokenizer()
    meta = Q.write_ids(tmp_path / "ids.safetensors", tok, n_samples=5, eval_tokens=300)
    calib, ev, meta2 = Q.read_ids(tmp_path / "ids.safetensors")
    assert calib.dtype == torch.long and calib.shape == (5, Q.CALIB_LEN)
    assert torch.equal(calib, Q.calibration_ids(tok, 5))
    assert torch.equal(ev, Q.eval_ids(tok)[:300])
    assert meta2 == meta and len(meta["brown_sha256"]) == 64
