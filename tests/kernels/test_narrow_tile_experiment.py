"""bench/narrow_tile (the 16-feature-tile, no-split-K M <= 8 experiment): its layout is a permutation of the shipped
CUDA layout that holds the same weight (checked against the layout's own definition, on CPU), and its CUDA source
compiles for sm_90a with the sdquant extension's flags, the bf16 kernels without register spills but for the one
config built for 3 CTAs a SM. It runs only on the H200 (bench/narrow_tile.py), where it checks itself."""
import sys
from pathlib import Path

import pytest
import torch

from sdquant.kernels import int4_cuda, int4_layout

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cuda_exp  # noqa: E402
import gemm  # noqa: E402
import narrow_tile  # noqa: E402


@pytest.mark.parametrize("gs", [64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_narrow_layout_holds_the_weight(gs, sym):
    qw = gemm.random_int4(128, 512, gs, sym, False, seed=5)
    nl = narrow_tile.narrow_from_cuda(int4_layout.repack_cuda(qw, torch.bfloat16))
    assert nl["qweight"].shape == (8, 8, 32, 4) and nl["scales"].shape == (qw.scales.shape[1], 8, 8, 2)
    assert torch.equal(narrow_tile.dequantize_narrow(nl), qw.dequantize(torch.float32))


def test_narrow_layout_rejects_k_not_a_multiple_of_64():
    lay = {"qweight": torch.zeros(1, 6, 32, 4, dtype=torch.int32), "scales": torch.zeros(1, 1, 8, 8),
           "zeros": torch.zeros(1, 1, 8, 8)}                     # K = 6 x 16 = 96
    with pytest.raises(ValueError, match="multiple of 64"):
        narrow_tile.narrow_from_cuda(lay)


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_narrow_experiment_compiles_for_sm90a(tmp_path):
    r = cuda_exp.run_compile_only("narrow_tile.py", tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "w4a16_narrow.o").stat().st_size > 0
    bf16 = cuda_exp.ptxas_spills(r.stdout + r.stderr, "w4a16_narrow_kernel")
    assert len(bf16) == len(narrow_tile.VARIANTS), r.stdout[-3000:]
    # NCfg<1, 8, 8, 3> (variant 7) is capped at 85 registers and spills a little; every other config none
    assert all(spill == 0 for name, spill in bf16 if "ILi1ELi8ELi8ELi3E" not in name), bf16
    assert max(spill for _, spill in bf16) <= 16, bf16
