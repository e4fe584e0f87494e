"""bench/compile_smoke.py's own checks on the CPU (--cpu: fp32, aot_eager): the compiled runtime in both scopes against
the eager one, then the extra prompt shapes (other lengths at the same batch, other batch sizes)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_compile_smoke_cpu(tmp_path):
    import compile_smoke
    out = tmp_path / "cs.json"
    assert compile_smoke.main(["--cpu", "--quant", "int4", "--shapes", "2x5,1x7", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] and res["device"] == "cpu"
    shapes = [(r["scope"], r.get("shape")) for r in res["rows"]]
    assert shapes == [("model", "2x5"), ("model", "1x7"), ("model", None),
                      ("block", "2x5"), ("block", "1x7"), ("block", None)]
    assert all(r["passed"] and r["step_rel_diff"] < 1e-4 for r in res["rows"])
