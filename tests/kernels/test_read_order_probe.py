"""bench/read_order.py's probe kernels compile for sm_90a (they build only on the GPU machine otherwise)."""
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sdquant.kernels import int4_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.mark.skipif(int4_cuda.nvcc_path() is None, reason="nvcc not installed")
def test_read_order_probe_kernels_compile_for_sm90a():
    import read_order
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cu"
        src.write_text(read_order.device_source())
        r = subprocess.run([int4_cuda.nvcc_path(), "-c", *int4_cuda.NVCC_FLAGS, "-Xptxas", "-v", str(src),
                            "-o", str(Path(d) / "probe.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    entries = [ln for ln in r.stderr.splitlines() if "Compiling entry function" in ln]
    # the mode 1-3 probes at U = 2, 4, 8 (the bare and linear probes are instantiated by the torch-facing host
    # functions, which this standalone source leaves out)
    assert sum("stream_probe_k" in ln for ln in entries) == 9
