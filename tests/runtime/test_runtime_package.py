"""The runtime on a real .sd2 package: calibrate (RTN) -> package -> sdquant.load -> runtime generate equals the
loaded HF model's greedy generate; the `python -m sdquant.runtime` entry point runs it end to end."""
from pathlib import Path

import torch

import sdquant
from sdquant.runtime.__main__ import main
from sdquant.runtime.model import Transformer, generate

ROOT = Path(__file__).resolve().parents[2]


def test_package_runtime_matches_loaded_model(tmp_path, capsys):
    from sdquant.config import load_config
    cfg = load_config(ROOT / "templates" / "tiny-rtn.yaml", ["model.name=tiny-qwen2"])
    pkg = sdquant.export(sdquant.calibrate(None, cfg, progress=False), tmp_path / "m.sd2", format="sd2")
    model = sdquant.load(pkg, kernels="reference")
    rt = Transformer.from_hf(model, max_seq_len=64)
    ids = model.tokenizer("Hello there", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(rt, ids, 10), ref)
    assert main([str(pkg), "Hello there", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert "tokens/s" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.sd2"), "x", "--device", "cpu"]) == 2
