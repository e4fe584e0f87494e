"""Calibration data: text corpora, model-generated text and input tensors, turned into a fixed, seeded set
of samples with a fingerprint.

Every function here is pure and deterministic for a given seed: no global RNG is read or advanced
(window starts use ``random.Random(seed)``, self-generation a private ``torch.Generator``).

Data config fields (read with ``getattr``, so ``sdquant.config.DataConfig``, a ``SimpleNamespace`` or a
plain ``dict`` all work; a missing field takes the default shown):

    kind         "builtin" (default) | "text" | "jsonl" | "hf_disk" | "parquet" | "self" | "tensors" | "auto"
                 ("diffusion" is accepted as an alias of "tensors")
    path         file or folder for text / jsonl / hf_disk / parquet / tensors; unused for builtin and self
    field        JSONL key or dataset column that holds the text (default "text")
    split        split of a DatasetDict saved to disk (default: "train", or the only split there is)
    n_samples    number of calibration sequences (default 128)
    seq_len      tokens per sequence (default 512)
    seed         seed for window starts and for self-generation (default 0)
    sampling     "random" (default): each window starts at ``rng.randint(0, n_tokens - seq_len)`` with
                 ``rng = random.Random(seed)``, one call per sample (the GPTQ/AWQ papers' protocol, windows
                 may overlap); "packed": the token stream is cut into consecutive non-overlapping windows and
                 ``rng.sample`` picks n_samples of them, kept in stream order (no token used twice)
    temperature  self-generation sampling temperature (default 1.0)
    top_k        self-generation top-k (default 50; 0 = whole vocabulary)

Text sources are read as documents (a text file is one document, a folder of ``*.txt`` one per file, a
JSONL line / dataset row one each), joined with "\\n\\n" — the same joining the wikitext perplexity
protocol uses — and tokenized once into a single stream from which the windows are cut.
"""
from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import math
import os
import random
from dataclasses import dataclass, field as dc_field
from importlib import resources
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch

from sdquant.errors import ConfigError, SdquantError

KINDS = ("builtin", "text", "jsonl", "hf_disk", "parquet", "self", "tensors", "auto", "diffusion")
SAMPLING = ("random", "packed")
DEFAULTS: Dict[str, Any] = dict(kind="builtin", path=None, field="text", split=None, n_samples=128,
                                seq_len=512, seed=0, sampling="random", temperature=1.0, top_k=50)
_FINGERPRINT_VERSION = "sdquant-calib-v1"


# --------------------------------------------------------------------------------------------- container

@dataclass(frozen=True)
class CalibrationData:
    """A fixed set of calibration samples.

    ``tensors`` maps input names to tensors that share their first dimension (the sample index): for text
    it is ``{"input_ids": LongTensor[n_samples, seq_len]}``; for tensor data it is whatever the file held.
    ``fingerprint`` is a sha256 over the tensors and the sampling parameters, so a resumed run can refuse
    data that differs from the data it started with.
    """

    tensors: Dict[str, torch.Tensor]
    fingerprint: str
    source: str                                   # human-readable origin, e.g. "jsonl:/data/x.jsonl[text]"
    n_tokens_available: Optional[int] = None      # length of the token stream the windows were cut from
    params: Dict[str, Any] = dc_field(default_factory=dict)

    @property
    def input_ids(self) -> Optional[torch.Tensor]:
        return self.tensors.get("input_ids")

    @property
    def attention_mask(self) -> Optional[torch.Tensor]:
        return self.tensors.get("attention_mask")

    @property
    def is_text(self) -> bool:
        return "input_ids" in self.tensors

    @property
    def n_samples(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def __len__(self) -> int:
        return self.n_samples

    def batches(self, batch_size: int) -> Iterator[Dict[str, torch.Tensor]]:
        """Consecutive batches in sample order; each is a dict of [b, ...] slices (the last may be smaller).
        A text batch can be fed as ``model(**batch)``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError("batch_size", f"must be a positive integer, got {batch_size!r}")
        for start in range(0, self.n_samples, batch_size):
            yield {k: v[start:start + batch_size] for k, v in self.tensors.items()}

    def summary(self) -> Dict[str, Any]:
        """Plain data for reports and the result record."""
        return {"source": self.source, "n_samples": self.n_samples, "fingerprint": self.fingerprint,
                "tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in self.tensors.items()},
                "n_tokens_available": self.n_tokens_available, **self.params}


# --------------------------------------------------------------------------------------------- entry point

def load_calibration(data_cfg: Any = None, tokenizer: Any = None, model: Any = None,
                     progress: Optional[Union[bool, Callable[[int, int], None]]] = None) -> CalibrationData:
    """Build the calibration set described by ``data_cfg`` (see the module docstring for the fields).

    ``tokenizer`` is needed by every text kind; ``model`` only by ``kind="self"`` (it writes the text).
    ``progress`` (self-generation only, the one slow source): True for a tqdm bar, or callable(done, total).
    Raises ``ConfigError`` naming the ``data.*`` field for every problem with the data.
    """
    p = _read_cfg(data_cfg)
    kind = p["kind"]
    if kind == "diffusion":
        kind = "tensors"
    if kind == "auto":
        kind = detect_kind(_require_path(p, "auto"))
    params = {"n_samples": p["n_samples"], "seq_len": p["seq_len"], "seed": p["seed"], "sampling": p["sampling"]}

    if kind == "tensors":
        path = _require_path(p, kind)
        tensors = load_tensor_file(path, p["n_samples"])
        params = {"n_samples": p["n_samples"]}
        return CalibrationData(tensors, fingerprint(tensors, params), f"tensors:{path}", None, params)

    if tokenizer is None and kind != "self":
        raise SdquantError(f"data.kind={kind!r} is text and needs a tokenizer; pass tokenizer=")

    if kind == "self":
        if model is None:
            raise SdquantError("data.kind='self' generates calibration text with the model; pass model=")
        ids = generate_self(model, p["n_samples"], p["seq_len"], seed=p["seed"], temperature=p["temperature"],
                            top_k=p["top_k"], bos_token_id=_bos_id(tokenizer, model),
                            banned_token_ids=_special_ids(tokenizer, model), progress=progress)
        params = {**params, "sampling": "self", "temperature": p["temperature"], "top_k": p["top_k"]}
        tensors = {"input_ids": ids}
        return CalibrationData(tensors, fingerprint(tensors, params), "self", None, params)

    if kind == "builtin":
        docs, source = [builtin_text()], "builtin:builtin_calib.txt"
    else:
        path = _require_path(p, kind)
        docs = read_documents(kind, path, field=p["field"], split=p["split"])
        source = f"{kind}:{path}" + (f"[{p['field']}]" if kind in ("jsonl", "hf_disk", "parquet") else "")
    text = "\n\n".join(d for d in docs if d.strip())
    if not text.strip():
        raise ConfigError("data.path", f"{source} contains no text")
    stream = encode_text(tokenizer, text)
    if stream.numel() == 0:
        raise ConfigError("data.path", f"{source} tokenized to 0 tokens")
    ids = sample_windows(stream, p["n_samples"], p["seq_len"], p["seed"], p["sampling"], source=source)
    tensors = {"input_ids": ids}
    return CalibrationData(tensors, fingerprint(tensors, params), source, int(stream.numel()), params)


# --------------------------------------------------------------------------------------------- config

def _read_cfg(cfg: Any) -> Dict[str, Any]:
    def get(name):
        if cfg is None:
            return DEFAULTS[name]
        v = cfg.get(name, DEFAULTS[name]) if isinstance(cfg, Mapping) else getattr(cfg, name, DEFAULTS[name])
        return DEFAULTS[name] if v is None else v

    p = {name: get(name) for name in DEFAULTS}
    if p["kind"] not in KINDS:
        close = difflib.get_close_matches(str(p["kind"]), KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError("data.kind", f"unknown kind {p['kind']!r}{hint}; expected one of {', '.join(KINDS[:-1])}")
    if p["sampling"] not in SAMPLING:
        raise ConfigError("data.sampling", f"unknown sampling {p['sampling']!r}; expected 'random' or 'packed'")
    for name in ("n_samples", "seq_len"):
        v = p[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"data.{name}", f"must be a positive integer, got {v!r}")
    if p["kind"] not in ("tensors", "diffusion") and p["seq_len"] < 2:
        raise ConfigError("data.seq_len", f"must be at least 2 tokens, got {p['seq_len']}")
    if isinstance(p["seed"], bool) or not isinstance(p["seed"], int):
        raise ConfigError("data.seed", f"must be an integer, got {p['seed']!r}")
    if not isinstance(p["field"], str) or not p["field"]:
        raise ConfigError("data.field", f"must be a non-empty string, got {p['field']!r}")
    t = p["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0 and math.isfinite(t)):
        raise ConfigError("data.temperature", f"must be a positive number, got {t!r}")
    k = p["top_k"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError("data.top_k", f"must be an integer >= 0, got {k!r}")
    return p


def _require_path(p: Dict[str, Any], kind: str) -> str:
    path = p["path"]
    if not path:
        raise ConfigError("data.path", f"is required for data.kind={kind!r}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError("data.path", f"no such file or folder: {path}")
    return path


def detect_kind(path: str) -> str:
    """Guess the source kind from a path: a saved HF dataset folder, a folder of parquet files, or the suffix."""
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if names & {"dataset_info.json", "state.json", "dataset_dict.json"}:
            return "hf_disk"
        if any(n.endswith(".parquet") for n in names):
            return "parquet"
        return "text"
    suffix = os.path.splitext(path)[1].lower()
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".safetensors": "tensors"}.get(suffix, "text")


# --------------------------------------------------------------------------------------------- readers

def builtin_text() -> str:
    """The public-domain calibration text shipped inside the package (no download needed)."""
    try:
        return (resources.files("sdquant") / "data" / "builtin_calib.txt").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:  # a broken install, not a user error we can name a field for
        raise SdquantError(f"the built-in calibration text is missing from the sdquant install: {e}") from None


def read_text_file(path: str, field: str = "data.path") -> str:
    """Read a UTF-8 text file; errors name ``field``."""
    if not os.path.isfile(path):
        raise ConfigError(field, f"no such file: {path}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(field, f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror or e}") from None


def read_documents(kind: str, path: str, field: str = "text", split: Optional[str] = None) -> List[str]:
    """The documents of a text source, in file order."""
    if kind == "text":
        if os.path.isdir(path):
            files = sorted(f for f in os.listdir(path) if f.endswith(".txt"))
            if not files:
                raise ConfigError("data.path", f"folder {path} holds no *.txt files")
            return [read_text_file(os.path.join(path, f)) for f in files]
        return [read_text_file(path)]
    if kind == "jsonl":
        return _read_jsonl(path, field)
    if kind == "parquet":
        return _read_parquet(path, field)
    if kind == "hf_disk":
        return _read_hf_disk(path, field, split)
    raise ConfigError("data.kind", f"{kind!r} is not a text source")


def _read_jsonl(path: str, field: str) -> List[str]:
    text = read_text_file(path)
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("data.path", f"{path} line {lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError("data.path", f"{path} line {lineno}: expected a JSON object, got {type(obj).__name__}")
        if field not in obj:
            keys = ", ".join(map(repr, list(obj)[:8])) or "none"
            raise ConfigError("data.field", f"{path} line {lineno}: no field {field!r} (keys: {keys})")
        docs.append(_as_text(obj[field], f"{path} line {lineno}", field))
    if not docs:
        raise ConfigError("data.path", f"{path} contains no JSON lines")
    return docs


def _as_text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise ConfigError("data.field", f"{where}: field {field!r} is {type(value).__name__}, expected a string")
    return value


def _read_parquet(path: str, field: str) -> List[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SdquantError("data.kind='parquet' needs pyarrow: pip install 'sdquant[data]'") from None
    files = ([os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".parquet")]
             if os.path.isdir(path) else [path])
    if not files:
        raise ConfigError("data.path", f"folder {path} holds no *.parquet files")
    docs: List[str] = []
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            if field not in names:
                raise ConfigError("data.field", f"{f}: no column {field!r} (columns: {', '.join(names)})")
            values = pf.read(columns=[field]).column(field).to_pylist()
        except ConfigError:
            raise
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for corrupt files
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError("data.path", f"cannot read parquet file {f}: {msg}") from None
        docs.extend(_as_text(v, f"{f} row {i}", field) for i, v in enumerate(values))
    return docs


def _read_hf_disk(path: str, field: str, split: Optional[str]) -> List[str]:
    try:
        import datasets
    except ImportError:
        raise SdquantError("data.kind='hf_disk' needs the datasets package: pip install 'sdquant[data]'") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # FileNotFoundError for a folder that is not a saved dataset, arrow errors otherwise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError("data.path", f"cannot load a saved dataset from {path}: {msg}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split is None:
            split = "train" if "train" in splits else (splits[0] if len(splits) == 1 else None)
            if split is None:
                raise ConfigError("data.split", f"{path} has splits {', '.join(splits)}; choose one")
        if split not in ds:
            raise ConfigError("data.split", f"{path} has no split {split!r} (splits: {', '.join(splits)})")
        ds = ds[split]
    if field not in ds.column_names:
        raise ConfigError("data.field", f"{path}: no column {field!r} (columns: {', '.join(ds.column_names)})")
    return [_as_text(v, f"{path} row {i}", field) for i, v in enumerate(ds[field])]


# --------------------------------------------------------------------------------------------- tokens

def encode_text(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids of ``text`` as a LongTensor [N].

    Accepts a Hugging Face tokenizer (called with its default special tokens, as the perplexity protocol
    does), a ``tokenizers.Tokenizer`` (``encode(text).ids``), or any callable returning a list of ids.
    """
    if callable(tokenizer) and hasattr(tokenizer, "model_input_names"):        # transformers tokenizer
        ids = tokenizer(text, verbose=False)["input_ids"]
    elif hasattr(tokenizer, "encode"):
        out = tokenizer.encode(text)
        ids = out.ids if hasattr(out, "ids") else out
    elif callable(tokenizer):
        ids = tokenizer(text)
    else:
        raise SdquantError(f"cannot tokenize with a {type(tokenizer).__name__}: need a tokenizer or a callable")
    return torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.long).reshape(-1)


def sample_windows(stream: torch.Tensor, n_samples: int, seq_len: int, seed: int, sampling: str = "random",
                   source: str = "the data") -> torch.Tensor:
    """Cut n_samples windows of seq_len tokens from a token stream [N] -> LongTensor [n_samples, seq_len].

    Both modes need N >= n_samples * seq_len, so that the calibration set is not mostly repeated tokens.
    """
    n = int(stream.numel())
    need = n_samples * seq_len
    if n < need:
        raise ConfigError("data", f"{source} has {n:,} tokens but data.n_samples × data.seq_len = "
                          f"{n_samples} × {seq_len} needs {need:,}; give more text or lower n_samples/seq_len")
    rng = random.Random(seed)
    if sampling == "random":
        starts = [rng.randint(0, n - seq_len) for _ in range(n_samples)]
    elif sampling == "packed":
        starts = [w * seq_len for w in sorted(rng.sample(range(n // seq_len), n_samples))]
    else:
        raise ConfigError("data.sampling", f"unknown sampling {sampling!r}; expected 'random' or 'packed'")
    idx = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(seq_len)[None, :]   # [n_samples, seq_len]
    return stream.reshape(-1)[idx].contiguous()


def _bos_id(tokenizer: Any, model: Any) -> int:
    for src in (tokenizer, getattr(model, "config", None), getattr(model, "generation_config", None)):
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(src, name, None) if src is not None else None
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if isinstance(v, int):
                return v
    raise SdquantError("data.kind='self' needs a start token: neither the tokenizer nor the model config "
                       "defines bos_token_id or eos_token_id")


def _special_ids(tokenizer: Any, model: Any) -> List[int]:
    """EOS/pad ids: never sampled, so every self-generated window is one continuous text."""
    out = set()
    for src in (tokenizer, getattr(model, "config", None), getattr(model, "generation_config", None)):
        for name in ("eos_token_id", "pad_token_id"):
            v = getattr(src, name, None) if src is not None else None
            for i in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(i, int):
                    out.add(i)
    return sorted(out)


def _logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and "logits" in out:
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise SdquantError(f"the model returned {type(out).__name__}; expected logits (a tensor or an object with .logits)")


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _cache_kwarg(model: Any) -> Optional[str]:
    """Name of the forward's KV-cache argument: ``cache`` (transformers >= 5.2x), ``past_key_values`` (older),
    or None for a model without one (then every step recomputes the whole prefix)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return None
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


@torch.inference_mode()
def generate_self(model: Any, n_samples: int, seq_len: int, *, seed: int = 0, temperature: float = 1.0,
                  top_k: int = 50, bos_token_id: int, banned_token_ids: Sequence[int] = (),
                  batch_size: int = 32,
                  progress: Optional[Union[bool, Callable[[int, int], None]]] = None) -> torch.Tensor:
    """Data-free calibration: sample n_samples sequences of seq_len tokens from the model, each starting at
    ``bos_token_id`` -> LongTensor [n_samples, seq_len] (on the CPU).

    Sampling draws from a private CPU ``torch.Generator`` seeded with ``seed`` (the global RNG is untouched);
    tokens in ``banned_token_ids`` (EOS, pad) are never drawn. Uses the model's KV cache when its forward
    takes one (any HF causal LM: ``cache`` or ``past_key_values``); otherwise recomputes the prefix each step.
    ``progress``: True for a tqdm bar, or callable(done, total) called after every decoding step.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = _model_device(model)
    cache_kw = _cache_kwarg(model)
    total, done = math.ceil(n_samples / batch_size) * (seq_len - 1), 0
    bar = None
    if progress is True:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="self-generating calibration text", unit="step")
        progress = lambda d, _t: bar.update(d - bar.n)  # noqa: E731
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        out = torch.empty(n_samples, seq_len, dtype=torch.long)
        for start in range(0, n_samples, batch_size):
            b = min(batch_size, n_samples - start)
            seqs = torch.full((b, 1), bos_token_id, dtype=torch.long)                 # [b, t]
            past = None
            for _ in range(1, seq_len):
                if cache_kw is not None:
                    step_in = seqs if past is None else seqs[:, -1:]               # only the new token once cached
                    res = model(input_ids=step_in.to(device), use_cache=True, **{cache_kw: past})
                    past = getattr(res, cache_kw, None)
                    if past is None:
                        past = getattr(res, "past_key_values" if cache_kw == "cache" else "cache", None)
                    if past is None:                                           # forward ignored the cache
                        cache_kw = None
                else:
                    res = model(seqs.to(device))
                logits = _logits_of(res)[:, -1, :].float().cpu() / temperature         # [b, V]
                if banned_token_ids:
                    logits[:, [i for i in banned_token_ids if i < logits.shape[1]]] = float("-inf")
                if 0 < top_k < logits.shape[1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)   # [b, 1]
                seqs = torch.cat([seqs, nxt], dim=1)
                done += 1
                if progress:
                    progress(done, total)
            out[start:start + b] = seqs
        return out
    finally:
        if bar is not None:
            bar.close()
        if was_training and hasattr(model, "train"):
            model.train()


# --------------------------------------------------------------------------------------------- tensors

def load_tensor_file(path: str, n_samples: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Calibration inputs for non-text models: a safetensors file whose tensors share their first dimension
    (the sample index). Returns the first ``n_samples`` samples of each tensor, validated."""
    try:
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in sorted(f.keys())}
    except Exception as e:  # SafetensorError for a bad header, OSError for unreadable files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError("data.path", f"cannot read safetensors file {path}: {msg}") from None
    if not tensors:
        raise ConfigError("data.path", f"{path} holds no tensors")
    n_rows = None
    for name, t in tensors.items():
        if t.dim() == 0:
            raise ConfigError("data.path", f"{path}: tensor {name!r} is a scalar; every tensor needs a sample "
                              "dimension")
        if t.is_complex():
            raise ConfigError("data.path", f"{path}: tensor {name!r} is complex ({t.dtype}); not a model input")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ConfigError("data.path", f"{path}: tensor {name!r} holds NaN or Inf values")
        if n_rows is None:
            n_rows, first = t.shape[0], name
        elif t.shape[0] != n_rows:
            raise ConfigError("data.path", f"{path}: tensors disagree on the sample count: {first!r} has "
                              f"{n_rows}, {name!r} has {t.shape[0]} (first dimension)")
    if n_rows == 0:
        raise ConfigError("data.path", f"{path} holds 0 samples")
    if n_samples is not None:
        if n_rows < n_samples:
            raise ConfigError("data.n_samples",
                              f"{path} holds {n_rows} samples but data.n_samples asks for {n_samples}")
        tensors = {k: v[:n_samples].contiguous() for k, v in tensors.items()}
    return tensors


# --------------------------------------------------------------------------------------------- fingerprint

def fingerprint(tensors: Mapping[str, torch.Tensor], params: Optional[Mapping[str, Any]] = None) -> str:
    """sha256 (hex) over the sampling parameters and every tensor's name, dtype, shape and bytes.
    Independent of where the data came from (path, kind), so moved files still match."""
    h = hashlib.sha256()
    h.update(json.dumps({"v": _FINGERPRINT_VERSION, "params": dict(params or {})}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
