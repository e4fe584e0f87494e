"""bench/ws_trace.py's host side: the point list and the per-phase statistics it makes of the warp-specialized
kernel's trace rows (32 u64 a CTA, slots as w4a16_wgmma.cuh lists them), on synthetic rows with known phases."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
ws_trace = pytest.importorskip("ws_trace")


def _row(g0_ns, mhz, init, first, loop, waiting, sync, total_sum, sm, stages=8, late=0.0, ages=(), waited_ages=(),
         pwait=0.0, late1=0.0):
    """A CTA's trace row from phase lengths in µs at an SM clock of `mhz` (cycles per µs); ``ages`` the late stages'
    request-to-use times, ``waited_ages`` those of the stages consumer 0 waited for."""
    c1 = 1_000_000
    c2 = c1 + int(init * mhz)
    c3 = c2 + int(first * mhz)
    c4 = c3 + int(loop * mhz)
    c5 = c4 + int(sync * mhz)
    c6 = c5 + int(total_sum * mhz)
    g7 = g0_ns + int((c6 - c1) / mhz * 1e3)
    head = [g0_ns, c1, c2, c3, c4, c5, c6, g7, sm, 0, 0, stages, int(waiting * mhz), c4, 0, 0, int(late * mhz)]
    tail = [int(sum(ages) * mhz), len(ages), int(sum(waited_ages) * mhz), len(waited_ages), int(pwait * mhz),
            int(late1 * mhz)]
    return head + tail + [0] * 9


def test_parse_points():
    assert ws_trace.parse_points("4096x4096x128,14336x4096x256:4") == [(4096, 4096, 128, 0), (14336, 4096, 256, 4)]


def test_analyse_recovers_the_phases():
    rows = [_row(5_000, 1800.0, 0.5, 1.5, 8.0, 2.0, 1.0, 2.0, sm=0, late=0.5, ages=(3.0, 4.0, 5.0),
                 waited_ages=(5.0,), pwait=1.5, late1=0.75),
            _row(7_000, 1800.0, 0.5, 2.5, 6.0, 1.0, 3.0, 2.0, sm=1, stages=7, late=0.25, ages=(2.0, 2.0)),
            [0] * 32]  # a CTA that never wrote its stamps
    got = ws_trace.analyse(rows, 3)
    assert got["ctas"] == 2 and got["missing"] == 1 and got["sms"] == 2
    assert got["stages"] == [7, 8]
    assert got["sm_mhz"] == pytest.approx(1800.0, rel=1e-3)
    assert got["skew"]["max"] == pytest.approx(2.0)           # the second CTA entered 2 µs after the first
    assert got["first"]["max"] == pytest.approx(2.5, abs=0.01)
    assert got["loop"]["med"] == pytest.approx(7.0, abs=0.01)  # median of 8 and 6
    assert got["waiting"]["max"] == pytest.approx(2.0, abs=0.01)
    assert got["late"]["max"] == pytest.approx(0.5, abs=0.01) and got["late"]["med"] == pytest.approx(0.375, abs=0.01)
    assert got["sync"]["max"] == pytest.approx(3.0, abs=0.01)
    assert got["age"]["max"] == pytest.approx(4.0, abs=0.01) and got["age"]["med"] == pytest.approx(3.0, abs=0.01)
    assert got["age_w"]["max"] == pytest.approx(5.0, abs=0.01)  # the second CTA waited for none: 0
    assert got["age_w"]["med"] == pytest.approx(2.5, abs=0.01)
    assert got["pwait"]["max"] == pytest.approx(1.5, abs=0.01) and got["late1"]["max"] == pytest.approx(0.75, abs=0.01)
    assert got["cta"]["max"] == pytest.approx(0.5 + 2.5 + 6.0 + 3.0 + 2.0, abs=0.02)  # the second CTA
    # first entry to last end: the second CTA ends at 2 + 14 µs
    assert got["span_us"] == pytest.approx(16.0, abs=0.01)
    assert "|" in ws_trace.line(got)


def test_analyse_reports_a_launch_without_stamps():
    assert ws_trace.analyse([[0] * 16, [0] * 16], 2) == {"missing": 2}


def test_analyse_reads_rows_of_older_builds():
    """Rows of 16 u64 (builds before slot 16, the steady-state waiting, existed) still analyse, with "late" 0."""
    row = _row(5_000, 1800.0, 0.5, 1.5, 8.0, 2.0, 1.0, 2.0, sm=0, late=0.5)[:16]
    got = ws_trace.analyse([row], 1)
    assert got["ctas"] == 1 and got["late"]["max"] == 0.0 and got["loop"]["max"] == pytest.approx(8.0, abs=0.01)
    assert got["age"]["max"] == 0.0 and got["pwait"]["max"] == 0.0
