"""bench/mlp_fused (the batch-1 MLP-in-one-kernel experiment, docs/benchmarks/pending.md Pending 22): its CUDA source compiles
for sm_90a with the flags of the sdquant extension, the bf16 MLP kernel within 24 bytes of register spills (ptxas 13.0
spills 20 bytes at 128 registers). It runs only on the H200 (bench/mlp_fused.py), where it checks itself."""
import sys
from pathlib import Path

import pytest

from sdquant.kernels import int4_cuda

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cuda_exp  # noqa: E402


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_mlp_experiment_compiles_for_sm90a(tmp_path):
    r = cuda_exp.run_compile_only("mlp_fused.py", tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "w4a16_mlp.o").stat().st_size > 0
    mlp_bf16 = cuda_exp.ptxas_spills(r.stdout + r.stderr, "w4a16_mlp_kernel")  # ptxas -v: the bf16 MLP kernel
    assert len(mlp_bf16) == 1, r.stdout[-3000:]
    assert max(spill for _, spill in mlp_bf16) <= 24, mlp_bf16
