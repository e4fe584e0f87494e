"""Calibration data: every source kind on tiny files, the seeded window protocol, the error messages,
determinism and the fingerprint."""
from __future__ import annotations

import json
import random
import types

import pytest
import torch
from safetensors.torch import save_file

from sdquant import data as D
from sdquant.errors import ConfigError, SdquantError

WORDS = ("the a of to and in is was he for it with as his on be at by had not are but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first any "
         "my now such like our over man me even most made after also did many before must through back years "
         "where much your way well down should because each just those people mr how too little state good very "
         "make world still own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take three").split()


def make_docs(n_docs=40, words_per_doc=60, seed=1):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words_per_doc)) for _ in range(n_docs)]


@pytest.fixture(scope="module")
def tok():
    """A tiny word-level ``tokenizers.Tokenizer``: every word of WORDS plus [UNK]; whitespace splitting."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    t = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    return t


def cfg(**kw):
    base = dict(kind="text", path=None, field="text", n_samples=8, seq_len=16, seed=0)
    base.update(kw)
    return types.SimpleNamespace(**base)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------------------------- sources

def test_text_file_follows_the_seeded_window_protocol(tmp_path, tok):
    docs = make_docs()
    p = write(tmp_path / "c.txt", "\n\n".join(docs))
    cd = D.load_calibration(cfg(path=p, n_samples=8, seq_len=16, seed=3), tok)
    stream = torch.tensor(tok.encode("\n\n".join(docs)).ids)
    rng = random.Random(3)
    expected = torch.stack([stream[s:s + 16] for s in (rng.randint(0, len(stream) - 16) for _ in range(8))])
    assert cd.input_ids.dtype == torch.long and cd.input_ids.shape == (8, 16)
    assert torch.equal(cd.input_ids, expected)
    assert cd.n_tokens_available == len(stream) and cd.is_text and len(cd) == 8
    assert cd.source == f"text:{p}"


def test_jsonl_parquet_hf_disk_and_text_agree_on_the_same_documents(tmp_path, tok):
    docs = make_docs()
    txt = write(tmp_path / "c.txt", "\n\n".join(docs))
    jl = write_jsonl(tmp_path / "c.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    jl_custom = write_jsonl(tmp_path / "d.jsonl", [{"body": d} for d in docs])
    ref = D.load_calibration(cfg(path=txt), tok)
    assert torch.equal(D.load_calibration(cfg(kind="jsonl", path=jl), tok).input_ids, ref.input_ids)
    got = D.load_calibration(cfg(kind="jsonl", path=jl_custom, field="body"), tok)
    assert torch.equal(got.input_ids, ref.input_ids)
    # the fingerprint is about content, not about where the content came from
    assert got.fingerprint == ref.fingerprint

    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), tmp_path / "c.parquet")
    assert torch.equal(D.load_calibration(cfg(kind="parquet", path=str(tmp_path / "c.parquet")), tok).input_ids,
                       ref.input_ids)
    # a folder of parquet shards is read in name order
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.table({"text": docs[:20]}), tmp_path / "shards" / "part-0.parquet")
    pq.write_table(pa.table({"text": docs[20:]}), tmp_path / "shards" / "part-1.parquet")
    assert torch.equal(D.load_calibration(cfg(kind="parquet", path=str(tmp_path / "shards")), tok).input_ids,
                       ref.input_ids)


def test_hf_dataset_saved_to_disk(tmp_path, tok):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
    docs = make_docs()
    ref = D.load_calibration(cfg(path=write(tmp_path / "c.txt", "\n\n".join(docs))), tok)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    assert torch.equal(D.load_calibration(cfg(kind="hf_disk", path=str(tmp_path / "ds")), tok).input_ids,
                       ref.input_ids)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": docs}),
                               "validation": datasets.Dataset.from_dict({"content": docs[:2]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    got = D.load_calibration(cfg(kind="hf_disk", path=str(tmp_path / "dd"), field="content"), tok)
    assert torch.equal(got.input_ids, ref.input_ids)                      # "train" is the default split
    with pytest.raises(ConfigError, match=r"^data\.split: .*no split 'test' \(splits: train, validation\)"):
        D.load_calibration(cfg(kind="hf_disk", path=str(tmp_path / "dd"), field="content", split="test"), tok)
    with pytest.raises(ConfigError, match=r"^data\.field: .*no column 'text' \(columns: content\)"):
        D.load_calibration(cfg(kind="hf_disk", path=str(tmp_path / "dd")), tok)
    # "auto" recognises a saved dataset folder
    assert D.detect_kind(str(tmp_path / "ds")) == "hf_disk"
    with pytest.raises(ConfigError, match=r"^data\.path: cannot load a saved dataset from"):
        D.load_calibration(cfg(kind="hf_disk", path=str(tmp_path)), tok)


def test_text_folder_and_auto_kind(tmp_path, tok):
    docs = make_docs()
    (tmp_path / "f").mkdir()
    for i, d in enumerate(docs):
        write(tmp_path / "f" / f"{i:03d}.txt", d)
    write(tmp_path / "f" / "notes.md", "ignored")
    ref = D.load_calibration(cfg(path=write(tmp_path / "c.txt", "\n\n".join(docs))), tok)
    assert torch.equal(D.load_calibration(cfg(path=str(tmp_path / "f")), tok).input_ids, ref.input_ids)
    jl = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    assert torch.equal(D.load_calibration(cfg(kind="auto", path=jl), tok).input_ids, ref.input_ids)
    assert D.detect_kind(str(tmp_path / "x.safetensors")) == "tensors"
    assert D.detect_kind(str(tmp_path / "x.parquet")) == "parquet"
    assert D.detect_kind(str(tmp_path / "c.txt")) == "text"


def test_builtin_text_is_package_data_and_needs_no_download():
    text = D.builtin_text()
    assert "public domain" in text[:300] and len(text) > 30_000
    byte_tok = lambda s: list(s.encode("utf-8"))                          # a plain callable tokenizer
    cd = D.load_calibration(types.SimpleNamespace(kind="builtin", n_samples=16, seq_len=256), byte_tok)
    assert cd.input_ids.shape == (16, 256) and cd.source.startswith("builtin")
    assert bytes(cd.input_ids[0].tolist()).decode("utf-8", errors="replace") in text.encode().decode("utf-8")
    # the default config (kind builtin) reads the same file
    assert D.load_calibration({"n_samples": 16, "seq_len": 256}, byte_tok).fingerprint == cd.fingerprint


def test_works_with_the_frozen_config_dataclass(tmp_path, tok):
    config = pytest.importorskip("sdquant.config")
    p = write(tmp_path / "c.txt", "\n\n".join(make_docs()))
    dc = config.DataConfig(kind="text", path=p, n_samples=4, seq_len=32, seed=5)
    cd = D.load_calibration(dc, tok)
    assert cd.input_ids.shape == (4, 32)
    assert torch.equal(cd.input_ids, D.load_calibration(
        {"kind": "text", "path": p, "n_samples": 4, "seq_len": 32, "seed": 5}, tok).input_ids)


def test_hf_tokenizer_and_raw_tokenizer_give_the_same_ids(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    p = write(tmp_path / "c.txt", "\n\n".join(make_docs()))
    assert torch.equal(D.load_calibration(cfg(path=p), hf).input_ids, D.load_calibration(cfg(path=p), tok).input_ids)


# --------------------------------------------------------------------------------------------- sampling

def test_determinism_and_seed_sensitivity(tmp_path, tok):
    p = write(tmp_path / "c.txt", "\n\n".join(make_docs()))
    a, b = D.load_calibration(cfg(path=p, seed=7), tok), D.load_calibration(cfg(path=p, seed=7), tok)
    c = D.load_calibration(cfg(path=p, seed=8), tok)
    assert torch.equal(a.input_ids, b.input_ids) and a.fingerprint == b.fingerprint
    assert not torch.equal(a.input_ids, c.input_ids) and a.fingerprint != c.fingerprint
    # no global RNG is consumed
    state, py_state = torch.random.get_rng_state(), random.getstate()
    D.load_calibration(cfg(path=p, seed=7), tok)
    assert torch.equal(state, torch.random.get_rng_state()) and py_state == random.getstate()


def test_packed_sampling_gives_disjoint_aligned_windows(tmp_path, tok):
    p = write(tmp_path / "c.txt", "\n\n".join(make_docs()))
    cd = D.load_calibration(cfg(path=p, sampling="packed", n_samples=10, seq_len=32, seed=1), tok)
    stream = torch.tensor(tok.encode(open(p).read()).ids)
    rng = random.Random(1)
    starts = [w * 32 for w in sorted(rng.sample(range(len(stream) // 32), 10))]
    assert torch.equal(cd.input_ids, torch.stack([stream[s:s + 32] for s in starts]))
    assert cd.params["sampling"] == "packed"
    assert cd.fingerprint != D.load_calibration(cfg(path=p, n_samples=10, seq_len=32, seed=1), tok).fingerprint


def test_batches_cover_every_sample_in_order(tmp_path, tok):
    p = write(tmp_path / "c.txt", "\n\n".join(make_docs()))
    cd = D.load_calibration(cfg(path=p, n_samples=7), tok)
    bs = list(cd.batches(3))
    assert [b["input_ids"].shape[0] for b in bs] == [3, 3, 1]
    assert torch.equal(torch.cat([b["input_ids"] for b in bs]), cd.input_ids)
    with pytest.raises(ConfigError, match="^batch_size: must be a positive integer"):
        next(cd.batches(0))
    s = cd.summary()
    assert s["n_samples"] == 7 and s["tensors"]["input_ids"] == ["int64", [7, 16]]
    assert s["fingerprint"] == cd.fingerprint


def test_fingerprint_covers_params_dtype_and_values():
    t = {"x": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    f = D.fingerprint(t, {"n_samples": 3})
    assert f == D.fingerprint({"x": t["x"].clone()}, {"n_samples": 3}) and len(f) == 64
    assert f != D.fingerprint(t, {"n_samples": 4})
    assert f != D.fingerprint({"x": t["x"].double()}, {"n_samples": 3})
    assert f != D.fingerprint({"x": t["x"].reshape(4, 3)}, {"n_samples": 3})
    y = t["x"].clone(); y[2, 3] += 1e-6
    assert f != D.fingerprint({"x": y}, {"n_samples": 3})
    assert f != D.fingerprint({"y": t["x"]}, {"n_samples": 3})
    assert len(D.fingerprint({"b": torch.zeros(2, dtype=torch.bfloat16), "m": torch.ones(2, dtype=torch.bool)})) == 64


# --------------------------------------------------------------------------------------------- self-generation

def tiny_llama(vocab=40, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    conf = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(conf).eval()


def test_self_generation_is_seeded_and_leaves_global_rng_alone():
    model = tiny_llama()
    c = dict(kind="self", n_samples=3, seq_len=20, seed=11, temperature=1.0, top_k=0)
    state = torch.random.get_rng_state()
    a = D.load_calibration(c, None, model)
    assert torch.equal(state, torch.random.get_rng_state())
    b = D.load_calibration(c, None, model)
    other = D.load_calibration({**c, "seed": 12}, None, model)
    assert a.input_ids.shape == (3, 20) and torch.equal(a.input_ids, b.input_ids) and a.fingerprint == b.fingerprint
    assert not torch.equal(a.input_ids, other.input_ids)
    assert (a.input_ids[:, 0] == 1).all()                                  # every sample starts at BOS
    assert not torch.isin(a.input_ids[:, 1:], torch.tensor([0, 2])).any()  # EOS / pad never drawn
    assert a.params["sampling"] == "self" and a.source == "self"


def test_self_generation_top1_is_greedy_with_kv_cache_equal_to_full_recompute():
    model = tiny_llama(seed=3)
    steps = []
    ids = D.generate_self(model, 2, 12, seed=0, top_k=1, bos_token_id=1, banned_token_ids=[2], batch_size=1,
                          progress=lambda done, total: steps.append((done, total)))
    assert steps == [(i, 22) for i in range(1, 23)]                      # 2 chunks × 11 decoding steps
    # recompute every step from the full prefix (no cache): top-1 sampling must pick the argmax each time
    with torch.no_grad():
        logits = model(ids).logits.float()                                   # [2, 12, V]
    logits[..., 2] = float("-inf")
    assert torch.equal(ids[:, 1:], logits[:, :-1].argmax(-1))

    class LogitsOnly(torch.nn.Module):                                      # no kwargs, no cache: fallback path
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).logits

    assert torch.equal(D.generate_self(LogitsOnly(model), 2, 12, seed=0, top_k=1, bos_token_id=1,
                                       banned_token_ids=[2], progress=True), ids)      # tqdm bar, one batch


def test_self_generation_errors():
    with pytest.raises(SdquantError, match="pass model="):
        D.load_calibration({"kind": "self"}, None, None)
    with pytest.raises(ConfigError, match=r"^data\.temperature: must be a positive number"):
        D.load_calibration({"kind": "self", "temperature": 0}, None, tiny_llama())

    class NoIds(torch.nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(SdquantError, match="defines bos_token_id or eos_token_id"):
        D.load_calibration({"kind": "self", "n_samples": 1, "seq_len": 4}, None, NoIds())


# --------------------------------------------------------------------------------------------- tensors

def test_tensor_file_roundtrip_slicing_and_batches(tmp_path):
    lat = torch.randn(6, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.linspace(0, 1, 6)
    save_file({"latents": lat, "timesteps": t}, str(tmp_path / "in.safetensors"))
    cd = D.load_calibration({"kind": "tensors", "path": str(tmp_path / "in.safetensors"), "n_samples": 4})
    assert not cd.is_text and cd.input_ids is None and set(cd.tensors) == {"latents", "timesteps"}
    assert torch.equal(cd.tensors["latents"], lat[:4]) and torch.equal(cd.tensors["timesteps"], t[:4])
    b = list(cd.batches(3))
    assert b[0]["latents"].shape == (3, 4, 8, 8) and b[1]["timesteps"].shape == (1,)
    again = D.load_calibration({"kind": "diffusion", "path": str(tmp_path / "in.safetensors"), "n_samples": 4})
    assert again.fingerprint == cd.fingerprint                              # "diffusion" = tensors
    assert cd.fingerprint != D.load_calibration(
        {"kind": "tensors", "path": str(tmp_path / "in.safetensors"), "n_samples": 5}).fingerprint


@pytest.mark.parametrize("tensors, n, pattern", [
    ({"a": torch.zeros(4, 2), "b": torch.zeros(3, 2)}, 2,
     r"^data\.path: .*disagree on the sample count: 'a' has 4, 'b' has 3"),
    ({"a": torch.tensor([1.0, float("nan")])}, 1, r"^data\.path: .*tensor 'a' holds NaN or Inf"),
    ({"a": torch.tensor(3.0)}, 1, r"^data\.path: .*tensor 'a' is a scalar"),
    ({"a": torch.zeros(2, 3)}, 5, r"^data\.n_samples: .*holds 2 samples but data\.n_samples asks for 5"),
    ({"a": torch.zeros(0, 3)}, 1, r"^data\.path: .*holds 0 samples"),
])
def test_tensor_file_validation(tmp_path, tensors, n, pattern):
    save_file(tensors, str(tmp_path / "t.safetensors"))
    with pytest.raises(ConfigError, match=pattern):
        D.load_calibration({"kind": "tensors", "path": str(tmp_path / "t.safetensors"), "n_samples": n})


def test_tensor_file_that_is_not_safetensors(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x80\x04 this is a pickle, not safetensors")
    with pytest.raises(ConfigError, match=r"^data\.path: cannot read safetensors file .*bad\.safetensors"):
        D.load_calibration({"kind": "tensors", "path": str(tmp_path / "bad.safetensors"), "n_samples": 1})


# --------------------------------------------------------------------------------------------- errors

def test_error_messages_are_one_line_and_name_the_field(tmp_path, tok):
    docs = make_docs(n_docs=3, words_per_doc=10)
    p = write(tmp_path / "small.txt", "\n\n".join(docs))
    n_tok = len(tok.encode("\n\n".join(docs)).ids)
    cases = [
        (cfg(path=p, n_samples=4, seq_len=16),
         rf"^data: text:.*small\.txt has {n_tok} tokens but data\.n_samples × data\.seq_len = 4 × 16 needs 64; "),
        (cfg(path=str(tmp_path / "nope.txt")), r"^data\.path: no such file or folder: .*nope\.txt$"),
        (cfg(path=None), r"^data\.path: is required for data\.kind='text'$"),
        (cfg(kind="jsnol", path=p), r"^data\.kind: unknown kind 'jsnol' \(did you mean 'jsonl'\?\)"),
        (cfg(path=p, n_samples=0), r"^data\.n_samples: must be a positive integer, got 0$"),
        (cfg(path=p, seq_len=True), r"^data\.seq_len: must be a positive integer, got True$"),
        (cfg(path=p, seq_len="512"), r"^data\.seq_len: must be a positive integer, got '512'$"),
        (cfg(path=p, seq_len=1), r"^data\.seq_len: must be at least 2 tokens"),
        (cfg(path=p, seed=1.5), r"^data\.seed: must be an integer"),
        (cfg(path=p, sampling="shuffled"), r"^data\.sampling: unknown sampling 'shuffled'"),
        (cfg(path=p, top_k=-1), r"^data\.top_k: must be an integer >= 0"),
        (cfg(path=p, field=""), r"^data\.field: must be a non-empty string"),
        (cfg(path=write(tmp_path / "empty.txt", "")), r"^data\.path: text:.*empty\.txt contains no text$"),
        (cfg(path=write(tmp_path / "blank.txt", " \n\n\t\n")), r"^data\.path: text:.*blank\.txt contains no text$"),
    ]
    (tmp_path / "no_txt").mkdir()
    (tmp_path / "no_txt" / "a.md").write_text("text, but not a .txt file")
    cases.append((cfg(path=str(tmp_path / "no_txt")), r"^data\.path: folder .*no_txt holds no \*\.txt files$"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    cases.append((cfg(path=str(tmp_path / "latin1.txt")), r"^data\.path: .*latin1\.txt is not UTF-8 text \(byte 3"))
    for c, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as e:
            D.load_calibration(c, tok)
        assert "\n" not in str(e.value)


def test_jsonl_errors_name_the_line(tmp_path, tok):
    rows = [{"text": "a b"}, {"text": "c d"}, {"content": "x"}]
    p = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(ConfigError, match=r"^data\.field: .*a\.jsonl line 3: no field 'text' \(keys: 'content'\)$"):
        D.load_calibration(cfg(kind="jsonl", path=p), tok)
    p = write(tmp_path / "b.jsonl", '{"text": "ok"}\n\n{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(ConfigError, match=r"^data\.path: .*b\.jsonl line 4: invalid JSON"):
        D.load_calibration(cfg(kind="jsonl", path=p), tok)
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"text": None}])
    with pytest.raises(ConfigError,
                       match=r"^data\.field: .*c\.jsonl line 2: field 'text' is NoneType, expected a string$"):
        D.load_calibration(cfg(kind="jsonl", path=p), tok)
    p = write(tmp_path / "d.jsonl", '["a list"]\n')
    with pytest.raises(ConfigError, match=r"^data\.path: .*d\.jsonl line 1: expected a JSON object, got list$"):
        D.load_calibration(cfg(kind="jsonl", path=p), tok)
    p = write(tmp_path / "e.jsonl", "\n\n")
    with pytest.raises(ConfigError, match=r"^data\.path: .*e\.jsonl contains no JSON lines$"):
        D.load_calibration(cfg(kind="jsonl", path=p), tok)
    p = write_jsonl(tmp_path / "f.jsonl", [{"text": "  "}, {"text": ""}])
    with pytest.raises(ConfigError, match=r"^data\.path: jsonl:.*f\.jsonl\[text\] contains no text$"):
        D.load_calibration(cfg(kind="jsonl", path=p), tok)


def test_parquet_errors(tmp_path, tok):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed")
    import pyarrow.parquet as pq
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(ConfigError, match=r"^data\.path: cannot read parquet file .*junk\.parquet: "):
        D.load_calibration(cfg(kind="parquet", path=str(tmp_path / "junk.parquet")), tok)
    pq.write_table(pa.table({"body": ["a b c"], "n": [1]}), tmp_path / "p.parquet")
    with pytest.raises(ConfigError, match=r"^data\.field: .*p\.parquet: no column 'text' \(columns: body, n\)$"):
        D.load_calibration(cfg(kind="parquet", path=str(tmp_path / "p.parquet")), tok)
    with pytest.raises(ConfigError, match=r"^data\.field: .*p\.parquet row 0: field 'n' is int, expected a string$"):
        D.load_calibration(cfg(kind="parquet", path=str(tmp_path / "p.parquet"), field="n"), tok)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    p = write(tmp_path / "c.txt", "a b c")
    with pytest.raises(SdquantError, match=r"data\.kind='text' is text and needs a tokenizer"):
        D.load_calibration(cfg(path=p), None)


def test_optional_dependency_missing_is_a_clear_error(tmp_path, tok, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_datasets(name, *a, **k):
        if name in ("datasets", "pyarrow.parquet"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    (tmp_path / "ds").mkdir()
    with pytest.raises(SdquantError, match=r"needs the datasets package: pip install 'sdquant\[data\]'"):
        D.load_calibration(cfg(kind="hf_disk", path=str(tmp_path / "ds")), tok)
    write(tmp_path / "x.parquet", "x")
    with pytest.raises(SdquantError, match=r"needs pyarrow: pip install 'sdquant\[data\]'"):
        D.load_calibration(cfg(kind="parquet", path=str(tmp_path / "x.parquet")), tok)


# --------------------------------------------------------------------------------------------- real model

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_builtin_text_gives_the_quickstart_enough_smollm2_tokens(smollm2_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir), gguf_file=SMOL_GGUF)
    cd = D.load_calibration({"kind": "builtin", "n_samples": 32, "seq_len": 256}, tok)
    assert cd.n_tokens_available >= 9000 and cd.input_ids.shape == (32, 256)
    assert int(cd.input_ids.max()) < len(tok)
