"""sdquant.compile: quantized models compile with fullgraph=True (the torch.library ops have fake impls, so no
graph break at QuantLinear / Fp8Linear) and give the eager results. CPU, aot_eager backend (inductor on
2 CPU cores takes over a minute; the GPU benchmark bench/e2e.py exercises inductor + CUDA graphs)."""
import pytest
import torch
import transformers as T
from torch._dynamo.utils import counters

import sdquant
from sdquant.errors import ConfigError
from sdquant.runtime.model import Transformer, generate
from sdquant.runtime.testing import quantize_model_rtn


def tiny(**quant):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return quantize_model_rtn(T.LlamaForCausalLM(cfg).eval(), **quant)


def greedy(model, ids, n=6):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_hf_static_cache_fullgraph_int4():
    model = tiny(bits=4, group_size=32)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = greedy(model, ids)
    out = greedy(sdquant.compile(model, backend="aot_eager", fullgraph=True), ids)
    assert torch.equal(out, ref)
    assert model.generation_config.cache_implementation == "static"
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


@pytest.mark.parametrize("quant", [dict(bits=4, group_size=32), dict(fp8=True)], ids=["int4", "fp8"])
def test_runtime_decode_fullgraph(quant):
    model = tiny(**quant)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    rt = Transformer.from_hf(model, max_seq_len=64)
    ref = generate(rt, ids, 5)
    sdquant.compile(rt, backend="aot_eager", fullgraph=True)
    out = generate(rt, ids, 5)
    assert torch.equal(out, ref) and torch.equal(ref, greedy(model, ids, 5))
    # prefill runs eager; the decode step is one graph that every step reuses (no recompiles per position)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_runtime_block_scope_compiles_one_block_for_all_layers():
    model = tiny(bits=4, group_size=32)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    rt = Transformer.from_hf(model, max_seq_len=64)
    ref = generate(rt, ids, 4)
    sdquant.compile(rt, backend="aot_eager", scope="block")
    assert torch.equal(generate(rt, ids, 4), ref)
    # the prefill block and the decode block (shared by all layers), and the decode step's glue before the first block
    # and after the last (_embed_call, _head_call: each compiled once for the 4 steps)
    assert counters["stats"]["unique_graphs"] == 4


def test_bad_arguments():
    model = tiny(bits=4, group_size=32)
    with pytest.raises(ConfigError, match="mode"):
        sdquant.compile(model, mode="turbo")
    with pytest.raises(ConfigError, match="scope"):
        sdquant.compile(Transformer.from_hf(model, max_seq_len=32), scope="layer")


def test_pdl_is_off_where_it_cannot_run_and_refused_when_asked():
    """Programmatic dependent launch needs inductor on a Hopper GPU: on a CPU the default leaves it off (and leaves
    the sdquant kernels' process-wide switches alone); asking for it is a one-line ConfigError naming the field."""
    from sdquant.kernels import decode_attention, int4_cuda
    model = tiny(bits=4, group_size=32)
    rt = Transformer.from_hf(model, max_seq_len=32)
    sdquant.compile(rt, backend="aot_eager", scope="block")
    assert rt.pdl is False and int4_cuda._PDL[0] == 0 and decode_attention._PDL[0] == 0
    with pytest.raises(ConfigError, match="pdl.*not inductor"):
        sdquant.compile(rt, backend="aot_eager", pdl=True)
    with pytest.raises(ConfigError, match="pdl.*cpu, not a CUDA device"):
        rt.compile_decode(mode="default", scope="block", pdl=True)


def test_inductor_options_carry_the_mode_and_pdl():
    """torch.compile takes a mode or options, not both: with PDL the mode becomes its option dict."""
    from sdquant.runtime.model import inductor_options
    assert inductor_options("reduce-overhead", pdl=True) == {"triton.cudagraphs": True, "triton.enable_pdl": True}
    assert inductor_options(None, pdl=False) == {}
    assert inductor_options("max-autotune", pdl=True)["max_autotune"] is True


def test_kernel_pdl_switches_report_and_restore():
    from sdquant.kernels import decode_attention, int4_cuda
    for mod in (int4_cuda, decode_attention):
        assert mod.set_pdl(True, early_trigger=True) == 0
        assert mod.set_pdl(True) == 2
        assert mod.set_pdl(False) == 1 and mod._PDL[0] == 0


def test_cuda_inductor_defaults_are_real_inductor_options():
    """compile_decode's PDL decode defaults go to torch.compile(options=...), which rejects unknown keys on a GPU:
    check them against inductor's config here."""
    import torch._inductor.config as inductor_config
    from sdquant.runtime.model import PDL_DECODE_OPTIONS
    for key in PDL_DECODE_OPTIONS:
        obj = inductor_config
        for part in key.split("."):
            assert hasattr(obj, part), key
            obj = getattr(obj, part)


def test_prompts_and_decode_steps_take_their_own_block_function():
    """compile_decode(scope="block") with PDL compiles prompts (S > 1) apart from decode steps (the decode-only
    inductor options); forward must route by sequence length. The routing is checked with counting wrappers."""
    from sdquant.runtime import model as rtm
    model = tiny(bits=4, group_size=32)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    rt = Transformer.from_hf(model, max_seq_len=32)
    ref = generate(rt, ids, 3)
    calls = {"decode": 0, "prompt": 0}

    def counting(kind, fn):
        def f(*a):
            calls[kind] += 1
            return fn(*a)
        return f
    rt._block_fn = counting("decode", rtm._block_call)
    rt._prefill_block_fn = counting("prompt", rtm._prefill_block_call)
    assert torch.equal(generate(rt, ids, 3), ref)
    n = len(rt.layers)
    assert calls == {"prompt": n, "decode": 2 * n}   # one prompt pass, then 2 single-token steps


def test_block_scope_never_asks_inductor_for_cuda_graphs(monkeypatch):
    """scope="block" + mode="reduce-overhead" failed on the H200 (cudagraph trees overwrote the outputs the next
    layer reads, bench/compile_smoke.py run 20): the block is compiled with triton.cudagraphs off; scope="model"
    keeps the mode."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (seen.append(kw), fn)[1])
    rt = Transformer.from_hf(tiny(bits=4, group_size=32), max_seq_len=32)
    rt.compile_decode(mode="reduce-overhead", scope="block", backend="inductor")
    assert seen[-1]["options"] == {"triton.cudagraphs": False} and "mode" not in seen[-1]
    rt.compile_decode(mode="reduce-overhead", scope="model", backend="inductor")
    assert seen[-1]["mode"] == "reduce-overhead" and "options" not in seen[-1]


def test_from_hf_passes_pdl_to_compile_decode():
    """Transformer.from_hf(compile=..., pdl=...) (and so `python -m sdquant.runtime --compile M --no-pdl`) reaches
    compile_decode: asking for PDL on a CPU is refused there, naming the field."""
    model = tiny(bits=4, group_size=32)
    with pytest.raises(ConfigError, match="pdl"):
        Transformer.from_hf(model, max_seq_len=32, compile="default", pdl=True)
    assert Transformer.from_hf(model, max_seq_len=32, compile="default", pdl=False).pdl is False


@pytest.mark.parametrize("scope", ["block", "model"])
def test_compiled_model_serves_many_prompt_lengths_and_batch_sizes(scope):
    """A compiled INT4 model through 7 prompt lengths, then 10 batch sizes (torch's recompile limit is 8 graphs a
    function): prompts compile with automatic dynamic shapes, generate grows the cache in steps (cache_len_for), and the
    compiled calls raise the limit to RECOMPILE_LIMIT for their duration only. Same tokens as the eager model; before
    these, scope="block" failed at the 5th prompt length and scope="model" at the 9th."""
    from sdquant.runtime import model as rtm
    model = tiny(bits=4, group_size=32)
    eager = Transformer.from_hf(model, max_seq_len=128)
    rt = Transformer.from_hf(model, max_seq_len=128).compile_decode(scope=scope, backend="aot_eager", mode=None)
    g = torch.Generator().manual_seed(9)
    limit = torch._dynamo.config.recompile_limit
    cases = [(1, s) for s in range(2, 9)] + [(b, 3) for b in range(1, 11)]
    for b, s in cases:
        ids = torch.randint(0, 128, (b, s), generator=g)
        assert torch.equal(generate(rt, ids, 2), generate(eager, ids, 2)), (b, s)
    assert torch._dynamo.config.recompile_limit == limit    # restored after every call
    assert rt.max_seq == min(rtm.CACHE_STEP, 128)   # one cache length served every request (capped at the table)


def test_recompile_limit_is_one_line_error(monkeypatch):
    """Past the limit, a compiled model's call fails with one SdquantError line that says what to do."""
    from sdquant.errors import SdquantError
    from sdquant.runtime import model as rtm
    monkeypatch.setattr(rtm, "RECOMPILE_LIMIT", 2)
    rt = Transformer.from_hf(tiny(bits=4, group_size=32), max_seq_len=64)
    rt.compile_decode(scope="model", backend="aot_eager", mode=None)
    with torch._dynamo.config.patch(recompile_limit=2):   # (monkeypatch's undo would delete the config entry)
        with pytest.raises(SdquantError, match="recompile limit .2 a function.*pad requests") as e:
            for b in range(1, 5):
                generate(rt, torch.zeros(b, 3, dtype=torch.long), 2)
        assert torch._dynamo.config.recompile_limit == 2
    assert "\n" not in str(e.value)


def test_cache_len_for():
    from sdquant.runtime.model import CACHE_STEP, cache_len_for
    assert CACHE_STEP == 256
    got = [cache_len_for(t, 1 << 20) for t in (1, 256, 257, 1000, 1500, 4096, 5000, 9000)]
    assert got == [256, 256, 512, 1024, 1536, 4096, 5120, 10240]
    for t in range(1, 20000, 37):   # never short, at most 25% over past 1024, four lengths an octave
        c = cache_len_for(t, 1 << 20)
        assert c >= t and (t <= 1024 or c <= 1.25 * t)
    assert len({cache_len_for(t, 1 << 20) for t in range(4097, 8193)}) == 4
    assert cache_len_for(100, 64) == 100   # past the table: setup_caches names the limit
    assert cache_len_for(600, 700) == 700


class _GraphOnCpu:
    """CUDAGraphStep's contract on the CPU: the warm-up calls, one output buffer that each replay overwrites, and with
    feedback the token and position advanced inside the step. Counts replays."""
    replays = 0

    def __init__(self, fn, batch, device, warmup=2, feedback=False):
        from sdquant.runtime.model import feedback_why_not
        self.fn, self.feedback, self.out = fn, feedback, None
        self.idx = torch.zeros(batch, 1, dtype=torch.long)
        self.pos = torch.zeros(1, dtype=torch.long)
        for _ in range(warmup):
            out = fn(self.idx, self.pos)
        if feedback:
            feedback_why_not(out, self.idx)

    def __call__(self, idx=None, input_pos=None):
        if idx is not None:
            self.idx.copy_(idx)
        if input_pos is not None:
            self.pos.copy_(input_pos)
        out = self.fn(self.idx, self.pos)
        self.out = out.clone() if self.out is None else self.out.copy_(out)
        if self.feedback:
            self.idx.copy_(self.out)
            self.pos.add_(1)
        type(self).replays += 1
        return self.out


def test_generate_replays_the_decode_graph(monkeypatch):
    """A block-compiled model on a CUDA device: generate captures decode_graph before the prompt (its warm-up writes
    cache slot 0, which the prompt then overwrites) and replays it, greedy steps feeding themselves. Emulated on the
    CPU (_GraphOnCpu): same tokens as the eager model, greedy, sampled and with an end token; one capture a shape."""
    from sdquant.runtime import model as rtm
    monkeypatch.setattr(rtm, "CUDAGraphStep", _GraphOnCpu)
    monkeypatch.setattr(rtm, "_graphs_here", lambda m: m.graph_decode)
    model = tiny(bits=4, group_size=32)
    eager = Transformer.from_hf(model, max_seq_len=64)
    rt = Transformer.from_hf(model, max_seq_len=64).compile_decode(scope="block", backend="aot_eager", mode=None)
    assert rt.graph_decode and not eager.graph_decode
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    want = generate(eager, ids, 8)
    for _ in range(2):
        assert torch.equal(generate(rt, ids, 8), want)
    assert _GraphOnCpu.replays == 2 * 7 and len(rt._graph_steps) == 1
    sampled = [generate(m, ids, 6, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(5))
               for m in (eager, rt)]
    assert torch.equal(*sampled)
    assert _GraphOnCpu.replays == 2 * 7 + 5 and len(rt._graph_steps) == 2   # the sampled steps' logits graph
    eos = int(want[0, 8])   # row 0's third new token
    assert torch.equal(generate(rt, ids[:1], 8, eos_token_id=eos), generate(eager, ids[:1], 8, eos_token_id=eos))
    assert list(rt._graph_steps) == [(1, 64, True)]   # batch 1: new caches, the batch-2 captures dropped
    rt.setup_caches(3, 64)
    assert not rt._graph_steps
    generate(rt, ids, 4)
    assert list(rt._graph_steps) == [(2, 64, True)]
    rt.set_kv_write("index_copy")   # a step with other kernels: the captures are dropped, and the next call recaptures
    assert not rt._graph_steps
    assert torch.equal(generate(rt, ids, 8), want) and list(rt._graph_steps) == [(2, 64, True)]
    rt.drop_decode_graphs()
    assert not rt._graph_steps
