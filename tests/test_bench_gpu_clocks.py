"""bench/gpu_clocks.py: nvidia-smi's streamed samples parsed, stamped and summarized per timing window (a stand-in
command plays nvidia-smi here), and nothing at all where nvidia-smi is missing."""
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_clocks  # noqa: E402


def test_parse_line():
    assert gpu_clocks.parse_line("1980, 2619, 612.31, 54, 0x0000000000000004\n") == {
        "sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 612.31, "temp_c": 54.0, "reasons": 4}
    # without the reasons field (older drivers), and with fields a GPU does not report
    assert gpu_clocks.parse_line("1755, 2619, [N/A], 61") == {
        "sm_mhz": 1755.0, "mem_mhz": 2619.0, "power_w": None, "temp_c": 61.0, "reasons": None}
    for bad in ("", "clocks.current.sm [MHz], clocks.mem", "Failed to initialize NVML: Unknown Error",
                "[N/A], 2619, 600, 50, 0x0"):
        assert gpu_clocks.parse_line(bad) is None


def _fake_smi(tmp_path, lines, pause_s):
    src = tmp_path / "fake_smi.py"
    src.write_text("import sys, time\n"
                   f"for line in {lines!r}:\n"
                   "    print(line, flush=True)\n"
                   f"    time.sleep({pause_s})\n"
                   "time.sleep(30)\n")
    return [sys.executable, str(src)]


def test_window_summarizes_the_samples_inside_it(tmp_path):
    lines = ["header, that, is, not, a sample", "1980, 2619, 500.5, 50, 0x0", "1755, 2619, 690.0, 58, 0x4",
             "1830, 2619, 650.0, 57, 0x1"]
    log = gpu_clocks.ClockLog.start(cmd=_fake_smi(tmp_path, lines, 0.05))
    t0 = time.monotonic()
    try:
        deadline = t0 + 20
        while len(log.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(log.samples) == 3  # the header line is dropped
        t1 = time.monotonic()
        w = log.window(t0 - 1, t1)
        assert w == {"sm_mhz": 1830, "sm_mhz_min": 1755, "n": 3, "mem_mhz": 2619.0, "power_w_max": 690.0,
                     "temp_c_max": 58.0, "reasons": "0x5"}
        assert gpu_clocks.mhz(w) == "1830 (1755)"
        # a window between samples: the last sample up to before_s earlier stands for it
        last_t = log.samples[-1][0]
        w2 = log.window(last_t + 0.001, last_t + 0.1)
        assert w2["n"] == 1 and w2["sm_mhz"] == 1830
        assert log.window(last_t + 5, last_t + 6) is None  # nothing recent: no state claimed
    finally:
        log.stop()
    assert log.proc.poll() is not None  # the sampler process is gone


def test_without_nvidia_smi_nothing_is_sampled(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    log = gpu_clocks.ClockLog.start()
    assert log.proc is None and log.window(0, time.monotonic()) is None
    log.stop()
    assert gpu_clocks.limits() is None
    assert gpu_clocks.mhz(None) == "–"


def test_a_command_that_cannot_start_gives_an_empty_log(tmp_path):
    log = gpu_clocks.ClockLog.start(cmd=[str(tmp_path / "no_such_program")])
    assert log.proc is None and log.window(0, time.monotonic()) is None


@pytest.mark.parametrize("out,want", [("700.00, 1980, 2619\n", {"power_limit_w": 700.0, "sm_mhz_max": 1980.0,
                                                                   "mem_mhz_max": 2619.0}),
                                      ("garbage\n", None)])
def test_limits(monkeypatch, out, want):
    class R:
        returncode = 0
        stdout = out
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpu_clocks.subprocess, "run", lambda *a, **k: R())
    assert gpu_clocks.limits() == want
