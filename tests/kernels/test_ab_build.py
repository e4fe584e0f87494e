"""bench/ab_build.py's watchdog: a point that hangs (a kernel that never finishes blocks the CUDA call with the GIL
held) ends the process instead of the device call's whole time limit; a point that finishes disarms it."""
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(body: str) -> tuple:
    code = f"import sys, time; sys.path.insert(0, {str(BENCH)!r}); import ab_build\n{body}"
    t = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return r, time.time() - t


def test_watchdog_ends_a_hung_block():
    # libc's sleep through ctypes.PyDLL keeps the GIL, as a blocked CUDA synchronize does: no Python thread or signal
    # handler could run here
    r, took = _run("import ctypes\nwith ab_build.watchdog(1.0):\n    ctypes.PyDLL(None).sleep(30)\n"
                   "print('not reached')")
    assert r.returncode != 0 and "not reached" not in r.stdout
    assert "Timeout" in r.stderr and "line 4" in r.stderr  # the traceback names the line that hung (the sleep)
    assert took < 25


def test_watchdog_disarms_after_the_block():
    r, _ = _run("with ab_build.watchdog(1.0):\n    pass\ntime.sleep(2)\nprint('done')")
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
