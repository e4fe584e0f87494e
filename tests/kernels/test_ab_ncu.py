"""bench/ab_ncu.py's host side (the profiling itself needs the H200 and ncu): the ncu command profiles the child with
the same point and builds, and the report filter keeps the figures the A/B is read by."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ab_ncu  # noqa: E402


def test_ncu_command_runs_the_child_at_the_same_point():
    args = ab_ncu.parser().parse_args(["--new-defines=-DFOO=1,-DBAR=2", "--config", "62", "--k", "4096", "--n",
                                       "6144", "--m", "96", "--kernel-regex", "w4a16_tight"])
    cmd = ab_ncu.ncu_command(args, "/opt/ncu", "/usr/bin/python3")
    assert cmd[:5] == ["/opt/ncu", "--clock-control", "none", "--kernel-name", "regex:w4a16_tight"]
    sections = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"]
    assert sections == ["SpeedOfLight", "Occupancy", "SchedulerStats", "WarpStateStats", "LaunchStats"]
    script = cmd.index("/usr/bin/python3") + 1
    assert cmd[script].endswith("bench/ab_ncu.py")
    child = ab_ncu.parser().parse_args(cmd[script + 1:])
    assert child.child and child.new_defines == "-DFOO=1,-DBAR=2"
    assert (child.config, child.k, child.n, child.m) == (62, 4096, 6144, 96)


def test_key_lines_keep_the_figures_and_drop_the_rest():
    report = "\n".join([
        "==PROF== Connected to process 1",
        "  void unnamed>::w4a16_wgmma_kernel<__nv_bfloat16, 128>(SdqW4A16Params) (1, 112, 1)x(256, 1, 1)",
        "    Section: GPU Speed Of Light Throughput",
        "    Duration                         us       120.13",
        "    Memory Throughput                %        22.38",
        "    Warp Cycles Per Issued Instruction             cycle         5.44",
        "    Achieved Occupancy                        %        12.48",
        "outputs agree: True (max rel 0.0e+00)",
    ])
    kept = ab_ncu.key_lines(report)
    assert kept == [
        "  void unnamed>::w4a16_wgmma_kernel<__nv_bfloat16, 128>(SdqW4A16Params) (1, 112, 1)x(256, 1, 1)",
        "    Duration                         us       120.13",
        "    Warp Cycles Per Issued Instruction             cycle         5.44",
        "    Achieved Occupancy                        %        12.48",
        "outputs agree: True (max rel 0.0e+00)",
    ]
    assert len(ab_ncu.key_lines("x" * 500 + " Duration", width=40)[0]) == 40
