"""The sm_90a W4A16 CUDA kernel: the source compiles with nvcc (where nvcc exists), and the op's layout
semantics (its CPU path) match the reference. GPU numbers come from bench/gpu_check.py on the H200."""
import functools
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_cuda
from sdquant.kernels import int4_layout as L
from sdquant.kernels import ops  # noqa: F401

from test_int4_layout import make_qw  # noqa: E402


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_nvcc_compiles_for_sm90a_without_spills():
    with tempfile.TemporaryDirectory() as d:
        r = int4_cuda.nvcc_compile(d)
    assert r.returncode == 0, r.stderr[-4000:]
    kernels = [ln for ln in r.stderr.splitlines() if "Compiling entry function" in ln]
    # variant 0: {fp16,bf16} x 3 token tiles x 2 K steps x hint = 24; variants 1-7 at 1-2 token tiles, no hint:
    # 2 dtypes x 2 tiles x (6 variants x 2 K steps + variant 7 at 4 K steps) = 52; direct variants 8-12: 2 x 2 x 5;
    # stream-K variants 13-27 and 45 and the six stream-K read probes: 2 x 2 x 22; lean variants 28-37 and 42:
    # 2 x 2 x 11 (+ 2 x 2 at four tiles); tight variants 38-41 and 43-44: 2 x 2 x 6, and their fused build (TFused,
    # w4a16_part_fused_*.cu): 2 dtypes x 6 at one token tile;
    # flat lean variants 46-49: 2 x 2 x 4; bulk-copy variants 50-57 and their read probe: 2 x 2 x 9; flat bulk-copy
    # variants 58-59 and their probe: 2 x 2 x 3; the feed kernel (60-61): 2 dtypes x 2 at one token tile;
    # the linear read probe once; the wgmma kernel: 2 dtypes x 3 token tiles x {62: last-CTA fix-up, 63: separate
    # reduction kernel (2 dtypes)}
    assert sum("w4a16_kernel" in ln for ln in kernels) == 84  # + variants 2 and 5 at four tiles (2 x 2 K steps)
    assert sum("w4a16_direct_kernel" in ln for ln in kernels) == 20
    assert sum("w4a16_streamk_kernel" in ln for ln in kernels) == 88
    assert sum("w4a16_lean_kernel" in ln for ln in kernels) == 48  # + 37 and 42 at four token tiles
    assert sum("w4a16_tight_kernel" in ln for ln in kernels) == 24 + 12
    assert sum("TFused" in ln for ln in kernels) == 12
    assert sum("w4a16_lean_flat_kernel" in ln for ln in kernels) == 16
    assert sum("w4a16_bulk_kernel" in ln for ln in kernels) == 36
    assert sum("w4a16_bulk_flat_kernel" in ln for ln in kernels) == 12
    assert sum("w4a16_feed_kernel" in ln for ln in kernels) == 4
    assert sum("linear_read_probe_kernel" in ln for ln in kernels) == 1
    # 4 token tiles x ONE_GROUP x 62/63 x 2 dtypes, + stream-K at the 128-token tile (62 and 63 alike): 2 x 2,
    # + 63's 128-K stages at the 128-token tile: 2 x 2, + two warpgroups at the 32- / 64-token tiles (sdq_wg_two_wg):
    # 2 tiles x ONE_GROUP x 62/63 x 2 dtypes
    assert sum("w4a16_wgmma_kernel" in ln for ln in kernels) == 32 + 4 + 4 + 16
    # the raw-code form at the 16-token tile (62 / 63): 2 dtypes x 2, in one warpgroup or two (wg_two)
    assert sum("w4a16_wgmma_raw_kernel" in ln for ln in kernels) == 4 + 4
    # 63's warp-specialized split-K at the 128-token tile (a producer warpgroup under setmaxnreg): 2 dtypes x the
    # splits summed by a second kernel or inside a cluster
    assert sum("w4a16_wgmma_tma_kernel" in ln for ln in kernels) == 4
    # its stream-K form (int4_cuda.set_wgmma_schedule("wssk")): 2 dtypes
    assert sum("w4a16_wgmma_tma_sk_kernel" in ln for ln in kernels) == 2
    assert sum("wg_reduce_kernel" in ln for ln in kernels) == 2
    # ptxas did not serialize the wgmmas (C7513-C7515: a non-wgmma instruction writing a wgmma's registers while
    # wgmmas are in flight, or too few registers for the pipeline)
    assert not [ln for ln in r.stderr.splitlines() if "wgmma.mma_async instructions are serialized" in ln]
    assert all("for 'sm_90a'" in ln for ln in kernels)
    spills = [ln for ln in r.stderr.splitlines() if "spill" in ln]
    assert spills and all("0 bytes spill stores, 0 bytes spill loads" in ln for ln in spills)


EXPERIMENT_DEFINES = ("-DSDQ_TIGHT_L2PF=0", "-DSDQ_TIGHT_L2PF=0 -DSDQ_TIGHT_SZO=0", "")
# "": the shipped build, whose SASS test_tight_prologue_loads_weights_before_the_wait reads; the second entry is the
# tight kernel as Pending 24 measured it (no L2 prefetch, the group end before Pending 48)
# bench/ws_trace.py's build; Pending 44's raw 16-token kernel at 3 CTAs a SM; the wgmma path without its early
# triggers, the form before 2026-12-08 (Pending 52; docs/benchmarks/pending.md)
WGMMA_EXPERIMENT_DEFINES = ("-DSDQ_WS_TRACE=1", "-DSDQ_WG_RAW_OCC=3", "-DSDQ_WG_EARLY_TRIGGER_MAX_M=0")


def _experiment_builds(part: str = "bf16_nt1.cu", defines: tuple = EXPERIMENT_DEFINES) -> dict:
    """define -> CompletedProcess of a unit (by default the bf16 one-token-tile one) compiled with it: every experiment
    build of that unit at once, as many in parallel as there are cores (each takes ~35-50 s of one core; the tests
    below read their own). Built once a process per unit and define set, however the arguments are spelled."""
    return _unit_builds(part, tuple(defines))


@functools.lru_cache(maxsize=None)
def _unit_builds(part: str, defines: tuple) -> dict:
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    src = next(p for p in int4_cuda.PART_SRCS if p.name.endswith(part))

    def one(define: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([int4_cuda.nvcc_path(), "-c", *int4_cuda.NVCC_FLAGS, *int4_cuda.TORCH_NVCC_DEFINES,
                                *define.split(), "-Xptxas", "-v", str(src), "-o", f"{d}/part.o"],
                               capture_output=True, text=True, timeout=900)
            dump = int4_cuda.cuobjdump_path()
            r.sass = (subprocess.run([dump, "-sass", f"{d}/part.o"], capture_output=True, text=True).stdout
                      if r.returncode == 0 and dump else None)
            return r
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(defines, pool.map(one, defines)))


def _experiment_compiles_without_spills(define: str, kernel: str, count: int, part: str = "bf16_nt1.cu",
                                        defines: tuple = EXPERIMENT_DEFINES) -> None:
    """A unit (by default the bf16 one-token-tile one) compiled with an experiment's define: `count` instantiations of
    `kernel`, no spills."""
    r = _experiment_builds(part, defines)[define]
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stderr.splitlines()
    found = [i for i, ln in enumerate(lines) if "Compiling entry function" in ln and kernel in ln]
    assert len(found) == count
    for i in found:
        spill = next(ln for ln in lines[i:i + 6] if "spill" in ln)
        assert "0 bytes spill stores, 0 bytes spill loads" in spill


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_tight_without_l2_prefetch_build_compiles():
    """The tight kernel's earlier prologue (no L2 prefetch of the ring before griddep_wait), kept for A/B timing
    (docs/benchmarks/pending.md, Pending 24), still compiles for sm_90a without spills in all six tight variants, so that a
    build with SDQUANT_NVCC_FLAGS=-DSDQ_TIGHT_L2PF=0 can time it against the shipped one."""
    _experiment_compiles_without_spills("-DSDQ_TIGHT_L2PF=0", "w4a16_tight_kernel", 6)


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("define", WGMMA_EXPERIMENT_DEFINES)
def test_wgmma_experiment_builds_compile(define):
    """The bf16 wgmma unit's experiment builds (bench/ws_trace.py's traced build, -DSDQ_WS_TRACE=1) compile for sm_90a
    with both warp-specialized 128-token kernels (the plain and the cluster-sum form) and no spills, so a device call
    never finds them broken."""
    _experiment_compiles_without_spills(define, "w4a16_wgmma_tma_kernel", 2, "wgmma_bf16.cu", WGMMA_EXPERIMENT_DEFINES)


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_raw_three_ctas_build_compiles():
    """Pending 44's A/B build (-DSDQ_WG_RAW_OCC=3: the raw 16-token kernel at 3 stages, launch bounds of 3 CTAs a
    SM) fits both raw kernels in 168 registers without spills, which is what lets 3 CTAs share a SM (and their
    two-warpgroup forms, Pending 46, as well)."""
    _experiment_compiles_without_spills("-DSDQ_WG_RAW_OCC=3", "w4a16_wgmma_raw_kernel", 4, "wgmma_bf16.cu",
                                        WGMMA_EXPERIMENT_DEFINES)
    r = _experiment_builds("wgmma_bf16.cu", WGMMA_EXPERIMENT_DEFINES)["-DSDQ_WG_RAW_OCC=3"]
    lines = r.stderr.splitlines()
    for i in [i for i, ln in enumerate(lines) if "Compiling entry function" in ln and "w4a16_wgmma_raw_kernel" in ln]:
        used = next(ln for ln in lines[i:i + 6] if "Used" in ln and "registers" in ln)
        assert int(used.split("Used")[1].split("registers")[0]) <= 168


def _sass_loops():
    """bench/sass_loops (the SASS parser and loop finder)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import sass_loops
    return sass_loops


def _sass_kernels(sass: str) -> dict:
    """{kernel: [(address, instruction text)]} of a cuobjdump -sass text (sass_loops.parse_sass)."""
    return _sass_loops().parse_sass(sass)


def _trigger_before_first_wgmma(sass: str) -> dict:
    """kernel name -> whether its first griddepcontrol.launch_dependents (PREEXIT) comes before its first wgmma
    (HGMMA), for every kernel with a wgmma in a cuobjdump -sass text."""
    out = {}
    for name, insns in _sass_kernels(sass).items():
        ops = [i for _, i in insns]
        hg = next((j for j, i in enumerate(ops) if "HGMMA" in i), None)
        if hg is not None:
            out[name] = next(j for j, i in enumerate(ops) if "PREEXIT" in i) < hg
    return out


@pytest.mark.skipif(int4_cuda.nvcc_path() is None or int4_cuda.cuobjdump_path() is None,
                    reason="nvcc or cuobjdump not installed")
def test_wgmma_early_trigger_comes_before_the_main_loop():
    """The shipped build (as ws_trace's, whose define touches only the warp-specialized kernels) lets its dependents
    launch before its first wgmma in every kernel of wgmma_body (the plain and the raw forms, 32 in the bf16 unit), and
    variant 63's split-K sum has a trigger; the warp-specialized kernels still trigger only after their wgmmas. The
    build of before (-DSDQ_WG_EARLY_TRIGGER_MAX_M=0, kept for A/B) compiles without spills or serialized wgmmas and has
    neither early trigger. (Which M takes the triggers is a runtime test on p.m; Pending 52.)"""
    _experiment_compiles_without_spills("-DSDQ_WG_EARLY_TRIGGER_MAX_M=0", "w4a16_wgmma_tma_kernel", 2,
                                        "wgmma_bf16.cu", WGMMA_EXPERIMENT_DEFINES)
    builds = _experiment_builds("wgmma_bf16.cu", WGMMA_EXPERIMENT_DEFINES)
    before = builds["-DSDQ_WG_EARLY_TRIGGER_MAX_M=0"]
    assert not [ln for ln in before.stderr.splitlines() if "wgmma.mma_async instructions are serialized" in ln]

    def reduce_triggers(sass: str) -> list:
        return [sum("PREEXIT" in i for _, i in insns) for name, insns in _sass_kernels(sass).items()
                if "wg_reduce_kernel" in name]
    for sass, early in ((builds["-DSDQ_WS_TRACE=1"].sass, True), (before.sass, False)):
        order = _trigger_before_first_wgmma(sass)
        body = {k: v for k, v in order.items() if "w4a16_wgmma_kernel" in k or "w4a16_wgmma_raw_kernel" in k}
        rest = {k: v for k, v in order.items() if k not in body}
        assert len(body) == 32 and all(v == early for v in body.values())
        assert rest and not any(rest.values())
        assert reduce_triggers(sass) == [1 if early else 0]


def _tight_funcs_wait_vs_load(sass: str) -> list:
    """(kernel, index of the first LDG.E.NA.128, index of ACQBULK) for every tight variant in a cuobjdump -sass text."""
    out = []
    for f in sass.split("Function : ")[1:]:
        if f.startswith("_") and "w4a16_tight_kernel" in f.split()[0]:
            lines = f.splitlines()
            out.append((f.split()[0], next(i for i, ln in enumerate(lines) if "LDG.E.NA.128" in ln),
                        next(i for i, ln in enumerate(lines) if "ACQBULK" in ln)))
    return out


@pytest.mark.skipif(int4_cuda.nvcc_path() is None or int4_cuda.cuobjdump_path() is None,
                    reason="nvcc or cuobjdump not installed")
def test_tight_prologue_loads_weights_before_the_wait():
    """In the shipped build's SASS, every tight variant's ring weight loads (LDG.E.NA.128) come before
    griddepcontrol.wait (ACQBULK), so under PDL the weights stream while the previous kernel finishes. Without the L2
    prefetch (SDQ_TIGHT_L2PF=0) and with the group end before Pending 48 (SDQ_TIGHT_SZO=0), the build Pending 24
    measured, ptxas puts the wait first in variants 38 / 39, which is what the prefetch is for; the second half checks
    that this test tells the two builds apart. (With the shipped group end, ptxas keeps the plain kernels' loads first
    even without the prefetch, but the fused decode chain under PDL was 4.2 us a layer slower without it: Pending 50.)"""
    r = _experiment_builds()[""]
    assert r.returncode == 0 and r.sass, r.stderr[-2000:]
    shipped = _tight_funcs_wait_vs_load(r.sass)
    assert len(shipped) == 6
    assert all(load < wait for _, load, wait in shipped), shipped
    r0 = _experiment_builds()["-DSDQ_TIGHT_L2PF=0 -DSDQ_TIGHT_SZO=0"]
    assert r0.returncode == 0 and r0.sass, r0.stderr[-2000:]
    earlier = _tight_funcs_wait_vs_load(r0.sass)
    assert len(earlier) == 6 and sum(wait < load for _, load, wait in earlier) >= 2, earlier


def _tight_main_loops(sass: str) -> dict:
    """kernel -> (main loop length, HMMAs in it, S2R in it) for every tight variant in a cuobjdump -sass text."""
    sass_loops = _sass_loops()
    out = {}
    for name, insns in sass_loops.parse_sass(sass).items():
        if "w4a16_tight_kernel" in name:
            lo = max((lp for lp in sass_loops.loops(insns) if lp["HMMA"]), key=lambda lp: lp["HMMA"])
            body = [i for a, i in insns if lo["start"] <= a <= lo["end"]]
            out[name] = (lo["length"], lo["HMMA"], sum(sass_loops.opcode(i) == "S2R" for i in body))
    return out


@pytest.mark.skipif(int4_cuda.nvcc_path() is None or int4_cuda.cuobjdump_path() is None,
                    reason="nvcc / cuobjdump not installed")
def test_tight_group_offset_shortens_the_loop():
    """The shipped tight kernels keep the next group's scale / zero offset in a register (SDQ_TIGHT_SZO, Pending 48):
    each main loop is shorter than the build before it (-DSDQ_TIGHT_SZO=0, here with Pending 24's prologue, which
    must still compile without spills) with the same tensor-core work, and holds no S2R, where the build before read
    the thread index."""
    _experiment_compiles_without_spills("-DSDQ_TIGHT_L2PF=0 -DSDQ_TIGHT_SZO=0", "w4a16_tight_kernel", 6)
    shipped = _tight_main_loops(_experiment_builds()[""].sass)
    before = _tight_main_loops(_experiment_builds()["-DSDQ_TIGHT_L2PF=0 -DSDQ_TIGHT_SZO=0"].sass)
    assert len(shipped) == 6 and shipped.keys() == before.keys()
    assert all(s2r for _, _, s2r in before.values()), before
    for name, (length, hmma, s2r) in shipped.items():
        assert hmma == before[name][1] and length < before[name][0] and s2r == 0, (name, before[name], shipped[name])


def test_build_options_extra_flags(monkeypatch, tmp_path):
    """SDQUANT_NVCC_FLAGS appends nvcc flags and moves the build to a module name and directory of its own (a hash of
    the flags), so a measurement build never reuses or overwrites the default one."""
    monkeypatch.setenv("SDQUANT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SDQUANT_NVCC_FLAGS", raising=False)
    name, flags, d = int4_cuda.build_options()
    assert name == "sdquant_w4a16_sm90" and flags == list(int4_cuda.NVCC_FLAGS) and d.is_dir()
    monkeypatch.setenv("SDQUANT_NVCC_FLAGS", "-DSDQ_TIGHT_L2PF=1")
    name1, flags1, d1 = int4_cuda.build_options()
    assert flags1 == [*int4_cuda.NVCC_FLAGS, "-DSDQ_TIGHT_L2PF=1"]
    assert name1 != name and name1.isidentifier() and d1.parent == d and d1.is_dir()
    monkeypatch.setenv("SDQUANT_NVCC_FLAGS", "-DSDQ_TIGHT_L2PF=0")
    name2, _, d2 = int4_cuda.build_options()
    assert name2 not in (name, name1) and d2 not in (d, d1)


@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_path_matches_reference(m, dtype):
    qw = make_qw(128, 512, 64, False, True, seed=m)
    lay = L.repack_cuda(qw, dtype)
    x = torch.randn(m, 512).to(dtype)
    bias = torch.randn(128).to(dtype)
    y = torch.ops.sdquant.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"], lay["perm"], lay["locks"], bias)
    ref = torch.ops.sdquant.int_linear(x.double(), qw.qweight, qw.scales, qw.zeros, qw.g_idx, bias.double(), 4, 64,
                                       512).float()
    assert float((y.float() - ref).norm() / ref.norm()) < (2e-3 if dtype == torch.float16 else 1e-2)


def test_opcheck():
    qw = make_qw(64, 128, 32, True, False, seed=9)
    lay = L.repack_cuda(qw, torch.bfloat16)
    x = torch.randn(2, 128).bfloat16()
    torch.library.opcheck(torch.ops.sdquant.w4a16_cuda,
                          (x, lay["qweight"], lay["scales"], lay["zeros"], lay["perm"], lay["locks"], None),
                          {"splits": 2, "evict_first": False, "config": 3 + 64 * 4})
    x = torch.randn(144, 128).bfloat16()  # a part-filled last tile, with the plan's tail argument
    torch.library.opcheck(torch.ops.sdquant.w4a16_cuda,
                          (x, lay["qweight"], lay["scales"], lay["zeros"], lay["perm"], lay["locks"], None),
                          {"config": 63, "tail": 32})


def test_every_kernel_source_is_package_data():
    """A wheel must carry every file the extension build reads (a header left out makes the build fail on the user's
    machine, which then falls back to Triton with a warning)."""
    import fnmatch
    import tomllib
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["sdquant"]
    sources = sorted(p.relative_to(root / "sdquant").as_posix() for p in int4_cuda.CSRC.iterdir() if p.is_file())
    assert sources and "kernels/csrc/w4a16.h" in sources
    assert [f for f in sources if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []


def test_wgmma_schedule_modes_are_checked():
    with pytest.raises(ValueError, match="mode: 'on' is not one of"):
        int4_cuda.set_wgmma_schedule("on")


def test_wgmma_rows_setting_is_checked():
    with pytest.raises(ValueError, match="rows: 128 must be 0"):
        int4_cuda.set_wgmma_rows(128)


def test_wgmma_one_launch_k_setting_is_checked():
    with pytest.raises(ValueError, match="k_max: -1 must be >= 0"):
        int4_cuda.set_wgmma_one_launch_k(-1)


def test_wgmma_cluster_rows_setting_is_checked():
    for bad in (64, 258):
        with pytest.raises(ValueError, match=f"min_rows: {bad} must be 65-257"):
            int4_cuda.set_wgmma_cluster_rows(bad)


def test_wgmma_wave_cost_setting_is_checked():
    with pytest.raises(ValueError, match="stages: -2 must be >= 0"):
        int4_cuda.set_wgmma_wave_cost(-2)


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_one_launch_short_k_toggle(tmp_path):
    """sdq_wg_one_launch_short_k (w4a16.h), Pending 42's rule (k_max 4096 by default since 2026-12-07): at M > 256 and
    K <= k_max (groups a multiple of 128, K of 128) it grants the one launch; off (k_max 0), at M <= 256 or at longer
    K never. Cases: (m, k, group_k16, k_max) -> granted."""
    cases = [
        ((520, 4096, 8, 4096), 1),     # 4096x4096 M = 520: the fill test refused it (three 256-row launches)
        ((777, 4096, 8, 4096), 1),
        ((520, 14336, 8, 4096), 0),    # 14336x4096: one launch measured slower; K above the limit
        ((520, 4096, 8, 0), 0),        # off
        ((256, 4096, 8, 4096), 0),     # M <= 256: not the one-launch question
        ((520, 4096, 4, 4096), 0),     # group 64: the warp-specialized kernel does not take it
        ((520, 4160, 8, 8192), 0),     # K not a multiple of 128
    ]
    got = _run_host_rule(tmp_path, [f"sdq_wg_one_launch_short_k({m}, {k}, {g}, {km})" for (m, k, g, km), _ in cases]
                         + ["SDQ_WG_ONE_LAUNCH_K_DEFAULT"])
    assert got == [want for _, want in cases] + [4096]


def test_split_rows_leaves_a_stream_k_launch_whole(monkeypatch):
    """int4_cuda._split_rows: above 256 rows the last part-filled tile runs apart where ``remainder_rows`` says (the
    full tiles in one launch, the tile adding a wave to at most two), but not where the whole M runs stream-K over the
    warp-specialized pipeline (path "ws-stream"). 4096x4096 at M = 1040 on 132 SMs: 128 full tiles make one wave, the
    last tile's 16 a second."""
    asked = []
    monkeypatch.setattr(int4_cuda, "launch_rows", lambda m, n, k, gs, c, dt=None: m)
    monkeypatch.setattr(int4_cuda, "_sm_count", lambda device: 132)
    for path, want in (("ws", 16), ("ws-cluster", 16), ("ws-stream", 0)):
        def fake_path(m, n, k, gs, c=63, dt=None, splits=0, path=path):
            asked.append(m)
            return path
        monkeypatch.setattr(int4_cuda, "wgmma_path", fake_path)
        assert int4_cuda._split_rows(1040, 4096, 4096, 128, 63, 0, torch.bfloat16, torch.device("cpu")) == want
    assert asked == [1040, 1040, 1040]  # the whole M's path is what decides
    # one launch refused for the full tiles: no split at all, whatever the path
    monkeypatch.setattr(int4_cuda, "launch_rows", lambda m, n, k, gs, c, dt=None: 256)
    assert int4_cuda._split_rows(1040, 4096, 4096, 128, 63, 0, torch.bfloat16, torch.device("cpu")) == 0


def test_wgmma_remainder_rows_rule():
    """set_wgmma_remainder / remainder_rows: off by default; when set, only the last part-filled 128-token tile of a
    wgmma launch (M > 128, 1..rows rows) is split off; other kernels' configs and whole tiles never are."""
    assert int4_cuda.remainder_rows(144, 63) == 0                     # off by default
    old = int4_cuda.set_wgmma_remainder(64)
    try:
        assert [int4_cuda.remainder_rows(m, 63) for m in (144, 192, 200, 256, 128, 100, 1040, 777)] == \
            [16, 64, 0, 0, 0, 0, 16, 9]
        assert int4_cuda.remainder_rows(144, 62) == 16
        assert int4_cuda.remainder_rows(144, 5) == 0                  # a tight-kernel config
        assert int4_cuda.set_wgmma_remainder(32) == 64
        assert int4_cuda.remainder_rows(192, 63) == 0 and int4_cuda.remainder_rows(160, 63) == 32
    finally:
        int4_cuda.set_wgmma_remainder(old)
    for bad in (128, -2):
        with pytest.raises(ValueError, match="rows: .* is not in -1..127"):
            int4_cuda.set_wgmma_remainder(bad)
    old = int4_cuda.set_wgmma_remainder(0)                               # never: not even the automatic rules
    try:
        assert old == -1
        assert int4_cuda.remainder_rows(144, 63, 64) == 0 and int4_cuda.remainder_rows(1040, 63, 0, 4096, 132, True) == 0
    finally:
        int4_cuda.set_wgmma_remainder(old)


def test_wgmma_wave_tail_rule_above_256_rows():
    """M > 256 where the rows before the last tile run in one launch: the last tile's rows (<= 64) run apart only
    where they add a wave to at most two. The shapes and M of int4_wgmma run 45 (H100, 132 SMs) get the split exactly
    where it was faster."""
    rr = lambda m, n, sms=132, one=True: int4_cuda.remainder_rows(m, 63, 0, n, sms, one)  # noqa: E731
    assert rr(1040, 4096) == 16 and rr(1088, 4096) == 64           # 4096x4096, 14336x4096: 128 -> 144 tiles
    assert rr(1040, 8192) == 16 and rr(1088, 8192) == 64           # 28672x8192: 256 -> 288 tiles, 2 -> 3 waves
    assert rr(1040, 28672) == 0                                    # 8192x28672: 7 -> 8 waves, level there
    assert rr(1040, 10240) == 0 and rr(1088, 6144) == 0            # no wave added: the split was slower
    assert rr(1100, 4096) == 0                                     # 76 rows: more than WAVE_TAIL_ROWS
    assert rr(1040, 4096, one=False) == 0 and rr(1040, 4096, sms=0) == 0 and rr(1024, 4096) == 0
    assert rr(1040, 4096, sms=160) == 0                             # a larger GPU: 144 tiles are one wave
    assert int4_cuda.remainder_rows(1040, 5, 0, 4096, 132, True) == 0   # not a wgmma config


def test_wgmma_tail_from_the_plan():
    """The op's ``tail`` (a layer plan's cuda_tail): the last tile's rows at M = 129-256 only, up to ``tail``; a set
    set_wgmma_remainder overrides it (A/B runs), at any M > 128."""
    assert [int4_cuda.remainder_rows(m, 63, 32) for m in (144, 160, 161, 192, 256, 128, 300, 1040)] == \
        [16, 32, 0, 0, 0, 0, 0, 0]
    assert int4_cuda.remainder_rows(144, 5, 32) == 0 and int4_cuda.remainder_rows(144, 63, 0) == 0
    old = int4_cuda.set_wgmma_remainder(16)
    try:
        assert int4_cuda.remainder_rows(160, 63, 64) == 0 and int4_cuda.remainder_rows(1040, 63, 0) == 16
    finally:
        int4_cuda.set_wgmma_remainder(old)


def test_config_encoding_and_defaults():
    assert int4_cuda.split_config(-1) == (0, 0)
    assert int4_cuda.split_config(5 + 64 * 6) == (5, 6) == int4_cuda.split_config(int4_cuda.make_config(5, 6))
    assert int4_cuda.split_config(15) == (15, 0)         # a stream-K variant
    assert int4_cuda.split_config(63) == (63, 0)         # the wgmma kernel
    assert sorted([*int4_cuda.STREAMK_VARIANTS, *int4_cuda.LEAN_VARIANTS, *int4_cuda.TIGHT_VARIANTS,
                   *int4_cuda.BULK_VARIANTS, *int4_cuda.FEED_VARIANTS, *int4_cuda.WGMMA_VARIANTS]) == \
        list(range(13, int4_cuda.N_VARIANTS))
    assert not set(int4_cuda.LEAN_VARIANTS) & set(int4_cuda.WSCALE_TWIN)  # lean kernels handle fp16 themselves
    assert not set(int4_cuda.TIGHT_VARIANTS) & set(int4_cuda.WSCALE_TWIN)  # so does the tight kernel (fp32 group sums)
    for m in (1, 2, 3, 8, 9, 16):
        v, _ = int4_cuda.split_config(int4_cuda.auto_config(m, 4096, 4096))
        assert 0 <= v < int4_cuda.N_VARIANTS
    assert int4_cuda.auto_config(17, 4096, 4096, wgmma=False) == 37  # M = 17-32: a variant instantiated at 4 token tiles
    assert int4_cuda.auto_config(33, 8192, 28672, wgmma=False) == 0  # (32-row launches of the same config)
    # the wgmma kernel: every M > 32 where N % 256 == 0, and the measured points at M <= 32
    for m in (33, 64, 100, 256, 1000):
        assert int4_cuda.auto_config(m, 28672, 8192) in int4_cuda.WGMMA_VARIANTS
    assert int4_cuda.auto_config(33, 64 * 5, 4096) == 0     # N % 256 != 0: not the wgmma kernel
    assert int4_cuda.auto_config(32, 28672, 8192) == 62 and int4_cuda.auto_config(32, 4096, 4096) == 63
    assert int4_cuda.auto_config(16, 28672, 4096) == 62 and int4_cuda.auto_config(16, 4096, 4096) == 63
    assert int4_cuda.auto_config(16, 4096, 4096, wgmma=False) == 37
    assert int4_cuda.auto_config(32, 4096, 4096, wgmma=False) == 37
    for (k, n, b), c in int4_cuda.SHAPE_CONFIGS.items():
        assert b <= 16 or c % 64 in (0, *int4_cuda.NT4_VARIANTS), (k, n, b)
    for v, twin in int4_cuda.WSCALE_TWIN.items():           # fp16 never gets a per-weight-scale variant
        assert twin not in int4_cuda.WSCALE_TWIN and 13 <= v < int4_cuda.N_VARIANTS and 13 <= twin < int4_cuda.N_VARIANTS
    saved = dict(int4_cuda.DEFAULT_CONFIGS)
    try:
        int4_cuda.DEFAULT_CONFIGS[1] = 14 + 64 * 6
        assert int4_cuda.auto_config(1, 333 * 64, 4096) == 14 + 64 * 6
        assert int4_cuda.auto_config(1, 333 * 64, 4096, torch.float16) == 13 + 64 * 6
    finally:
        int4_cuda.DEFAULT_CONFIGS.clear()
        int4_cuda.DEFAULT_CONFIGS.update(saved)
    for (k, n, b), c in int4_cuda.SHAPE_CONFIGS.items():  # fp16 keeps a fp32-group-sum config everywhere
        assert int4_cuda.auto_config(b, n, k, torch.float16) % 64 not in int4_cuda.WSCALE_TWIN
    assert int4_cuda.auto_config(1, 28672, 8192, torch.float16) == 38  # the tight kernel sums groups in fp32: both dtypes
    assert [int4_cuda.m_bucket(m) for m in (1, 2, 3, 5, 9, 17)] == [1, 2, 4, 8, 16, 32]


def test_rejects_bad_inputs():
    lay = L.repack_cuda(make_qw(64, 128, 32, True, False), torch.float16)
    args = (lay["qweight"], lay["scales"], lay["zeros"], None, lay["locks"], None)
    with pytest.raises(ShapeError, match="last dim"):
        torch.ops.sdquant.w4a16_cuda(torch.randn(1, 64).half(), *args)
    with pytest.raises(ShapeError, match="dtype"):
        torch.ops.sdquant.w4a16_cuda(torch.randn(1, 128).bfloat16(), *args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_unavailable_without_gpu_warns_once():
    int4_cuda._STATE.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert int4_cuda.available() is False
        assert int4_cuda.available() is False
    assert sum("Triton" in str(w.message) for w in rec) == 1
    int4_cuda._STATE.clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_wgmma_settings_and_queries_without_the_extension():
    """The wgmma kernel's process settings and launch queries answer their documented defaults where the extension
    cannot be built (benches call them unconditionally), and build nothing."""
    int4_cuda._STATE.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert int4_cuda.set_wgmma_rows(256) == 0
        assert int4_cuda.set_wgmma_cluster(False) is True
        assert int4_cuda.set_wgmma_wave_splits(False) is True
        assert int4_cuda.set_wgmma_wave_cost(0) == 4
        assert int4_cuda.set_wgmma_stream_k_above_256(False) is True
        assert int4_cuda.set_wgmma_two_warpgroups("never") == "auto"
        assert int4_cuda.set_wgmma_one_launch_k(0) == 0
        assert int4_cuda.set_wgmma_cluster_rows(97) == 65
        assert int4_cuda.launch_rows(1024, 4096, 4096, 128, 63) == 0
        assert int4_cuda.wgmma_path(1024, 4096, 4096, 128) == ""
        assert int4_cuda.wgmma_max_clusters(2) == 0
    assert int4_cuda._STATE.get("ext") is None
    int4_cuda._STATE.clear()


def test_compile_fullgraph_traces_the_op():
    qw = make_qw(64, 128, 64, False, False, seed=11)
    lay = L.repack_cuda(qw, torch.float16)

    def f(x):
        return torch.ops.sdquant.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"], None, lay["locks"],
                                            None).relu()
    x = torch.randn(4, 128).half()
    got = torch.compile(f, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, f(x))


def test_tuned_configs_from_an_int4_tune_json(tmp_path):
    """A bench/int4_tune.py run's proposed defaults can be used in-process (bench/e2e.py --int4-tuned) and put
    back; a file without them is a one-line ConfigError."""
    import json

    from sdquant.errors import ConfigError
    from sdquant.kernels import int4_cuda as ic
    p = tmp_path / "int4_tune.json"
    p.write_text(json.dumps({"chosen": {"DEFAULT_CONFIGS": {"1": 39, "2": 10}, "SHAPE_CONFIGS": {"4096x4096:M1": 46}}}))
    defaults, shapes = ic.tuned_configs(p)
    assert defaults == {1: 39, 2: 10} and shapes == {(4096, 4096, 1): 46}
    before = ic.auto_config(1, 28672, 8192), ic.auto_config(1, 4096, 4096)
    old = ic.use_configs(defaults, shapes)
    try:
        assert ic.auto_config(1, 4096, 4096) == 46 and ic.auto_config(1, 28672, 8192) == 39
        assert ic.auto_config(2, 6144, 4096) == 10
    finally:
        ic.use_configs(*old)
    assert (ic.auto_config(1, 28672, 8192), ic.auto_config(1, 4096, 4096)) == before
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"chosen": None}))
    with pytest.raises(ConfigError, match="bad.json"):
        ic.tuned_configs(bad)


@functools.lru_cache(maxsize=1)
def _nt1_ptx_by_kind() -> dict:
    """The bf16 one-token-tile unit's PTX, entry bodies by kernel kind (compiled once for the tests that read it)."""
    import re
    import subprocess
    src = next(p for p in int4_cuda.PART_SRCS if p.name.endswith("bf16_nt1.cu"))
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/part.ptx"
        subprocess.run([int4_cuda.nvcc_path(), "--ptx", *int4_cuda.NVCC_FLAGS, *int4_cuda.TORCH_NVCC_DEFINES,
                        str(src), "-o", out], check=True, capture_output=True, timeout=900)
        ptx = open(out).read()
    by_kind = {}
    for b in re.split(r"\.entry\s+", ptx)[1:]:
        kind = next((k for k in ("w4a16_direct_kernel", "w4a16_tight_kernel", "w4a16_streamk_kernel", "w4a16_lean_flat_kernel",
                                 "w4a16_lean_kernel", "w4a16_bulk_flat_kernel", "w4a16_bulk_kernel", "w4a16_kernel")
                     if k in b.split("(")[0]),
                    None)
        if kind:
            by_kind.setdefault(kind, []).append(b)
    return by_kind


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_split_k_count_in_is_one_acq_rel_atomic_a_cta():
    """The mma.sync kernels' split-K count-in (csrc split_count_in, SDQ_SPLIT_TAIL=1, docs/benchmarks/int4-cuda.md "The split-K
    count-in"): thread 0's acq_rel atomic after the CTA barrier, no fence.sc / membar in every thread (form 0, 0.3-0.5
    us slower a launch at M = 1-8)."""
    by_kind = _nt1_ptx_by_kind()
    for kind in ("w4a16_tight_kernel", "w4a16_direct_kernel", "w4a16_kernel"):
        assert by_kind[kind], kind
        for b in by_kind[kind]:
            assert "atom.acq_rel.gpu.global.add.s32" in b, kind
            assert "membar.gl" not in b and "fence.sc.gpu" not in b, kind


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_pdl_kernels_wait_before_reading_activations():
    """Programmatic dependent launch (int4_cuda.set_pdl): the launcher gives the attribute to the cp.async, direct
    bulk-copy and tight kernels (variants 0-12, 50-61, 38-41, 43-44) only, so exactly those must hold griddepcontrol.wait (a
    PDL-launched kernel without it could read the previous kernel's output before it is written) and let the next
    kernel launch."""
    by_kind = _nt1_ptx_by_kind()
    bulk = ("w4a16_bulk_kernel", "w4a16_bulk_flat_kernel")
    assert by_kind["w4a16_direct_kernel"] and by_kind["w4a16_kernel"] and all(by_kind[k] for k in bulk)
    assert by_kind["w4a16_tight_kernel"]
    for kind in ("w4a16_direct_kernel", "w4a16_tight_kernel", "w4a16_kernel", *bulk):
        for b in by_kind[kind]:
            assert "griddepcontrol.wait" in b and "griddepcontrol.launch_dependents" in b, kind
            # the direct and tight kernels issue their first weight loads before the wait, and read activations
            # after it
            if kind in ("w4a16_direct_kernel", "w4a16_tight_kernel"):
                assert b.index("ld.global.nc.L1::no_allocate") < b.index("griddepcontrol.wait")
            # the bulk-copy kernel requests its first chunks before the wait; activations (ld.global.nc) come after
            if kind in bulk:
                assert b.index("cp.async.bulk.shared::cluster.global") < b.index("griddepcontrol.wait")
                assert b.index("griddepcontrol.wait") < b.index("ld.global.nc.u32")


def test_gemm_trigger_setting(monkeypatch):
    """SDQUANT_GEMM_TRIGGER=first turns set_pdl's early trigger (2) into mode 3 (the tight kernel triggers before its
    prologue); it changes nothing without the early trigger, and a wrong value is an error naming the variable."""
    old = int4_cuda._PDL[0]
    try:
        monkeypatch.delenv("SDQUANT_GEMM_TRIGGER", raising=False)
        int4_cuda.set_pdl(True, early_trigger=True)
        assert int4_cuda._pdl_mode() == 2
        monkeypatch.setenv("SDQUANT_GEMM_TRIGGER", "first")
        assert int4_cuda._pdl_mode() == 3
        int4_cuda.set_pdl(True)
        assert int4_cuda._pdl_mode() == 1
        monkeypatch.setenv("SDQUANT_GEMM_TRIGGER", "early")
        with pytest.raises(ValueError, match="SDQUANT_GEMM_TRIGGER"):
            int4_cuda._pdl_mode()
    finally:
        int4_cuda._PDL[0] = old


def test_int4_tune_dry_proposes_every_bucket_up_to_32(tmp_path):
    """bench/int4_tune.py --dry (CPU op path, tiny shapes): the sweep, confirm pass and proposal run end to end and
    cover M = 17-32 with configs that exist there (variant 0 or NT4_VARIANTS); the JSON loads with tuned_configs."""
    import json
    import subprocess
    import sys

    from sdquant.kernels import int4_cuda as ic
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "int4_tune.py"), "--dry", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=str(root))
    assert r.returncode == 0, r.stderr[-2000:]
    chosen = json.loads((tmp_path / "int4_tune.json").read_text())["chosen"]
    assert {"1", "16", "32"} <= set(chosen["DEFAULT_CONFIGS"])
    assert int(chosen["DEFAULT_CONFIGS"]["32"]) % 64 in (0, *ic.NT4_VARIANTS)
    defaults, shapes = ic.tuned_configs(tmp_path / "int4_tune.json")
    assert all(c % 64 in (0, *ic.NT4_VARIANTS) for (_, _, b), c in shapes.items() if b > 16)
    assert defaults[32] == int(chosen["DEFAULT_CONFIGS"]["32"])
    log = (tmp_path / "int4_tune.log").read_text()
    assert "confirm pass over" in log and "| 32 |" in log


def test_wgmma_wrappers_are_generated_from_the_tool():
    import subprocess
    import sys
    from pathlib import Path
    tool = Path(__file__).resolve().parents[2] / "tools" / "gen_wgmma.py"
    assert subprocess.run([sys.executable, str(tool), "--check"]).returncode == 0, \
        "csrc/w4a16_wgmma_mma.cuh differs from tools/gen_wgmma.py's output: re-run the tool"


def _run_bench(script: str, *args, timeout: int = 600):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(root / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(root))


def test_int4_wgmma_and_x_smem_dry_runs_check_and_time_every_config(tmp_path):
    """bench/int4_wgmma.py and bench/x_smem.py --dry (CPU op path, tiny shapes): the checks pass for both wgmma
    variants, every provider is timed, and the tables print."""
    import json
    r = _run_bench("int4_wgmma.py", "--dry", "--rounds", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "int4_wgmma.json").read_text())
    assert d["passing"] == ["62", "63"] and d["checks"] and all(c["pass"] for c in d["checks"])
    assert d["rounds"] == 2 and all(len(row["v63_rounds"]) == 2 and row["v63"] > 0 for row in d["rows"])
    skipped = tmp_path / "skip"
    r2 = _run_bench("int4_wgmma.py", "--dry", "--configs", "63", "--skip", "triton,dequant", "--out", str(skipped))
    assert r2.returncode == 0, r2.stderr[-2000:]
    rows = json.loads((skipped / "int4_wgmma.json").read_text())["rows"]
    assert rows and all("triton" not in row and "dequant" not in row and row["bf16"] > 0 for row in rows)
    r2 = _run_bench("int4_wgmma.py", "--dry", "--skip", "bf16", "--out", str(skipped))
    assert r2.returncode != 0 and "--skip" in r2.stderr and "Traceback" not in r2.stderr
    assert len(d["src_digest"]) == 12  # which sources ran (bench/provenance.py)
    assert {c["config"] for c in d["checks"]} == {62, 63} and {c["M"] for c in d["checks"]} >= {1, 17, 40}
    for row in d["rows"]:
        assert row["bf16"] > 0 and row["v62"] > 0 and row["v63"] > 0 and row["v62_err"] < 1e-2
    assert "| K×N | M | bf16 |" in r.stdout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import int4_wgmma  # the labels of configs under a forced schedule (--schedule)
    assert [int4_wgmma.label(63, m) for m in ("auto", "ws")] == ["63", "63-ws"]
    assert [int4_wgmma.parse_label(v) for v in ("62", "63-stream", "63-k0+wc0")] == \
        [(62, "auto"), (63, "stream"), (63, "k0+wc0")]
    r = _run_bench("x_smem.py", "--dry", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "x_smem.json").read_text())["rows"]
    assert rows and all(row["v10_identical"] and row["v10_xs0"] > 0 for row in rows)


def test_int4_wgmma_joined_schedules_set_each_part_and_restore_in_reverse(monkeypatch):
    """bench/int4_wgmma.py's schedule_set: modes joined with "+" ("k0+wc0", the automatic schedule before 2026-12-07)
    apply each part's process setting in order and restore each previous value in reverse order on exit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import int4_wgmma
    calls, state = [], {"k": 4096, "wc": 4}

    def setter(key):
        def f(v):
            calls.append((key, int(v)))
            old, state[key] = state[key], int(v)
            return old
        return f
    monkeypatch.setattr(int4_cuda, "set_wgmma_one_launch_k", setter("k"))
    monkeypatch.setattr(int4_cuda, "set_wgmma_wave_cost", setter("wc"))
    with int4_wgmma.schedule_set("k0+wc0"):
        assert state == {"k": 0, "wc": 0}
    assert calls == [("k", 0), ("wc", 0), ("wc", 4), ("k", 4096)] and state == {"k": 4096, "wc": 4}
    with int4_wgmma.schedule_set("auto"):
        pass
    assert len(calls) == 4  # "auto" touches no setting


def test_chain_dry_runs_every_mode_and_sweep_entry(tmp_path):
    """bench/chain.py --dry (CPU op path, tiny layers): every chain mode (plain, fused with its ends, fused build with
    no end, mixed) and every --sweep entry runs through its real op calls with the decode step's shapes and
    dependencies, ends finite and with the input's shape (the script asserts both), and lands in the JSON."""
    import json
    r = _run_bench("chain.py", "--dry", "--layers", "2", "--ms", "1,3", "--modes", "PPPP,FFFF,NNNN,FPNP",
                   "--sweep", "38,40", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "chain.json").read_text())
    assert d["meta"]["modes"] == ["PPPP", "FFFF", "NNNN", "FPNP"] and [row["M"] for row in d["rows"]] == [1, 3]
    for row in d["rows"]:
        for tag in ("", "_pdl"):
            assert all(f"{mode}{tag}" in row for mode in d["meta"]["modes"])
            assert all(f"FFFF_{role}{v}{tag}" in row for role in ("qkv", "o", "gate_up", "down") for v in (38, 40))
    r = _run_bench("chain.py", "--dry", "--modes", "PPPP,FFFX", "--out", str(tmp_path))
    assert r.returncode != 0 and "--modes" in r.stderr


def test_int4_wgmma_update_table_writes_only_the_buckets_the_op_routes_to_wgmma(tmp_path):
    """--update-table: the "cuda" column gets a run's wgmma time exactly where auto_config picks a wgmma variant;
    other buckets, columns and entries stay as they were."""
    import json
    from sdquant.kernels import dispatch
    table = json.loads(dispatch.SHIPPED_TABLE.read_text())
    buckets = table["buckets"]
    run = {"date": "d", "commit": "c", "rows": [
        {"K": 8192, "N": 28672, "M": m, "v62": 1000.0 + m, "v63": 2000.0 + m} for m in (1, 16, 32, 64, 128)]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "table.json").write_text(json.dumps(table))
    r = _run_bench("int4_wgmma.py", "--update-table", str(tmp_path / "run.json"), str(tmp_path / "table.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    new = json.loads((tmp_path / "table.json").read_text())
    for e_old, e_new in zip(table["entries"], new["entries"]):
        hit = e_old["kind"] == "int4" and (e_old["K"], e_old["N"]) == (8192, 28672)
        for col, vals in e_old["us"].items():
            for i, (a, b) in enumerate(zip(vals, e_new["us"][col])):
                m = buckets[i]
                c = int4_cuda.auto_config(m, 28672, 8192)
                if hit and col == "cuda" and m in (16, 32, 64, 128) and c in int4_cuda.WGMMA_VARIANTS:
                    assert b == (1000.0 if c == 62 else 2000.0) + m
                else:
                    assert a == b, (col, m)
    assert "int4_cuda_wgmma" in new["meta"]


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def _run_host_rule(tmp_path, calls, header: str = "w4a16.h", prelude: str = "") -> list:
    """Compile and run printf("%d\\n", call) for each C call against a csrc header (host code, no GPU)."""
    import subprocess
    src = tmp_path / "rule.cu"
    body = "\n".join(f'  printf("%d\\n", {c});' for c in calls)
    src.write_text(f'#include <cstdio>\n#include "{header}"\n{prelude}\nint main() {{\n{body}\n  return 0;\n}}\n')
    exe = tmp_path / "rule"
    r = subprocess.run([int4_cuda.nvcc_path(), "-std=c++17", "-I", str(int4_cuda.CSRC), str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split()]


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_launch_state_is_kept_per_device(tmp_path):
    """w4a16_host.h: a kernel's shared-memory opt-in and occupancy are computed once per device ordinal (a second GPU
    in the same process gets its own), and every time for an ordinal past the table or an unknown one (-1)."""
    prelude = ("static int n = 0;\nstatic int f() { return 10 * ++n; }\n"
               "static int slot[sdq_w4a16::SDQ_DEVICES] = {};\nusing sdq_w4a16::per_device;")
    calls = ["per_device(slot, 0, f)", "per_device(slot, 0, f)", "per_device(slot, 1, f)", "per_device(slot, 0, f)",
             "per_device(slot, 1, f)", "per_device(slot, sdq_w4a16::SDQ_DEVICES, f)",
             "per_device(slot, sdq_w4a16::SDQ_DEVICES, f)", "per_device(slot, -1, f)", "n"]
    assert _run_host_rule(tmp_path, calls, "w4a16_host.h", prelude) == [10, 10, 20, 10, 20, 30, 40, 50, 5]


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_warp_specialized_rule_picks_the_measured_winner(tmp_path):
    """sdq_wg_ws_auto (w4a16.h): variant 63's warp-specialized split-K at the 128-token tile where it was measured
    faster (bench/ab_build.py runs 4-5, same process, us: warp-specialized vs the single-role kernel / stream-K), on
    the H200's 132 slots (one CTA a SM). Cases: (m, n, k, group_k16) -> 1 = warp-specialized."""
    cases = [
        ((128, 28672, 8192, 8), 1),   # 97.8 vs 126.3
        ((128, 8192, 28672, 8), 1),   # 96.6 vs 119.9
        ((128, 28672, 4096, 8), 1),   # 53.0 vs 64.1
        ((128, 4096, 14336, 8), 1),   # 34.4 vs 36.0
        ((128, 10240, 8192, 8), 1),   # 44.6 vs 48.1
        ((128, 4096, 4096, 8), 0),    # 21.4 vs 19.5
        ((128, 6144, 4096, 8), 0),    # 24.8 vs 23.2
        ((256, 10240, 8192, 8), 0),   # 94.7 vs stream-K 86.0 (80 tiles on 132 slots)
        ((256, 28672, 8192, 8), 1),   # 202.7 vs stream-K 234.3
        ((256, 6144, 4096, 8), 1),    # 34.9 vs stream-K 38.1
        ((192, 8192, 28672, 8), 1),   # 163.2 vs 214.6
        ((192, 4096, 14336, 8), 1),   # 50.2 vs 56.4
        ((192, 4096, 4096, 8), 0),    # 25.0 vs 24.1
        ((1024, 4096, 4096, 8), 1),   # M > 256, one launch (int4_wgmma run 30, H100): 56.0 vs 109.6 in 256-row launches
        ((512, 4096, 4096, 8), 1),    # 37.3 vs 53.6
        ((512, 10240, 8192, 8), 0),   # 160 tiles on 132 slots: stream-K 182.2 vs 203.5
        ((1024, 28672, 8192, 8), 1),  # 766.2 vs 844.9 (run 29)
        ((128, 28672, 8192, 4), 0),   # group 64: a stage would span two groups
        ((128, 28672, 8128, 8), 0),   # K not a multiple of 128
    ]
    got = _run_host_rule(tmp_path, [f"sdq_wg_ws_auto({m}, {n}, {k}, {g}, 132, 132)" for (m, n, k, g), _ in cases])
    assert got == [want for _, want in cases]


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_cluster_fit_split_rule(tmp_path):
    """sdq_wg_cluster_fit_splits (w4a16.h): at M = 65-256 with short splits, the largest split count <= the split-K
    grid's whose clusters all fit at once and that fills 70% of the slots (the H100's 132 slots and its measured
    cluster capacities, int4_wgmma run 33). Cases: (m, n, k, group_k16) -> splits (0 = not this path)."""
    cases = [
        ((128, 4096, 4096, 8), 6),    # 16 tiles: 8 and 7 splits do not fit (15 clusters), 6 do (17); 96 CTAs
        ((192, 4096, 4096, 8), 3),    # 32 tiles: 4 splits do not fit (30), 3 do (39)
        ((256, 4096, 4096, 8), 3),
        ((128, 6144, 4096, 8), 4),    # 24 tiles: 5 splits do not fit (22)
        ((192, 6144, 4096, 8), 2),    # 48 tiles, 2 splits: the grid's own count fits
        ((128, 4096, 14336, 8), 6),   # 14 stages a split at 8
        ((96, 4096, 4096, 8), 6),     # M = 65-96: the same clusters as M = 128 where K N < 2^25 (int4_wgmma run 76)
        ((80, 6144, 4096, 8), 4),
        ((80, 4096, 14336, 8), 0),    # M = 65-96 where the warp-specialized split-K takes the shape: 11-17% slower
        ((128, 10240, 8192, 8), 0),   # 21-stage splits at 3
        ((128, 8192, 28672, 8), 0),   # 56-stage splits at 4
        ((192, 10240, 8192, 8), 0),   # 80 tiles: one split
        ((300, 4096, 4096, 8), 0),    # M > 256: one launch, the grid's own split count
        ((128, 4096, 4096, 4), 0),    # group 64
    ]
    # min_rows (int4_cuda.set_wgmma_cluster_rows): 65 (the default) takes the 128-token tile's M = 65-96 with the same
    # split count as its M = 128 (one token tile either way), never a 64-token tile (M <= 64); 97 is the rule before
    # 2026-12-07 (M = 97-256), and 257 takes nothing
    rows = [((96, 4096, 4096, 8, 65), 6), ((65, 6144, 4096, 8, 65), 4), ((64, 4096, 4096, 8, 65), 0),
            ((96, 8192, 28672, 8, 65), 0), ((96, 4096, 4096, 8, 97), 0), ((97, 4096, 4096, 8, 97), 6),
            ((256, 4096, 4096, 8, 257), 0), ((128, 4096, 4096, 8, 129), 0)]
    cap = "{0, 0, 66, 39, 30, 22, 17, 15, 15}"
    got = _run_host_rule(tmp_path, [f"sdq_wg_cluster_fit_splits({m}, {n}, {k}, {g}, 132, 132, cap)"
                                    for (m, n, k, g), _ in cases] +
                         [f"sdq_wg_cluster_fit_splits({m}, {n}, {k}, {g}, 132, 132, cap, {r})"
                          for (m, n, k, g, r), _ in rows], prelude=f"static const int cap[9] = {cap};")
    assert got == [want for _, want in cases] + [want for _, want in rows]


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_ws_stream_k_rule_takes_the_single_role_stream_k_points(tmp_path):
    """sdq_wg_ws_sk_auto (w4a16.h): stream-K over the warp-specialized pipeline exactly where variant 63's automatic
    schedule ran the single-role stream-K. The cases are the paths the H100 took in int4_wgmma runs 43-44 (132 SMs, one
    CTA a SM for both 128-token kernels, its cluster capacities): "ws-stream" (run 44, the rule in place) and "stream"
    (run 43, before it) -> 1, "ws" / "ws-cluster" -> 0; the new path was 21-32% faster at every point it took."""
    ws_stream = {(256, 10240, 8192), (144, 10240, 8192), (192, 10240, 8192), (144, 18944, 3584), (192, 18944, 3584),
                 (256, 18944, 3584)}
    others = [(m, n, k) for m in (144, 192, 256) for (n, k) in
              ((28672, 8192), (28672, 4096), (8192, 28672), (4096, 14336), (4096, 4096), (6144, 4096), (128256, 4096),
               (3584, 18944), (4608, 3584))]
    others += [(128, n, k) for (n, k) in ((28672, 8192), (28672, 4096), (8192, 28672), (10240, 8192), (4096, 14336),
                                           (4096, 4096), (6144, 4096))]
    cases = [(c, 1) for c in sorted(ws_stream)] + [(c, 0) for c in others]
    cases += [((256, 10240, 8192, 4), 0), ((256, 10240, 8128, 8), 0), ((300, 10240, 8192, 8), 0)]  # group 64, K % 128, M > 256
    cases = [((*c, 8) if len(c) == 3 else c, want) for c, want in cases]
    cap = "{0, 0, 66, 39, 30, 22, 17, 15, 15}"
    got = _run_host_rule(tmp_path, [f"sdq_wg_ws_sk_auto({m}, {n}, {k}, {g}, 132, 132, 132, cap)"
                                    for (m, n, k, g), _ in cases], prelude=f"static const int cap[9] = {cap};")
    assert got == [want for _, want in cases]
    # any M fits the kernel (its locks are per owner CTA), automatic only at M = 129-256 so far
    assert _run_host_rule(tmp_path, ["sdq_wg_ws_sk_fits(1024, 28672, 8192, 8)", "sdq_wg_ws_sk_fits(4096, 8192, 28672, 8)",
                                     "sdq_wg_ws_sk_fits(1024, 28672, 8192, 4)", "SDQ_LOCKS_MIN"]) == [1, 1, 0, 1024]


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_stream_k_above_256_rows_rule(tmp_path):
    """sdq_wg_ws_sk_big (w4a16.h): above 256 rows, stream-K over the warp-specialized pipeline in place of the one
    launch where that launch runs without wave splits and its waves leave enough idle: 1.1 tiles S / slots + 4 stages
    < w1 S. Cases from H100 int4_wgmma run 52 (132 slots): (m, n, k, wave splits of the one launch) -> stream-K."""
    cases = [
        ((384, 8192, 28672, 1), 1),    # 96 tiles of 224 stages in one part-empty wave: 278 against 359 us
        ((640, 10240, 8192, 1), 1),    # 200 tiles, 2 waves 76% full: 166 against 206
        ((2100, 6144, 4096, 1), 1),    # 408 tiles, 4 waves 77% full: 166 against 192
        ((520, 4096, 4096, 1), 1),     # 80 tiles in one wave: 41 against 46
        ((4096, 28672, 8192, 1), 0),   # 3584 tiles, 28 waves 97% full: stream-K 1.08x the time
        ((1040, 28672, 4096, 1), 0),   # 1008 tiles, 8 waves 95% full: 1.11x
        ((777, 4096, 4096, 1), 0),     # 112 tiles, one wave 85% full, 32 stages: 1.13x
        ((1536, 4096, 4096, 2), 0),    # the one launch splits in two (sdq_wg_wave_splits): not taken
        ((256, 28672, 8192, 1), 0),    # M <= 256: sdq_wg_ws_sk_auto's question
    ]
    got = _run_host_rule(tmp_path, [f"sdq_wg_ws_sk_big({m}, {n}, {k}, 8, 132, {w})" for (m, n, k, w), _ in cases]
                         + ["sdq_wg_ws_sk_big(520, 4096, 4096, 4, 132, 1)", "sdq_wg_ws_sk_big(520, 4096, 4160, 8, 132, 1)"])
    assert got == [want for _, want in cases] + [0, 0]  # group 64, K not a multiple of 128: the kernel cannot


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_two_warpgroups_rule(tmp_path):
    """sdq_wg_two_wg (w4a16.h): the 32- / 64-token tiles run two warpgroups of 128 features where the one-warpgroup
    split-K grid (its splits capped at 8 stages of 64 K) holds at most one CTA a SM. H100 ab_build run 27: 4096x4096
    (the one such Llama shape) 5-9% faster at M = 24-64, the others level or slower. Cases on 132 SMs with the
    one-warpgroup kernel's resident CTAs (2 a SM at 64 tokens, 3 at 32): (m, n, k, ntok, slots) -> two."""
    cases = [
        ((64, 4096, 4096, 64, 264), 1),     # 16 tiles x 8 splits = 128 CTAs: 14.6 -> 13.8 us
        ((48, 4096, 4096, 64, 264), 1),     # 13.8 -> 12.6
        ((32, 4096, 4096, 32, 396), 1),     # 16 x 8: 11.1 -> 10.7
        ((64, 4096, 2048, 64, 264), 1),     # K = 2048: 4 splits, 64 CTAs
        ((64, 6144, 4096, 64, 264), 0),     # 24 x 8 = 192 CTAs: level (18.8 -> 18.5)
        ((64, 4096, 14336, 64, 264), 0),    # 16 x 16 = 256: level (28.8 -> 28.3)
        ((64, 10240, 8192, 64, 264), 0),    # 40 x 6 = 240: level
        ((64, 28672, 8192, 64, 264), 0),    # 112 x 2 = 224: 8192x28672 79.2 -> 86.5
        ((32, 128256, 4096, 32, 396), 0),   # lm_head
        ((16, 4096, 4096, 16, 264), 0),     # the 16-token tile keeps one (the raw kernel)
        ((128, 4096, 4096, 128, 132), 0),   # the 128-token tile always has two
    ]
    got = _run_host_rule(tmp_path, [f"sdq_wg_two_wg({m}, {n}, {k}, {nt}, {s}, 132)" for (m, n, k, nt, s), _ in cases])
    assert got == [want for _, want in cases]


def test_wgmma_two_warpgroups_setting_is_checked_and_benched(monkeypatch):
    """int4_cuda.set_wgmma_two_warpgroups takes "auto" / "never" / "always" and names the field otherwise;
    bench/int4_wgmma.py's "1wg" / "2wg" schedules set "never" / "always" and restore the mode before."""
    with pytest.raises(ValueError, match="mode: 'sometimes' is not one of"):
        int4_cuda.set_wgmma_two_warpgroups("sometimes")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import int4_wgmma
    state = {"mode": "auto"}

    def setter(mode):
        old, state["mode"] = state["mode"], mode
        return old
    monkeypatch.setattr(int4_cuda, "set_wgmma_two_warpgroups", setter)
    for sched, want in (("1wg", "never"), ("2wg", "always")):
        with int4_wgmma.schedule_set(sched):
            assert state["mode"] == want
        assert state["mode"] == "auto"


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_wgmma_wave_split_rule(tmp_path):
    """sdq_wg_wave_splits (w4a16.h): at M > 256, two splits in clusters of 2 where twice the CTAs at half the work take
    at most 90% of the waves' time (the fill rule) and the waves of half the work plus the cluster sum's cost (4 stages
    of 128 K by default) take less than the waves of whole tiles (the cost rule); 132 slots, 66 pairs resident as on
    the H100. Cases: (m, n, k, group_k16) -> splits."""
    cases = [
        ((1024, 6144, 4096, 8), 2),    # 192 tiles: 2 waves -> 3 half waves (measured -14%)
        ((1024, 10240, 8192, 8), 2),   # 320 tiles: 3 -> 5 half waves (-9..-15%)
        ((512, 28672, 8192, 8), 2),    # 448 tiles of 64 stages: 4 -> 7 half waves (-5..-8%)
        ((1536, 4096, 4096, 8), 2),    # 192 tiles: 2 -> 3 (-7%)
        ((520, 28672, 4096, 8), 1),    # 560 tiles of 32 stages: 5 -> 9 half waves, the sums cost more (+13% split)
        ((512, 28672, 4096, 8), 1),    # 448 tiles of 32 stages: 4 -> 7, 7 x 20 > 4 x 32
        ((1536, 6144, 4096, 8), 1),    # 288 tiles: 3 -> 5 (+7% split)
        ((2100, 6144, 4096, 8), 1),    # 408 tiles: 4 -> 7 (+15% split)
        ((1024, 28672, 8192, 8), 1),   # 896 tiles: 7 -> 14 half waves, nothing gained
        ((1024, 4096, 14336, 8), 1),   # 128 tiles in one wave
        ((2048, 4096, 4096, 8), 1),    # 256 tiles: 2 -> 4 half waves
        ((256, 6144, 4096, 8), 1),     # M <= 256: not the one-launch path
        ((1024, 6144, 1024, 8), 1),    # 8 stages of 128 K: splits too short
        ((1024, 6144, 4096, 4), 1),    # group 64
    ]
    got = _run_host_rule(tmp_path, [f"sdq_wg_wave_splits({m}, {n}, {k}, {g}, 132, 66, SDQ_WG_WAVE_COST_DEFAULT)"
                                    for (m, n, k, g), _ in cases] + ["SDQ_WG_WAVE_COST_DEFAULT"])
    assert got == [want for _, want in cases] + [4]
    # pairs that do not pack the device (fewer than 90% of the slots as clusters of 2): never
    assert _run_host_rule(tmp_path, ["sdq_wg_wave_splits(1024, 6144, 4096, 8, 132, 59, 4)"]) == [1]
    # cost 0: the fill rule alone (the rule before 2026-12-07) splits where the cost rule does not; an explicit cost
    # equal to the default answers as the default; a larger cost refuses a split the default keeps
    assert _run_host_rule(tmp_path, ["sdq_wg_wave_splits(520, 28672, 4096, 8, 132, 66, 0)",
                                     "sdq_wg_wave_splits(2100, 6144, 4096, 8, 132, 66, 0)",
                                     "sdq_wg_wave_splits(1536, 4096, 4096, 8, 132, 66, 4)",
                                     "sdq_wg_wave_splits(1536, 4096, 4096, 8, 132, 66, 16)"]) == [2, 2, 2, 1]


def test_wgmma_split_rule(tmp_path):
    """csrc/w4a16.h's split-K rule of the wgmma kernel (host code, compiled and run here): fill the resident slots,
    at least 8 stages of 64 K a split, at most two CTAs per SM where splits would be short and 3+ remain
    (bench/int4_wgmma.py run 17). Cases: (tiles, slots, k, 2 x SMs) -> splits."""
    cases = [
        ((112, 396, 8192, 264), 3),     # 8192x28672 M = 16: 3 CTAs per SM, long splits: fill the slots
        ((16, 396, 4096, 264), 8),      # 4096x4096 M = 16: 24 would be 2.7-stage splits; 8 stages at least
        ((16, 264, 4096, 264), 8),      # 4096x4096 M = 64
        ((16, 396, 14336, 264), 16),    # 14336x4096 M = 32: 24 short splits -> two CTAs per SM
        ((32, 396, 28672, 264), 12),    # 28672x8192 M = 16: splits of 37 stages stay
        ((40, 396, 8192, 264), 6),      # 8192x10240 M = 16: 9 splits of 14 stages -> 6
        ((112, 264, 8192, 0), 2),       # an explicit CTA target (no two-per-SM cap)
        ((4, 132, 512, 264), 1),        # K too short for two 8-stage splits
    ]
    got = _run_host_rule(tmp_path, [f"sdq_wg_splits({t}, {c}, {k}, {two})" for (t, c, k, two), _ in cases])
    assert got == [want for _, want in cases]
