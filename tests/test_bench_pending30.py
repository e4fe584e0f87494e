"""bench/pending30_bisect.py (Pending 30's second reproduction) on the CPU: the control sequence (plain generate, no
CUDA graph) on a block-compiled INT4 model passes every stage check, and the graph mode is refused without a GPU."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_pending30_bisect_cpu_control(tmp_path):
    import pending30_bisect
    out = tmp_path / "p30.json"
    assert pending30_bisect.main(["--cpu", "--graph", "off", "--shapes", "2x5", "--before", "model",
                                  "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    stages = [r["stage"] for r in res["rows"]]
    assert stages == ["eager 2x12", "compiled 2x12 x24", "again 2x12 x24", "direct step 2x12", "generate 2x5",
                      "direct step 2x5"]
    assert res["ok"] and all(r["passed"] and not any(v["nan_cache"] for v in r["state"].values()) for r in res["rows"])
    assert set(res["rows"][-1]["state"]) == {"compiled", "eager"} and not any(res["rows"][-1]["nan_logits"].values())
    assert all(r["identical"] for r in res["rows"] if "identical" in r)
    assert all(r["step_rel_diff"] < 1e-4 for r in res["rows"] if "step_rel_diff" in r)
    with pytest.raises(SystemExit):
        pending30_bisect.main(["--cpu", "--graph", "on"])
