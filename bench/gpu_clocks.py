"""What the GPU's clocks, power and temperature were while a point was timed, so that two runs (or two scripts) that
disagree can be told apart as a code difference or a machine-state difference (a power-capped H100 under a sustained
large GEMM clocks lower than one that also runs small kernels in between).

One ``nvidia-smi --query-gpu=... --loop-ms=<period>`` process streams samples for the whole run; a reader thread stamps each
line with the host's monotonic clock. ``window(t0, t1)`` summarizes the samples taken between two stamps (SM clock
median and minimum, memory clock, highest power and temperature, the clock-event reasons seen). Where nvidia-smi is
missing or fails, the log is empty and every window is None: the timings never depend on it.

    clocks = ClockLog.start()          # (50 ms samples) or ClockLog.start(cmd=[...]) in tests
    t0 = time.monotonic(); ...timed work...; t1 = time.monotonic()
    clocks.window(t0, t1)              # {"sm_mhz": 1980, "sm_mhz_min": 1755, ..., "n": 12} or None
    clocks.stop()
"""
from __future__ import annotations

import atexit
import shutil
import statistics
import subprocess
import threading
import time
from typing import Optional

FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
KEYS = ("sm_mhz", "mem_mhz", "power_w", "temp_c", "reasons")


def _num(s: str) -> Optional[float]:
    try:
        return float(s)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_line(line: str) -> Optional[dict]:
    """One CSV sample (noheader, nounits) -> {sm_mhz, mem_mhz, power_w, temp_c, reasons}; None for a line that is not
    one (a header, an error message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) not in (len(FIELDS) - 1, len(FIELDS)):
        return None
    vals = [_num(p) for p in parts[:4]]
    if vals[0] is None:
        return None
    reasons = parts[4] if len(parts) == len(FIELDS) else ""
    try:
        r = int(reasons, 16) if reasons.lower().startswith("0x") else None
    except ValueError:
        r = None
    return dict(zip(KEYS, [*vals, r]))


class ClockLog:
    """Samples from one streaming nvidia-smi process (see the module docstring)."""

    def __init__(self, proc: Optional[subprocess.Popen]):
        self.proc = proc
        self.samples: list = []  # (monotonic seconds, sample dict)
        self._lock = threading.Lock()
        self._thread = None
        if proc is not None:
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, period_ms: int = 50, gpu: int = 0, cmd: Optional[list] = None) -> "ClockLog":
        """Start sampling GPU `gpu` every `period_ms`; `cmd` replaces the nvidia-smi command line (tests)."""
        if cmd is None:
            exe = shutil.which("nvidia-smi")
            if exe is None:
                return cls(None)
            fields = FIELDS
            try:  # older drivers name the reasons field clocks_throttle_reasons: then go without it
                ok = subprocess.run([exe, f"--id={gpu}", "--query-gpu=" + ",".join(fields), "--format=csv,noheader"],
                                    capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if not ok:
                fields = FIELDS[:4]
            cmd = [exe, f"--id={gpu}", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits",
                   f"--loop-ms={int(period_ms)}"]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError:
            return cls(None)
        return cls(proc)

    def _read(self) -> None:
        for line in self.proc.stdout:
            s = parse_line(line)
            if s is not None:
                with self._lock:
                    self.samples.append((time.monotonic(), s))

    def window(self, t0: float, t1: float, before_s: float = 0.5) -> Optional[dict]:
        """A summary of the samples stamped in [t0, t1] (monotonic seconds); where none fell inside (a window shorter
        than the period), the last one stamped up to `before_s` before t1; else None."""
        with self._lock:
            got = [s for t, s in self.samples if t0 <= t <= t1]
            if not got:
                got = [s for t, s in self.samples if t1 - before_s <= t <= t1][-1:]
        if not got:
            return None
        sm = [s["sm_mhz"] for s in got]
        out = {"sm_mhz": round(statistics.median(sm)), "sm_mhz_min": round(min(sm)), "n": len(got)}
        for key, name, fn in (("mem_mhz", "mem_mhz", statistics.median), ("power_w", "power_w_max", max),
                              ("temp_c", "temp_c_max", max)):
            v = [s[key] for s in got if s[key] is not None]
            if v:
                out[name] = round(fn(v), 1)
        reasons = 0
        for s in got:
            reasons |= s["reasons"] or 0
        out["reasons"] = hex(reasons)
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)


def limits(gpu: int = 0) -> Optional[dict]:
    """The GPU's power limit and highest SM / memory clocks (one nvidia-smi call), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, f"--id={gpu}", "--query-gpu=power.limit,clocks.max.sm,clocks.max.mem",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = [_num(p.strip()) for p in r.stdout.strip().split(",")]
    if r.returncode != 0 or len(parts) != 3:
        return None
    return dict(zip(("power_limit_w", "sm_mhz_max", "mem_mhz_max"), parts))


def mhz(state: Optional[dict]) -> str:
    """A table cell for a window: "1980 (1755)" (median SM MHz, lowest), "–" without samples."""
    return "–" if not state else f"{state['sm_mhz']} ({state['sm_mhz_min']})"


# One log per process, started by the first script that asks (gemm.time_rotating reads it when it exists)
_LOG: list = []


def shared(start: bool = True) -> Optional[ClockLog]:
    """The process's clock log (started on the first call with start=True; None before that, or with no GPU)."""
    if not _LOG and start:
        _LOG.append(ClockLog.start())
        atexit.register(_LOG[0].stop)  # (a sampler outliving the process would also end at its next write: EPIPE)
    return _LOG[0] if _LOG else None
