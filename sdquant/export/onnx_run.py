"""Drive an exported sdquant ONNX decoder in ONNX Runtime token by token (greedy), for validation and benchmarks.

    dec = OnnxDecoder("out/model.onnx")                       # CPU provider by default
    tokens = dec.generate(input_ids, max_new_tokens=16)       # int64 [B, S + 16]
    logits, past = dec.forward(ids, attention_mask, past)     # one step, KV cache in numpy

CUDA deployment: ``OnnxDecoder(path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])`` with
onnxruntime-gpu installed and a model exported with dtype="float16" (see docs/ONNX.md).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple  # noqa: F401

import numpy as np

from sdquant.errors import PackageError


class OnnxDecoder:
    def __init__(self, path, providers: Optional[Sequence[str]] = None, intra_op_threads: int = 0,
                 session_options=None):
        import onnxruntime as ort
        path = Path(path)
        if path.is_dir():
            path = path / "model.onnx"
        if not path.exists():
            raise PackageError(f"{path}: no such ONNX model")
        meta_path = path.parent / "sdquant_onnx.json"
        if not meta_path.exists():
            raise PackageError(f"{meta_path}: missing (was this model exported by sdquant.export_onnx?)")
        self.meta = json.loads(meta_path.read_text())
        so = session_options or ort.SessionOptions()
        if intra_op_threads:
            so.intra_op_num_threads = intra_op_threads
        self.session = ort.InferenceSession(str(path), so, providers=list(providers or ["CPUExecutionProvider"]))
        self.n_layers = int(self.meta["n_layers"])
        self.n_kv = int(self.meta["n_kv_heads"])
        self.head_dim = int(self.meta["head_dim"])
        self.np_dtype = np.float16 if self.meta["dtype"] == "float16" else np.float32
        self.output_names = [o.name for o in self.session.get_outputs()]

    def empty_past(self, batch: int) -> List[Tuple[np.ndarray, np.ndarray]]:
        z = np.zeros((batch, self.n_kv, 0, self.head_dim), dtype=self.np_dtype)
        return [(z, z) for _ in range(self.n_layers)]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, past, position_ids=None):
        """input_ids [B, S], attention_mask [B, past + S] -> (logits [B, S, V], present)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        attention_mask = np.asarray(attention_mask, dtype=np.int64)
        if position_ids is None:
            # HF convention: positions count real tokens only (left padding gets position 0... then 0, 1, ...)
            pos = np.cumsum(attention_mask, axis=1) - 1
            pos = np.where(attention_mask == 0, 0, pos)
            position_ids = pos[:, -input_ids.shape[1]:]
        feed = {"input_ids": input_ids, "attention_mask": attention_mask,
                "position_ids": np.asarray(position_ids, dtype=np.int64)}
        for i, (k, v) in enumerate(past):
            feed[f"past_key_values.{i}.key"] = k
            feed[f"past_key_values.{i}.value"] = v
        outs = self.session.run(None, feed)
        logits = outs[0]
        present = [(outs[1 + 2 * i], outs[2 + 2 * i]) for i in range(self.n_layers)]
        return logits, present

    def generate(self, input_ids, max_new_tokens: int, attention_mask=None, eos_token_id="model"):
        """Greedy decoding: one prefill call, then one call per token. Returns int64 [B, S + new].
        eos_token_id: "model" (the exported model's, from sdquant_onnx.json), an int, or None (never stop)."""
        if eos_token_id == "model":
            eos_token_id = self.meta.get("eos_token_id")
        if isinstance(eos_token_id, list):
            eos_token_id = eos_token_id[0] if eos_token_id else None
        ids = np.asarray(input_ids, dtype=np.int64)
        b = ids.shape[0]
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
        logits, past = self.forward(ids, mask, self.empty_past(b))
        out = [ids]
        done = np.zeros(b, dtype=bool)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1).astype(np.int64)[:, None]       # [B, 1]
            out.append(nxt)
            if eos_token_id is not None:
                done |= nxt[:, 0] == eos_token_id
                if done.all():
                    break
            mask = np.concatenate([mask, np.ones((b, 1), dtype=np.int64)], axis=1)
            logits, past = self.forward(nxt, mask, past)
        return np.concatenate(out, axis=1)
