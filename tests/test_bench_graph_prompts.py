"""bench/graph_prompts.py (Pending 30's reproduction) on the CPU: its sequence of prompt shapes on a block-compiled
INT4 model against the eager one (no CUDA graph here), and the modes that need a GPU refused."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_graph_prompts_cpu_sequence(tmp_path):
    import graph_prompts
    out = tmp_path / "gp.json"
    assert graph_prompts.main(["--cpu", "--mode", "none", "--shapes", "2x6,2x3,1x4", "--tokens", "3",
                               "--first-tokens", "6", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["shape"] for r in res["rows"]] == ["2x6", "2x3", "1x4"] and res["ok"]
    for r in res["rows"]:
        assert r["identical"] and r["step_rel_diff"] < 1e-4 and not any(r["nan_logits"].values())
        assert not any(r["nan_cache"].values()) and r["prompt_moved_cache"] is False
    with pytest.raises(SystemExit):
        graph_prompts.main(["--cpu", "--mode", "replay"])
