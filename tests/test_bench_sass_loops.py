"""bench/sass_loops.py's parsers on synthetic cuobjdump / ptxas text (CPU, no nvcc): kernels and their instructions,
loops found from backward branches with the main loop chosen as the innermost one holding the tensor-core work, and
the ptxas resource lines. With nvcc and cuobjdump at hand, the wgmma unit compiled for real."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sass_loops = pytest.importorskip("sass_loops")

from sdquant.kernels import int4_cuda  # noqa: E402

SASS = """
	code for sm_90a
		Function : _ZN9sdq_w4a1657_GLOBAL__N__hash_24_w4a16_part_x_cu_abc18w4a16_wgmma_kernelI13__nv_bfloat16Li32ELi4EEEv14P
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   LDS.128 R8, [R2] ;
        /*0030*/                   HGMMA.64x32x16.F32.BF16 R24, R8, gdesc[UR12], R24 ;
        /*0040*/                   HGMMA.64x32x16.F32.BF16 R40, R12, gdesc[UR12], R40, gsb0 ;
        /*0050*/               @!P0 BRA 0x20 ;
        /*0060*/                   LDG.E R3, desc[UR4][R6.64] ;
        /*0070*/                   ISETP.NE.AND P1, PT, R3, RZ, PT ;
        /*0080*/               @P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0xa0 ;
		Function : _ZN9sdq_w4a1657_GLOBAL__N__hash_24_w4a16_part_x_cu_abc16wg_reduce_kernelI13__nv_bfloat16EEv14P
        /*0000*/                   LDG.E R3, desc[UR4][R6.64] ;
        /*0010*/                   EXIT ;
"""

PTXAS = """ptxas info    : Compiling entry function '_ZN9sdq_w4a1657_GLOBAL__N__hash_24_w4a16_part_x_cu_abc18w4a16_wgmma_kernelI13__nv_bfloat16Li32ELi4EEEv14P' for 'sm_90a'
ptxas info    : Function properties for _ZN9sdq_w4a1657_GLOBAL__N__hash_24_w4a16_part_x_cu_abc18w4a16_wgmma_kernelI13__nv_bfloat16Li32ELi4EEEv14P
    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 16 bytes smem
"""


def test_parse_sass_and_loops():
    funcs = sass_loops.parse_sass(SASS)
    assert len(funcs) == 2
    name = next(n for n in funcs if "wgmma_kernel" in n)
    insns = funcs[name]
    assert [a for a, _ in insns] == list(range(0, 0xb0, 0x10))
    assert sass_loops.opcode(insns[5][1]) == "BRA" and sass_loops.opcode(insns[1][1]) == "LDGSTS"
    found = sass_loops.loops(insns)
    # 0x20..0x50 (inner: 4 instructions, 2 HGMMA, 1 LDS) and 0x10..0x80 (outer: 8, with the LDGSTS and the LDG);
    # the self-branch at 0xa0 is not backward and holds nothing counted
    assert [(r["start"], r["end"], r["length"]) for r in found] == [(0x20, 0x50, 4), (0x10, 0x80, 8)]
    assert found[0]["HGMMA"] == 2 and found[0]["LDS"] == 1 and found[0]["LDGSTS"] == 0
    assert found[1]["HGMMA"] == 2 and found[1]["LDGSTS"] == 1 and found[1]["LDG"] == 1
    assert sass_loops.main_loop(found) is found[0] and sass_loops.main_loop([]) is None
    desc = sass_loops.describe({"registers": 168, "loops": found})
    assert desc == "168 regs; main loop 4 insns (2 HGMMA, 1 LDS)"  # the innermost of the two with the wgmmas
    assert sass_loops.short_name(name) == "w4a16_wgmma_kernel ILi32ELi4E"


def test_parse_ptxas():
    res = sass_loops.parse_ptxas(PTXAS)
    (k,) = res.values()
    assert k == {"spill_stores": 8, "spill_loads": 12, "registers": 168}
    assert sass_loops.describe(k) == "168 regs, 20 B spilled; main loop -"


@pytest.mark.skipif(int4_cuda.cuobjdump_path() is None or int4_cuda.nvcc_path() is None,
                    reason="no cuobjdump or no nvcc")
def test_compiles_the_wgmma_unit():
    res = sass_loops.compile_tu(int4_cuda.CSRC, "wgmma_bf16", [])
    raw = {n: k for n, k in res.items() if "wgmma_raw_kernel" in n}
    assert len(raw) == 4  # variants 62 and 63, in one warpgroup or two (Pending 46)
    for n, k in raw.items():  # 8 K steps of a warpgroup's 4 (one) or 2 (two) row tiles, and the activation sums' wgmma
        main = sass_loops.main_loop(k["loops"])
        assert main["HGMMA"] == (40 if "Li1EEE" in n else 24) and main["LDGSTS"] > 0, n
        assert k["spill_stores"] == 0 and 0 < k["registers"] <= 255
