"""Shared builders for the .sd2 tests (imported by test_sd2_*.py; pytest puts this folder on sys.path)."""
from __future__ import annotations

import torch

from sdquant.export.sd2 import write_sd2
from sdquant.quant.qtensor import QuantizedWeight, compute_qparams, quantize_codes, quantize_fp8_weight


def rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, act_order: bool = False,
        seed: int = 0) -> QuantizedWeight:
    """Round-to-nearest QuantizedWeight of w [N, K]; act_order gives a permuted (non-trivial) g_idx."""
    n, k = w.shape
    g_idx = None
    if act_order:
        gs = k if group_size == -1 else group_size
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)  # channel perm[i] belongs to group i // gs
        wp = w[:, perm]
        s, z = compute_qparams(wp, bits, group_size, symmetric)
    else:
        s, z = compute_qparams(w, bits, group_size, symmetric)
    codes = quantize_codes(w, s, z, bits, group_size, g_idx)
    return QuantizedWeight.from_codes(codes, s, z, bits, group_size, g_idx)


def tiny_model(seed: int = 0):
    """(float_tensors, quant_layers) covering every scheme the format stores."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    floats = [("model.embed_tokens.weight", rnd(50, 64).to(torch.bfloat16)),
              ("model.norm.weight", torch.ones(64)),
              ("lm_head.weight", rnd(50, 64).half())]
    quant = [
        ("l.int4_g32_asym", rtn(rnd(48, 64), 4, 32, False), rnd(48), None),
        ("l.int4_g16_sym_act", rtn(rnd(32, 64), 4, 16, True, act_order=True), None, rnd(64).abs() + 0.5),
        ("l.int3_g32", rtn(rnd(16, 64), 3, 32, False), None, None),
        ("l.int2_chan", rtn(rnd(16, 64), 2, -1, False), rnd(16), None),
        ("l.int8_g64_sym", rtn(rnd(24, 64), 8, 64, True), None, None),
        ("l.fp8_static", quantize_fp8_weight(rnd(40, 64), torch.tensor(0.05)), rnd(40).half(), None),
        ("l.fp8_dynamic", quantize_fp8_weight(rnd(8, 64)), None, rnd(64).abs() + 0.5),
    ]
    return floats, quant


def write_tiny(path, seed: int = 0, **kw):
    floats, quant = tiny_model(seed)
    args = dict(family="llama", arch_config={"hidden_size": 64, "num_hidden_layers": 1},
                float_tensors=floats, quant_layers=quant,
                extra_files={"tokenizer.json": b'{"model": {}}', "model.onnx": bytes(range(256)) * 3},
                calibration={"method": "awq+gptq", "config": {"bits": 4}, "data_fingerprint": "sha256:00",
                             "metrics": {"ppl": 12.5, "rel_err": 0.01},
                             "per_layer": {"l.int4_g32_asym": {"loss": 0.25}}},
                high_precision=["lm_head"])
    args.update(kw)
    return write_sd2(path, **args), floats, quant
