"""`sdquant calibrate` under torchrun (gloo on CPU): 2 ranks write one package, equal to a one-process run,
and only rank 0 writes."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SETS = ["--set", "quant.method=awq+gptq", "--set", "quant.awq.grid=4", "--set", "report.max_new_tokens=0"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def test_cli_calibrate_under_torchrun_equals_one_process(tmp_path):
    import sdquant
    cfg = str(ROOT / "templates" / "tiny-rtn.yaml")
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    _run([sys.executable, "-m", "sdquant.cli", "calibrate", "--config", cfg, "--set", f"output={one}/m.sd2",
          "--no-progress", *SETS], tmp_path)
    p = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
              str(_port()), "-m", "sdquant.cli", "calibrate", "--config", cfg, "--set", f"output={two}/m.sd2",
              "--no-progress", *SETS], tmp_path)
    assert "data parallel over 2 ranks" in p.stdout
    assert sorted(f.name for f in two.iterdir()) == ["m.sd2"]          # one writer, no temporaries left
    a, b = sdquant.load(str(one / "m.sd2")), sdquant.load(str(two / "m.sd2"))
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
