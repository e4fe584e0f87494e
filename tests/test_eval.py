"""Evaluation helpers: perplexity against an independent computation, encoder cosine, tensor metrics."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sdquant import eval as E
from sdquant.errors import ConfigError, SdquantError, ShapeError

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
VOCAB = 50


def tiny_llama(seed=0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    conf = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(conf).eval()


def token_ids(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- perplexity

def test_perplexity_equals_exp_of_mean_nll_computed_directly():
    model, ids = tiny_llama(), token_ids(5 * 32 + 7)                       # the 7-token tail is dropped
    res = E.perplexity(model, ids, seq_len=32)
    assert res["windows"] == 5 and res["n_tokens"] == 5 * 31 and res["seq_len"] == 32
    # independent path 1: transformers' own shifted cross-entropy (labels=) per window
    with torch.no_grad():
        losses = [float(model(ids[i * 32:(i + 1) * 32][None], labels=ids[i * 32:(i + 1) * 32][None]).loss)
                  for i in range(5)]
    assert res["ppl"] == pytest.approx(math.exp(sum(losses) / 5), rel=1e-5)
    assert res["window_nll"] == pytest.approx(losses, rel=1e-5)
    # independent path 2: log-softmax and gather over the whole batch at once
    with torch.no_grad():
        x = ids[:160].reshape(5, 32)
        logp = torch.log_softmax(model(x).logits.double(), -1)[:, :-1]     # [5, 31, V]
        nll = -logp.gather(-1, x[:, 1:, None]).mean()
    assert res["nll"] == pytest.approx(float(nll), rel=2e-6)                  # fp32 scoring vs a float64 oracle
    assert res["ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-5)


def test_perplexity_is_deterministic_and_batch_size_independent():
    model, ids = tiny_llama(1), token_ids(6 * 24, seed=1)
    a = E.perplexity(model, ids, seq_len=24)
    assert E.perplexity(model, ids, seq_len=24) == a
    b = E.perplexity(model, ids, seq_len=24, batch_size=4)                # batches of 4 and 2
    assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-5)
    first2 = E.perplexity(model, ids, seq_len=24, windows=2)
    assert first2["windows"] == 2 and first2["window_nll"] == pytest.approx(a["window_nll"][:2], rel=1e-6)


def test_perplexity_runs_in_eval_mode_and_restores_the_mode():
    model, ids = tiny_llama(2, attention_dropout=0.5), token_ids(4 * 16, seed=2)
    model.train()
    a, b = E.perplexity(model, ids, seq_len=16), E.perplexity(model, ids, seq_len=16)
    assert a == b and model.training                                       # dropout off during, mode restored after


def test_perplexity_with_a_tokenizer_and_with_plain_logit_models():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    words = [f"w{i}" for i in range(VOCAB)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    g = torch.Generator().manual_seed(3)
    text = " ".join(words[int(i)] for i in torch.randint(0, VOCAB, (100,), generator=g))
    model = tiny_llama(3)
    ref = E.perplexity(model, torch.tensor(tok.encode(text).ids), seq_len=20)
    assert E.perplexity(model, tok, text, seq_len=20) == ref

    class TensorOut(torch.nn.Module):                                       # returns logits as a bare tensor
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).logits

    class TupleOut(TensorOut):
        def forward(self, x):
            return (self.m(x).logits, None)

    for wrapped in (TensorOut(model), TupleOut(model)):
        assert E.perplexity(wrapped, tok, text, seq_len=20)["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)


def test_perplexity_progress_callback_and_file(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    tk = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tk.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk)
    text = " ".join(f"w{(i * 7) % VOCAB}" for i in range(90))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    calls = []
    res = E.perplexity_file(tiny_llama(), hf, str(tmp_path / "t.txt"), seq_len=20, batch_size=3,
                            progress=lambda done, total: calls.append((done, total)))
    assert calls == [(3, 4), (4, 4)] and res["windows"] == 4 and res["text"].endswith("t.txt")
    assert res == {**E.perplexity(tiny_llama(), hf, text, seq_len=20, progress=True), "text": str(tmp_path / "t.txt")}
    with pytest.raises(ConfigError, match=r"^text: no such file: .*missing\.txt$"):
        E.perplexity_file(tiny_llama(), hf, str(tmp_path / "missing.txt"))
    (tmp_path / "e.txt").write_text("\n \n")
    with pytest.raises(ConfigError, match=r"^text: .*e\.txt contains no text$"):
        E.perplexity_file(tiny_llama(), hf, str(tmp_path / "e.txt"))


def test_perplexity_errors():
    model, ids = tiny_llama(), token_ids(50)
    with pytest.raises(ConfigError, match=r"^seq_len: the text has 50 tokens, fewer than one window of 64$"):
        E.perplexity(model, ids, seq_len=64)
    with pytest.raises(ConfigError, match=r"^windows: the text has 50 tokens = 2 windows of 20; asked for 3$"):
        E.perplexity(model, ids, seq_len=20, windows=3)
    with pytest.raises(ConfigError, match=r"^windows: must be a positive integer, got 0$"):
        E.perplexity(model, ids, seq_len=20, windows=0)
    with pytest.raises(ConfigError, match=r"^seq_len: must be at least 2 tokens"):
        E.perplexity(model, ids, seq_len=1)
    with pytest.raises(ConfigError, match=r"^batch_size: must be a positive integer"):
        E.perplexity(model, ids, seq_len=10, batch_size=0)
    with pytest.raises(SdquantError, match="give the text to score"):
        E.perplexity(model, object(), None)

    class Pooled(torch.nn.Module):                                          # not a language model
        def forward(self, x):
            return torch.zeros(x.shape[0], 8)

    with pytest.raises(ShapeError, match=r"model logits have shape \(1, 8\); expected \[1, 10, vocab\]"):
        E.perplexity(Pooled(), ids, seq_len=10)


# --------------------------------------------------------------------------------------------- encoders

def tiny_bert_and_tokenizer(seed=0):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
    words = "the cat dog sat on a mat ran far away".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")
    conf = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return BertModel(conf).eval(), tok


SENTENCES = ["the cat sat on the mat", "a dog ran far away", "the dog sat", "cat"]


def test_embedding_cosine_is_one_for_identical_models_and_drops_with_noise():
    model, tok = tiny_bert_and_tokenizer()
    same = E.embedding_cosine(model, model, SENTENCES, tok)
    assert same["mean"] == pytest.approx(1.0, abs=1e-6) and len(same["cosines"]) == 4
    noisy, _ = tiny_bert_and_tokenizer()
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    res = E.embedding_cosine(noisy, model, SENTENCES, tok)
    assert 0.0 < res["min"] <= res["mean"] < 0.9999


def test_sentence_embeddings_ignore_padding():
    model, tok = tiny_bert_and_tokenizer()
    together = E.sentence_embeddings(model, SENTENCES, tok)                 # "cat" is padded to 6 tokens here
    alone = torch.cat([E.sentence_embeddings(model, [s], tok) for s in SENTENCES])
    assert together.shape == (4, 32)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(SdquantError, match="non-empty list of sentences"):
        E.sentence_embeddings(model, [], tok)


# --------------------------------------------------------------------------------------------- tensor metrics

def test_relative_error_and_psnr_known_values():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])
    assert E.relative_error(a, b) == pytest.approx(math.sqrt(10) / 5)
    assert E.relative_error(b, b) == 0.0
    assert E.relative_error(torch.zeros(2), torch.zeros(2)) == 0.0 and E.relative_error(a, torch.zeros(2)) == math.inf
    ref = torch.tensor([0.0, 1.0, 0.5, 0.25])
    assert E.psnr(ref + 0.1, ref) == pytest.approx(20.0)                   # range 1, MSE 0.01
    assert E.psnr(ref + 0.1, ref, data_range=10.0) == pytest.approx(40.0)
    assert E.psnr(ref, ref) == math.inf
    # half precision inputs are promoted, not overflowed
    assert E.psnr(ref.half() + 0.1, ref.half()) == pytest.approx(20.0, abs=0.05)
    with pytest.raises(ShapeError, match=r"relative_error: shapes differ, \(2,\) vs \(4,\)"):
        E.relative_error(a, ref)


def _ssim_reference(x, y, L):
    """SSIM by its definition for one image whose size equals the window (a single window position)."""
    n = x.shape[-1]
    c = (n - 1) / 2
    idx = torch.arange(n, dtype=torch.float64) - c
    g = torch.exp(-idx ** 2 / (2 * 1.5 ** 2))
    w = (g[:, None] * g[None, :]) / (g.sum() ** 2)
    mx, my = (w * x).sum(), (w * y).sum()
    vx, vy = (w * (x - mx) ** 2).sum(), (w * (y - my) ** 2).sum()
    cxy = (w * (x - mx) * (y - my)).sum()
    c1, c2 = (0.01 * L) ** 2, (0.03 * L) ** 2
    return float((2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))


def test_ssim_matches_the_definition_and_orders_noise_levels():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(7, 7, generator=g, dtype=torch.float64)
    y = x + 0.2 * torch.randn(7, 7, generator=g, dtype=torch.float64)
    assert E.ssim(y, x, data_range=1.0, window=7) == pytest.approx(_ssim_reference(y, x, 1.0), rel=1e-9)
    lat = torch.randn(2, 4, 3, 16, 16, generator=g)                         # [B, C, T, H, W] video latent
    assert E.ssim(lat, lat) == pytest.approx(1.0)
    scores = [E.ssim(lat + s * torch.randn(lat.shape, generator=g), lat) for s in (0.01, 0.1, 0.5)]
    assert 1.0 > scores[0] > scores[1] > scores[2]
    assert E.ssim(lat[..., :4, :5], lat[..., :4, :5]) == pytest.approx(1.0)   # window shrinks to 3 for a 4×5 latent
    with pytest.raises(ShapeError, match=r"ssim: need at least 2 dims"):
        E.ssim(torch.ones(5), torch.ones(5))
    with pytest.raises(ShapeError, match="ssim: shapes differ"):
        E.ssim(torch.ones(4, 4), torch.ones(4, 5))


# --------------------------------------------------------------------------------------------- real models

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_perplexity_on_wikitext_windows(smollm2_dir):
    if not (SHARED_DATA / "wikitext2_test.txt").exists():
        pytest.skip("../shared/data/wikitext2_test.txt not present")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = str(smollm2_dir)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOL_GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOL_GGUF, dtype=torch.float32).eval()
    text = (SHARED_DATA / "wikitext2_test.txt").read_text(encoding="utf-8")
    res = E.perplexity(model, tok, text[:20_000], seq_len=256, windows=3)
    ids = tok(text[:20_000])["input_ids"]
    with torch.no_grad():
        losses = [float(model(torch.tensor([ids[i * 256:(i + 1) * 256]]),
                              labels=torch.tensor([ids[i * 256:(i + 1) * 256]])).loss) for i in range(3)]
    assert res["ppl"] == pytest.approx(math.exp(sum(losses) / 3), rel=2e-5)
    assert 5.0 < res["ppl"] < 80.0                                          # a trained model, not a random one


@pytest.mark.slow
def test_minilm_embedding_cosine(minilm_dir):
    d = str(minilm_dir)
    from transformers import AutoModel, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(d), AutoModel.from_pretrained(d, dtype=torch.float32).eval()
    s = ["A man is playing a guitar.", "Someone plays an acoustic guitar.", "The stock market fell sharply today."]
    emb = E.sentence_embeddings(model, s, tok)
    cos = torch.nn.functional.cosine_similarity(emb[:, None], emb[None], dim=-1)
    assert cos[0, 1] > 0.5 > cos[0, 2]                                      # the pooling gives meaningful embeddings
    assert E.embedding_cosine(model, model, s, tok)["mean"] == pytest.approx(1.0, abs=1e-6)
