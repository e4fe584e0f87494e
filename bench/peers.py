"""Peer quantizers run inside bench/quality.py on the same model, data and evaluation (issue 3).

AutoAWQ 0.2.9 (the last release; deprecated upstream, still installable): its own AwqQuantizer searches the
scales and the clipping on the protocol's calibration ids (passed as token lists, so AutoAWQ concatenates and
re-splits them into the same 512-token blocks) in ``export_compatible`` mode, which applies the scales and
clips to the float weights; every decoder linear is then fake-quantized with AutoAWQ's own
``pseudo_quantize_tensor`` (min/max, integer zero point, the same quantizer as its packed GEMM format). No
AutoAWQ CUDA kernels are needed. llm-compressor, whose numbers on this protocol are in ANCHORS.md, pins
transformers ≤ 5.17 and is not installed here.
"""
from __future__ import annotations

import torch
from torch import nn


def autoawq_available() -> bool:
    try:
        import importlib
        importlib.import_module("awq.quantize.quantizer")
        return True
    except Exception:  # noqa: BLE001 - any import problem means: not available
        return False


def autoawq_fake_quant(model: nn.Module, calib_ids: torch.Tensor, bits: int, group_size: int) -> nn.Module:
    """Run AutoAWQ's search and pseudo-quantization on ``model`` (a Llama-architecture HF model, in place)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from awq.models.llama import LlamaAWQForCausalLM
        from awq.quantize.quantizer import AwqQuantizer
    if model.config.model_type not in ("llama", "mistral"):
        raise ValueError(f"autoawq peer: model_type {model.config.model_type!r} not wired (llama only)")
    wrapper = LlamaAWQForCausalLM(model, "llama", is_quantized=False, config=model.config, quant_config={},
                                  processor=None)
    q = AwqQuantizer(wrapper, model, None, w_bit=bits, group_size=group_size, zero_point=True, version="gemm",
                     calib_data=[row.tolist() for row in calib_ids], split="train", text_column="text",
                     duo_scaling=True, export_compatible=True, max_calib_samples=int(calib_ids.shape[0]),
                     max_calib_seq_len=int(calib_ids.shape[1]))
    q.quantize()
    with torch.no_grad():
        for layer in model.model.layers:
            for m in layer.modules():
                if isinstance(m, nn.Linear):
                    m.weight.copy_(q.pseudo_quantize_tensor(m.weight.data)[0])
    return model
