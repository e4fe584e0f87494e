"""Length-aware decode attention: the Triton kernels (through Triton's interpreter on CPU tensors) against the
PyTorch reference, the reference against plain masked attention over the whole cache, and the runtime's
"triton" decode attention against its "matmul" one."""
import math

import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.kernels import decode_attention as da

if not da.available():
    pytest.skip("triton not installed", allow_module_level=True)


def _case(b=2, nkv=2, rep=4, T=200, hd=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nkv, rep, hd, generator=g).to(dtype)
    k = torch.randn(b, nkv, T, hd, generator=g).to(dtype)
    v = torch.randn(b, nkv, T, hd, generator=g).to(dtype)
    return q, k, v


def _masked_full(q, k, v, pos, window, scale):
    """What the runtime's "matmul" path computes: every slot, masked."""
    T = k.shape[2]
    t = torch.arange(T)
    mask = t <= pos
    if window:
        mask &= t > pos - window
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ v.double())


# sm_90 builds of the kernels without a GPU (Triton compiles and runs ptxas here; cuobjdump ships with Triton)
PARTIAL_ARGS = ["*bf16"] * 3 + ["*i64", "*bf16", "*bf16", "*fp32", "*fp32", "fp32"] + ["i32"] * 12
MERGE_ARGS = ["*fp32", "*fp32", "*bf16", "*i64"] + ["i32"] * 5


def _sm90(fn, types, consts, pdl=True):
    """``fn`` (a kernel from ``da._kernels()``, built with TRITON_INTERPRET unset) compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = dict(zip(fn.arg_names, types + ["constexpr"] * len(consts)))
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": bool(pdl)})


def _sass(compiled):
    """The build's SASS instruction lines, or None where cuobjdump is not at hand."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path
    from sdquant.kernels.int4_cuda import cuobjdump_path
    dump = cuobjdump_path()
    if dump is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cubin").write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([dump, "-sass", str(Path(d) / "k.cubin")], capture_output=True, text=True).stdout
    return [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]


@pytest.mark.parametrize("pos,window", [(0, 0), (7, 0), (127, 0), (128, 0), (199, 0), (150, 40), (30, 40)])
def test_reference_is_masked_attention(pos, window):
    q, k, v = _case()
    scale = 1 / math.sqrt(q.shape[-1])
    y = da.reference(q, k, v, torch.tensor([pos]), window, scale)
    assert torch.allclose(y.double(), _masked_full(q, k, v, pos, window, scale), atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("pos,window", [(0, 0), (63, 0), (64, 0), (129, 0), (199, 0), (180, 50), (20, 50)])
def test_kernel_matches_reference(interpret, dtype, tol, pos, window):
    q, k, v = _case(dtype=dtype, seed=pos + window)
    scale = 1 / math.sqrt(q.shape[-1])
    y = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, scale)
    ref = _masked_full(q, k, v, pos, window, scale)
    assert y.dtype == dtype and y.shape == q.shape
    err = (y.double() - ref).norm() / ref.norm()
    assert err < tol, float(err)


@pytest.mark.parametrize("pos,window", [(0, 0), (63, 0), (64, 0), (129, 0), (199, 0), (180, 50), (20, 50)])
def test_preload_gives_the_same_result(interpret, monkeypatch, pos, window):
    """preload=True in the tile form (the first tile's older slots loaded ahead of the PDL wait, slot pos after it):
    the outputs of the kernel without the preload, bit for bit, and slots past pos or before the window still unread
    (NaN there changes nothing)."""
    monkeypatch.setenv("SDQUANT_ATTN_NEWROW", "tile")  # the row form (the default) sums in another order
    q, k, v = _case(dtype=torch.bfloat16, seed=pos + window)
    scale = 1 / math.sqrt(q.shape[-1])
    got = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, scale, preload=True)
    want = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, scale)
    assert torch.equal(got, want)
    k2, v2 = k.clone(), v.clone()
    for t in (k2, v2):
        t[:, :, pos + 1:] = float("nan")
        if window:
            t[:, :, :max(pos - window + 1, 0)] = float("nan")
    assert torch.equal(torch.ops.sdquant.decode_attention(q, k2, v2, torch.tensor([pos]), window, scale, preload=True),
                       want)


@pytest.mark.parametrize("pos,window", [(0, 0), (64, 0), (199, 0), (180, 50)])
def test_preload_dead_programs_write_nothing(interpret, monkeypatch, pos, window):
    """With the preload, programs without live slots leave before their wait and write no partial; the merge reads
    only the live splits. Scratch filled with NaN (what an uninitialized buffer may hold) changes nothing."""
    monkeypatch.setenv("SDQUANT_ATTN_NEWROW", "tile")  # bit for bit against the kernel without the preload
    q, k, v = _case(dtype=torch.bfloat16, seed=pos + window)
    want = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, 0.2)
    monkeypatch.setattr(da, "_workspace", lambda shape, device: torch.full(shape, float("nan"), device=device))
    assert torch.equal(torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, 0.2, preload=True),
                       want)


@pytest.mark.parametrize("pos,window", [(0, 0), (63, 0), (64, 0), (129, 0), (199, 0), (180, 50), (20, 50)])
def test_preload_new_row(interpret, monkeypatch, pos, window):
    """The preload's default row form (slot pos scored as one row beside the preloaded tile): the reference's result,
    the tile form's (SDQUANT_ATTN_NEWROW=tile) within the rounding of a sum in another order, NaN in dead slots and
    scratch changing nothing; a wrong value is an error naming the variable."""
    q, k, v = _case(dtype=torch.bfloat16, seed=pos + window)
    scale = 1 / math.sqrt(q.shape[-1])
    monkeypatch.setenv("SDQUANT_ATTN_NEWROW", "tile")
    tile = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, scale, preload=True)
    monkeypatch.delenv("SDQUANT_ATTN_NEWROW")
    monkeypatch.setattr(da, "_workspace", lambda shape, device: torch.full(shape, float("nan"), device=device))
    for t in (k, v):
        t[:, :, pos + 1:] = float("nan")
        if window:
            t[:, :, :max(pos - window + 1, 0)] = float("nan")
    row = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, scale, preload=True)
    ref = _masked_full(q, torch.nan_to_num(k), torch.nan_to_num(v), pos, window, scale)
    assert float((row.double() - ref).norm() / ref.norm()) < 1e-2
    assert float((row.double() - tile.double()).abs().max()) <= 2 ** -7 * float(tile.double().abs().max())
    monkeypatch.setenv("SDQUANT_ATTN_NEWROW", "rows")
    with pytest.raises(ValueError, match="SDQUANT_ATTN_NEWROW"):
        torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, scale, preload=True)


def test_chunk_rule(monkeypatch):
    """Slots per program: 64-slot tiles while the grid stays within 8 programs a SM, longer ranges beyond."""
    monkeypatch.delenv("SDQUANT_ATTN_CHUNK", raising=False)
    assert da.chunk_for(1 * 8, 2176, 132) == 64          # batch 1, Llama-3-8B heads: 272 programs
    assert da.chunk_for(8 * 8, 2176, 132) == 256         # batch 8: 576 programs of 4 tiles
    assert da.chunk_for(32 * 8, 2176, 132) == 1024
    assert da.chunk_for(10 ** 6, 2176, 132) == da.CHUNKS[-1]
    assert all(c % da.BLOCK_T == 0 for c in da.CHUNKS)


@pytest.mark.parametrize("chunk", ["128", "256"])
@pytest.mark.parametrize("pos,window", [(0, 0), (129, 0), (299, 0), (250, 70)])
def test_kernel_multi_tile_programs(interpret, monkeypatch, chunk, pos, window):
    """Programs that walk several BLOCK_T tiles (the chunk a large batch gets) against the reference."""
    monkeypatch.setenv("SDQUANT_ATTN_CHUNK", chunk)
    q, k, v = _case(T=300, seed=pos)
    scale = 1 / math.sqrt(q.shape[-1])
    y = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), window, scale)
    ref = _masked_full(q, k, v, pos, window, scale)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-5


def test_tile_config(monkeypatch):
    for key in ("SDQUANT_ATTN_BT", "SDQUANT_ATTN_WARPS", "SDQUANT_ATTN_STAGES"):
        monkeypatch.delenv(key, raising=False)
    assert da.tile_config(1024) == {"BT": da.BLOCK_T, "num_warps": 4}
    monkeypatch.setenv("SDQUANT_ATTN_BT", "128")
    assert da.tile_config(64)["BT"] == 64 and da.tile_config(512)["BT"] == 128     # capped at the chunk
    monkeypatch.setenv("SDQUANT_ATTN_BT", "96")
    with pytest.raises(ValueError, match="SDQUANT_ATTN_BT"):
        da.tile_config(512)


def test_chunk_override_is_checked(interpret, monkeypatch):
    monkeypatch.setenv("SDQUANT_ATTN_CHUNK", "100")
    q, k, v = _case(T=64)
    with pytest.raises(ValueError, match="SDQUANT_ATTN_CHUNK"):
        torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([3]), 0, 0.1)


def test_kernel_reads_only_live_slots(interpret):
    """Slots past the position (and before the window) may hold anything: NaN there changes nothing."""
    q, k, v = _case(T=300)
    pos, window = 170, 100
    k2, v2 = k.clone(), v.clone()
    for t in (k2, v2):
        t[:, :, pos + 1:] = float("nan")
        t[:, :, :pos - window + 1] = float("nan")
    scale = 0.2
    y = torch.ops.sdquant.decode_attention(q, k2, v2, torch.tensor([pos]), window, scale)
    assert torch.isfinite(y).all()
    assert torch.allclose(y.double(), _masked_full(q, k, v, pos, window, scale), atol=1e-5)


def test_rep_above_16_and_single_kv_head(interpret):
    q, k, v = _case(b=1, nkv=1, rep=20, T=70, hd=16)
    y = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([69]), 0, 0.25)
    assert torch.allclose(y.double(), _masked_full(q, k, v, 69, 0, 0.25), atol=1e-5)


def test_bad_shapes_are_rejected():
    q, k, v = _case()
    with pytest.raises(ShapeError, match="head_dim"):
        da.decode_attention(q[..., :24], k[..., :24], v[..., :24], torch.tensor([3]), 0, 1.0)
    with pytest.raises(ShapeError, match="input_pos"):
        da.decode_attention(q, k, v, torch.tensor([3, 4]), 0, 1.0)
    with pytest.raises(ShapeError, match="does not match"):
        da.decode_attention(q, k[:1], v[:1], torch.tensor([3]), 0, 1.0)
    with pytest.raises(ShapeError, match="cos and sin"):
        da.decode_attention(q, k, v, torch.tensor([3]), 0, 1.0, torch.ones(32), None)
    with pytest.raises(ShapeError, match="cos and sin"):
        da.decode_attention(q, k, v, torch.tensor([3]), 0, 1.0, torch.ones(2, 32), torch.ones(2, 32))


def test_opcheck():
    q, k, v = _case(T=40)
    torch.library.opcheck(torch.ops.sdquant.decode_attention.default, (q, k, v, torch.tensor([17]), 0, 0.3))
    cos, sin = torch.randn(32), torch.randn(32)
    torch.library.opcheck(torch.ops.sdquant.decode_attention.default,
                          (q, k, v, torch.tensor([17]), 0, 0.3, cos, sin))
    torch.library.opcheck(torch.ops.sdquant.decode_attention.default,
                          (q, k, v, torch.tensor([17]), 0, 0.3, None, None, True))


def _rope_rows(hd, pos, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    ang = pos * torch.cat([inv, inv])
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernel_rotates_q_on_load_from_a_strided_view(interpret, dtype, tol):
    """q as the runtime passes it: an unrotated view into the fused qkv output (batch stride larger than
    nkv * head stride), with this position's RoPE rows; equals attention of the rotated q."""
    b, nkv, rep, T, hd, pos = 2, 2, 4, 100, 32, 61
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(b, 1, (nkv * rep + 2 * nkv) * hd, generator=g).to(dtype)
    q = qkv[..., :nkv * rep * hd].view(b, nkv, rep, hd)
    assert q.stride(0) != nkv * q.stride(1)
    _, k, v = _case(b=b, nkv=nkv, rep=rep, T=T, hd=hd, dtype=dtype, seed=6)
    cos, sin = _rope_rows(hd, pos, dtype)
    y = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos]), 0, 0.2, cos[None], sin[None])
    q_rot = da.rope_q(q, cos, sin)
    from sdquant.runtime.model import apply_rope   # rope_q is the runtime's rotation ([B, S, heads, hd] there)
    torch.testing.assert_close(q_rot, apply_rope(q.float().reshape(b, 1, nkv * rep, hd), cos.float()[None],
                                                 sin.float()[None]).view(b, nkv, rep, hd), rtol=1e-6, atol=1e-6)
    ref = _masked_full(q_rot, k, v, pos, 0, 0.2)
    assert y.shape == q.shape and y.is_contiguous()
    assert float((y.double() - ref).norm() / ref.norm()) < tol
    ref_op = da.reference(q, k, v, torch.tensor([pos]), 0, 0.2, cos, sin)
    assert float((y.double() - ref_op.double()).norm() / ref_op.double().norm()) < tol


def test_runtime_triton_attention_equals_matmul(interpret):
    from sdquant.runtime.testing import TINY, random_decoder
    rt = random_decoder(TINY, "bf16", device="cpu", dtype=torch.float32, max_seq_len=96)
    torch.manual_seed(0)
    prompt = torch.randint(0, rt.d.vocab_size, (2, 9))
    outs = {}
    for impl in ("matmul", "triton"):
        rt.set_attention(impl)
        rt.setup_caches(2, 96)
        for blk in rt.layers:
            blk.attn.kv_cache.k.zero_()
            blk.attn.kv_cache.v.zero_()
        with torch.no_grad():
            rt(prompt, torch.arange(9))
            ids, steps = prompt[:, -1:], []
            for i in range(9, 14):
                logits = rt.decode_step(ids, torch.tensor([i]))
                steps.append(logits)
                ids = logits.argmax(-1, keepdim=True)
        outs[impl] = torch.stack(steps)
    assert torch.allclose(outs["triton"], outs["matmul"], atol=1e-4, rtol=1e-4)


def test_kernels_keep_their_constexpr_parameters(monkeypatch):
    """The per-mode clones must keep the tl.constexpr marks (a GPU launch fails without them; the interpreter
    does not notice). Jitting for the compiled mode needs no GPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    partial, merge = da._kernels()
    assert len(partial.constexprs) == 9 and len(merge.constexprs) == 8


@pytest.mark.parametrize("pdl", [0, 1, 2, 3])
def test_pdl_builds_for_hopper_without_a_gpu(monkeypatch, pdl):
    """With PDL the kernels wait (griddepcontrol.wait) before their first dependent read and let the next kernel
    launch (launch_dependents); without it neither instruction is there. Compiled for sm_90 here: no GPU needed."""
    import triton.language as tl
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    partial, merge = da._kernels()
    sigs = {partial: (PARTIAL_ARGS, dict(HD=128, REP_P=16, CHUNK_T=64, BT=64, CDT=tl.bfloat16, ROPE=True, PDL=pdl,
                                         PRELOAD=False, LIVE=False)),
            merge: (MERGE_ARGS, dict(HD=128, REP_P=16, SPLITS_P=64, BD=32, PDL=pdl, LIVE=False, CHUNK_T=64,
                                     EARLY=False))}
    for fn, (types, consts) in sigs.items():
        ptx = _sm90(fn, types, consts, pdl=pdl).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == bool(pdl), fn
        assert ("griddepcontrol.launch_dependents" in ptx) == bool(pdl), fn
        if pdl:  # mode 3 (SDQUANT_ATTN_TRIGGER): the first trigger comes before the wait; modes 1-2 after it
            lines = ptx.splitlines()
            first = next(i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln)
            wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
            assert (first < wait) == (pdl == 3), fn


def test_trigger_setting(monkeypatch):
    """The early trigger comes before the wait in both kernels by default (mode 3); SDQUANT_ATTN_TRIGGER moves it back
    after the wait ("wait") or keeps it ahead only in the merge ("merge-first"); without the early-trigger setting
    nothing changes, and a wrong value is an error naming the variable."""
    monkeypatch.delenv("SDQUANT_ATTN_TRIGGER", raising=False)
    assert da._trigger(2) == (3, 3) and da._trigger(1) == (1, 1) and da._trigger(0) == (0, 0)
    assert da._trigger(2, preload=False) == (2, 2)  # only the runtime's fused path (the preload's caller) gets mode 3
    monkeypatch.setenv("SDQUANT_ATTN_TRIGGER", "wait")
    assert da._trigger(2) == (2, 2)
    monkeypatch.setenv("SDQUANT_ATTN_TRIGGER", "merge-first")
    assert da._trigger(2) == (2, 3) and da._trigger(1) == (1, 1)
    monkeypatch.setenv("SDQUANT_ATTN_TRIGGER", "early")
    with pytest.raises(ValueError, match="SDQUANT_ATTN_TRIGGER"):
        da._trigger(2)


def test_preload_loads_ahead_of_the_wait_for_hopper_without_a_gpu(monkeypatch):
    """With PRELOAD the partial kernel's first-tile key / value loads come before griddepcontrol.wait in the PTX (and in
    the SASS, where cuobjdump is at hand: ptxas keeps them there); without it every load of the cache follows the
    wait (only the position's load may precede it: none does)."""
    import triton.language as tl
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    partial, _ = da._kernels()
    for pre in (1, 2, False):  # 2: slot pos as one row (SDQUANT_ATTN_NEWROW=row)
        c = _sm90(partial, PARTIAL_ARGS, dict(HD=128, REP_P=16, CHUNK_T=64, BT=64, CDT=tl.bfloat16, ROPE=False, PDL=2,
                                              PRELOAD=pre, LIVE=bool(pre)))
        lines = c.asm["ptx"].splitlines()
        w = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        before = sum("ld.global" in ln for ln in lines[:w])
        assert (before > 64) if pre else before == 0, before
        ins = _sass(c)
        if ins is not None:
            acq = next(i for i, ln in enumerate(ins) if "ACQBULK" in ln)
            assert sum("LDG" in ln for ln in ins[:acq]) == before
            if pre == 2:  # the row form holds the tile once: no spill (the tile form spills 216 bytes a thread here)
                assert not any(t in ln for ln in ins for t in ("STL", "LDL")), "the row form spills"


def test_merge_early_addresses_for_hopper_without_a_gpu(monkeypatch):
    """The merge kernel with EARLY (the row form's bundle) computes its load addresses before griddepcontrol.wait: fewer
    instructions after the wait in the sm_90 SASS than without it, and the same loads (cuobjdump needed)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, merge = da._kernels()
    after, loads = {}, {}
    for early in (False, True):
        ins = _sass(_sm90(merge, MERGE_ARGS, dict(HD=128, REP_P=16, SPLITS_P=64, BD=32, PDL=3, LIVE=True, CHUNK_T=64,
                                                  EARLY=early)))
        if ins is None:
            pytest.skip("cuobjdump not available")
        acq = next(i for i, ln in enumerate(ins) if "ACQBULK" in ln)
        after[early], loads[early] = len(ins) - acq, sum("LDG" in ln for ln in ins[acq:])
    assert after[True] < 0.9 * after[False] and loads[True] == loads[False], (after, loads)


def test_attention_bench_dry_checks_every_setting(tmp_path):
    """bench/attention.py --dry (Triton's interpreter, tiny shapes): the shipped rule and a forced multi-tile setting
    pass the check against the reference at every position, and the record is written."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "attention.py"), "--dry", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=str(root))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert [row["pos"] for row in rows] == [0, 129, 199]
    assert all(row["rule_err"] < 1e-5 and row["c128/bt64_err"] < 1e-5 for row in rows)
