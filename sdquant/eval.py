"""Evaluation: perplexity of causal LMs, embedding fidelity of encoders, and error metrics on tensors.

These are the measurements the quality benchmark, ``sdquant eval`` and the tests share, so a number in
docs/benchmarks/calibration.md and a number printed by the CLI come from the same code.

Perplexity protocol (the GPTQ/AWQ papers'): tokenize the whole evaluation text once (wikitext-2 test
split joined with "\\n\\n"), cut it into non-overlapping windows of ``seq_len`` tokens from the start
(the tail shorter than a window is dropped), score every window independently with fp32 log-softmax
(each window predicts its tokens 2..seq_len), and report ``ppl = exp(total NLL / predicted tokens)``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from sdquant.data import _logits_of, _model_device, encode_text
from sdquant.errors import ConfigError, SdquantError, ShapeError

Progress = Optional[Union[bool, Callable[[int, int], None]]]


class _eval_mode:
    """Put a module in eval mode for the duration and restore its previous mode after (no lasting side effect)."""

    def __init__(self, *models):
        self.models = [m for m in models if hasattr(m, "training")]

    def __enter__(self):
        self.was = [m.training for m in self.models]
        for m in self.models:
            m.eval()

    def __exit__(self, *exc):
        for m, was in zip(self.models, self.was):
            m.train(was)


def _progress_fn(progress: Progress, total: int, desc: str):
    """Normalize ``progress`` (None/False: silent, True: tqdm bar, callable(done, total)) to (step, close)."""
    if progress is True:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc=desc, unit="win")
        return (lambda done, _total: bar.update(done - bar.n)), bar.close
    if callable(progress):
        return progress, (lambda: None)
    return (lambda done, _total: None), (lambda: None)


def _forward(model: Any, ids: torch.Tensor) -> torch.Tensor:
    # HF models: no KV cache for a single scoring pass (saves memory); anything else: plain model(ids)
    if getattr(model, "config", None) is not None and hasattr(model, "generate"):
        return _logits_of(model(input_ids=ids, use_cache=False))
    return _logits_of(model(ids))


@torch.inference_mode()
def window_nll(model: Any, windows: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of each window: LongTensor [B, L] -> float64 [B] (L - 1 predictions each;
    fp32 log-softmax, float64 sums)."""
    logits = _forward(model, windows)                                  # [B, L, V]
    if logits.dim() != 3 or logits.shape[:2] != windows.shape:
        raise ShapeError(f"model logits have shape {tuple(logits.shape)}; expected [{windows.shape[0]}, "
                         f"{windows.shape[1]}, vocab]")
    b, length, vocab = logits.shape
    targets = windows[:, 1:].to(logits.device).reshape(-1)                # [B*(L-1)]
    # flat [tokens, V] on purpose: torch's CPU cross_entropy with the class dim in the middle ([B, V, L]) was
    # measured 4e-5 nats/token off the float64 value on SmolLM2; the flat form is within 2e-6
    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), targets, reduction="none")
    return nll.view(b, length - 1).double().sum(dim=1).cpu()


def perplexity(model: Any, tokenizer_or_ids: Any, text: Optional[str] = None, seq_len: int = 2048,
               windows: Optional[int] = None, batch_size: int = 1, device: Any = None,
               progress: Progress = None) -> Dict[str, Any]:
    """Perplexity of a causal LM over the first ``windows`` non-overlapping ``seq_len``-token windows of a text.

    ``tokenizer_or_ids`` is a tokenizer (then ``text`` is tokenized with it, see ``sdquant.data.encode_text``)
    or the token ids themselves (LongTensor / list, [N] or [1, N]; ``text`` is then ignored). The model may be
    any HF causal LM or any module mapping ids [B, L] to logits [B, L, V] (a tensor, a tuple whose first item is
    the logits, or an object with ``.logits``). It stays where it is; ids are moved to ``device`` (default: the
    device of the model's first parameter). The model is put in eval mode and its mode restored afterwards.

    Returns ``{"ppl", "nll" (mean per predicted token), "n_tokens" (predicted tokens), "windows", "seq_len",
    "window_nll" (mean NLL of each window)}``. Deterministic: same model, text and arguments, same numbers.
    """
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, f"must be a positive integer, got {v!r}")
    if seq_len < 2:
        raise ConfigError("seq_len", f"must be at least 2 tokens to predict anything, got {seq_len}")
    if isinstance(tokenizer_or_ids, (torch.Tensor, list, tuple)):
        ids = torch.as_tensor(tokenizer_or_ids, dtype=torch.long).reshape(-1)
    else:
        if not isinstance(text, str):
            raise SdquantError("perplexity: give the text to score (or pass token ids instead of a tokenizer)")
        ids = encode_text(tokenizer_or_ids, text)
    available = ids.numel() // seq_len
    if available == 0:
        raise ConfigError("seq_len", f"the text has {ids.numel():,} tokens, fewer than one window of {seq_len}")
    if windows is None:
        windows = available
    elif isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ConfigError("windows", f"must be a positive integer, got {windows!r}")
    elif windows > available:
        raise ConfigError("windows", f"the text has {ids.numel():,} tokens = {available} windows of {seq_len}; "
                          f"asked for {windows}")
    dev = torch.device(device) if device is not None else _model_device(model)
    chunks = ids[: windows * seq_len].reshape(windows, seq_len)             # [windows, seq_len]

    step, close = _progress_fn(progress, windows, "perplexity")
    per_window = []
    try:
        with _eval_mode(model):
            for start in range(0, windows, batch_size):
                per_window.append(window_nll(model, chunks[start:start + batch_size].to(dev)))
                step(min(start + batch_size, windows), windows)
    finally:
        close()
    sums = torch.cat(per_window)                                            # [windows] float64
    n_pred = windows * (seq_len - 1)
    nll = float(sums.sum()) / n_pred
    return {"ppl": math.exp(nll), "nll": nll, "n_tokens": n_pred, "windows": windows, "seq_len": seq_len,
            "window_nll": [float(s) / (seq_len - 1) for s in sums]}


# --------------------------------------------------------------------------------------------- encoders

@torch.inference_mode()
def sentence_embeddings(model: Any, sentences: Sequence[str], tokenizer: Any, batch_size: int = 32,
                        max_length: int = 256, device: Any = None) -> torch.Tensor:
    """Mean-pooled last hidden states (padding excluded) of a BERT-style encoder -> FloatTensor [n, hidden].
    This is the sentence-transformers pooling of all-MiniLM-L6-v2 (before its L2 normalization, which the
    cosine makes irrelevant)."""
    if isinstance(sentences, str) or len(sentences) == 0:
        raise SdquantError("sentence_embeddings: give a non-empty list of sentences")
    dev = torch.device(device) if device is not None else _model_device(model)
    out = []
    with _eval_mode(model):
        for i in range(0, len(sentences), batch_size):
            enc = tokenizer(list(sentences[i:i + batch_size]), padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt")
            enc = {k: v.to(dev) for k, v in enc.items()}
            res = model(**enc)
            hidden = res.last_hidden_state if hasattr(res, "last_hidden_state") else _logits_of(res)  # [b, T, H]
            mask = enc["attention_mask"].unsqueeze(-1).float()                                        # [b, T, 1]
            out.append(((hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1.0)).cpu())
    return torch.cat(out)


def embedding_cosine(model_a: Any, model_b: Any, sentences: Sequence[str], tokenizer: Any,
                     batch_size: int = 32, device: Any = None) -> Dict[str, Any]:
    """Cosine similarity between two encoders' sentence embeddings, per sentence -> {"mean", "min", "cosines"}.
    Typical use: model_a = the quantized encoder, model_b = the float one."""
    a = sentence_embeddings(model_a, sentences, tokenizer, batch_size, device=device)
    b = sentence_embeddings(model_b, sentences, tokenizer, batch_size, device=device)
    cos = F.cosine_similarity(a.double(), b.double(), dim=-1)                  # [n]
    return {"mean": float(cos.mean()), "min": float(cos.min()), "cosines": cos.tolist()}


# --------------------------------------------------------------------------------------------- tensor metrics

def _pair(a: torch.Tensor, b: torch.Tensor, name: str):
    if a.shape != b.shape:
        raise ShapeError(f"{name}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    return a.detach().double(), b.detach().to(a.device).double()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius), b being the reference. 0 when equal; inf when b is 0 and a is not."""
    a, b = _pair(a, b, "relative_error")
    num, den = torch.linalg.vector_norm(a - b), torch.linalg.vector_norm(b)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return float(num / den)


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: Optional[float] = None) -> float:
    """Peak signal-to-noise ratio in dB of a against the reference b: 10·log10(range² / MSE).
    ``data_range`` defaults to b.max() - b.min() (1.0 if b is constant); identical inputs give inf."""
    a, b = _pair(a, b, "psnr")
    mse = float(((a - b) ** 2).mean())
    if data_range is None:
        data_range = float(b.max() - b.min()) or 1.0
    if mse == 0:
        return math.inf
    return 10.0 * math.log10(data_range ** 2 / mse)


def _gaussian_window(size: int, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]                              # [1, 1, size, size]


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: Optional[float] = None, window: int = 11) -> float:
    """Mean structural similarity (Wang et al. 2004; Gaussian window 11, sigma 1.5, K1=0.01, K2=0.03) of a
    against the reference b over their last two dims, treated as images; leading dims ([B, C] of an image
    latent, [B, C, T] of a video latent) are independent slices. The window shrinks to fit small latents.
    ``data_range`` defaults to b's range. 1.0 for identical inputs."""
    a, b = _pair(a, b, "ssim")
    if a.dim() < 2:
        raise ShapeError(f"ssim: need at least 2 dims [..., H, W], got shape {tuple(a.shape)}")
    h, w = a.shape[-2:]
    size = min(window, h, w)
    size -= (size + 1) % 2                                                   # odd, so the window has a centre
    if data_range is None:
        data_range = float(b.max() - b.min()) or 1.0
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    x, y = a.reshape(-1, 1, h, w), b.reshape(-1, 1, h, w)                    # [S, 1, H, W]
    g = _gaussian_window(size).to(x.device)
    mu_x, mu_y = F.conv2d(x, g), F.conv2d(y, g)
    sxx = F.conv2d(x * x, g) - mu_x ** 2
    syy = F.conv2d(y * y, g) - mu_y ** 2
    sxy = F.conv2d(x * y, g) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))
    return float(s.mean())


def perplexity_file(model: Any, tokenizer: Any, path: str, seq_len: int = 2048, windows: Optional[int] = None,
                    batch_size: int = 1, device: Any = None, progress: Progress = None) -> Dict[str, Any]:
    """``perplexity`` of a UTF-8 text file (what ``sdquant eval --text FILE`` runs); errors name ``text``."""
    from sdquant.data import read_text_file
    text = read_text_file(path, field="text")
    if not text.strip():
        raise ConfigError("text", f"{path} contains no text")
    res = perplexity(model, tokenizer, text, seq_len=seq_len, windows=windows, batch_size=batch_size,
                     device=device, progress=progress)
    return {**res, "text": str(path)}
