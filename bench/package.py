"""Benchmark: write and load an INT4 .sd2 package of a Llama-3-8B-shaped model, beside writing and loading
the bf16 safetensors file of the same model (the baseline, measured in the same run).

Shapes: hidden 4096, 32/8 heads (k/v out 1024), MLP 14336, vocab 128256, untied lm_head; linears INT4
group 128 asymmetric, embeddings / lm_head / norms bf16. Weights are random (the format does not care about
values); their generation time is measured and subtracted from the write times.

Every phase runs in its own subprocess, so its peak memory is its own: we report the peak RSS and the peak
*anonymous* RSS (private memory, sampled from /proc/self/status every 5 ms). Memory-mapped loads show up as
file-backed RSS (shared page cache the kernel can drop), not as anonymous memory.
"Warm" loads read from the page cache; "cold" loads first drop the file's cached pages with
posix_fadvise(DONTNEED) (no root needed; the files were fsynced).

    python bench/package.py --layers 8            # head-to-head (what docs/benchmarks/export.md records)
    python bench/package.py --layers 32 --skip-bf16   # full-depth package only
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

H, INTER, KV, VOCAB, GS = 4096, 14336, 1024, 128256, 128
LINEARS = [("self_attn.q_proj", H, H), ("self_attn.k_proj", KV, H), ("self_attn.v_proj", KV, H),
           ("self_attn.o_proj", H, H), ("mlp.gate_proj", INTER, H), ("mlp.up_proj", INTER, H),
           ("mlp.down_proj", H, INTER)]  # (name, N = out, K = in)


# ------------------------------------------------------------------------------------------ memory probe
class Probe:
    """Peak VmRSS / RssAnon of this process, sampled every 5 ms on a thread."""

    def __init__(self):
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        with open("/proc/self/status") as f:
            for line in f:
                k = line.split(":")[0]
                if k in self.peak:
                    self.peak[k] = max(self.peak[k], int(line.split()[1]) * 1024)

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.005)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self._t.join()
        self.sample()


# ------------------------------------------------------------------------------------------ model stream
class Gen:
    """Random tensors of the model, one at a time; accumulates the time spent generating them."""

    def __init__(self, layers: int):
        self.layers, self.gen_s = layers, 0.0
        self.g = torch.Generator().manual_seed(0)

    def _timed(self, fn):
        t = time.perf_counter()
        out = fn()
        self.gen_s += time.perf_counter() - t
        return out

    def float_specs(self):
        yield "model.embed_tokens.weight", (VOCAB, H)
        for i in range(self.layers):
            yield f"model.layers.{i}.input_layernorm.weight", (H,)
            yield f"model.layers.{i}.post_attention_layernorm.weight", (H,)
        yield "model.norm.weight", (H,)
        yield "lm_head.weight", (VOCAB, H)

    def floats(self):
        for name, shape in self.float_specs():
            yield name, self._timed(lambda: torch.randn(shape, generator=self.g, dtype=torch.bfloat16))

    def bf16_specs(self):
        """All tensors of the bf16 checkpoint (floats + linear weights) in file order."""
        yield from self.float_specs()
        for i in range(self.layers):
            for lin, n, k in LINEARS:
                yield f"model.layers.{i}.{lin}.weight", (n, k)

    def bf16_tensors(self):
        for name, shape in self.bf16_specs():
            yield name, self._timed(lambda: torch.randn(shape, generator=self.g, dtype=torch.bfloat16))

    def quant(self):
        from sdquant.quant.qtensor import QuantizedWeight
        for i in range(self.layers):
            for lin, n, k in LINEARS:
                def make():
                    g = k // GS
                    return QuantizedWeight(torch.randint(0, 256, (n, k // 2), generator=self.g, dtype=torch.uint8),
                                           (torch.rand(n, g, generator=self.g) * 0.01 + 1e-3).half(),
                                           torch.randint(0, 16, (n, g), generator=self.g, dtype=torch.uint8),
                                           4, GS, k)
                yield f"model.layers.{i}.{lin}", self._timed(make), None, None


# ------------------------------------------------------------------------------------------ phases
def write_bf16(path: Path, gen: Gen):
    """Streaming safetensors writer (header from shapes, then tensor bytes), so the baseline file can be
    made without holding the model in memory; fsynced like the .sd2 writer."""
    header, off = {}, 0
    for name, shape in gen.bf16_specs():
        nb = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in gen.bf16_tensors():
            f.write(memoryview(t.view(torch.uint8).numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def write_sd2_phase(path: Path, gen: Gen):
    from sdquant.export.sd2 import write_sd2
    write_sd2(path, family="llama", arch_config={"hidden_size": H, "intermediate_size": INTER,
                                                 "num_hidden_layers": gen.layers, "vocab_size": VOCAB},
              float_tensors=gen.floats(), quant_layers=gen.quant(), high_precision=["lm_head"],
              calibration={"method": "random (benchmark)"})


def touch(tensors) -> int:
    """Read one byte of every 4 kB page of every tensor: forces a lazily mapped file fully into memory."""
    total = 0
    for t in tensors:
        if t.numel():
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def drop_cache(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_phase(phase: str, path: Path, layers: int, cold: bool) -> dict:
    if cold:
        drop_cache(path)
    gen = Gen(layers)
    with Probe() as probe:
        t = time.perf_counter()
        if phase == "write_sd2":
            write_sd2_phase(path, gen)
        elif phase == "write_bf16":
            write_bf16(path, gen)
        elif phase.startswith("sd2_"):
            from sdquant.export.sd2 import open_sd2
            with open_sd2(path, verify="full" if phase.startswith("sd2_full") else "none") as pkg:
                ft, ql = pkg.float_tensors(), pkg.quant_layers()
                ts = list(ft.values()) + [t for w, _, _ in ql.values() for t in (w.qweight, w.scales, w.zeros)]
                if phase.endswith("_touch"):
                    touch(ts)
        elif phase.startswith("bf16_"):
            from safetensors.torch import load_file
            ts = list(load_file(str(path)).values())
            if phase.endswith("_touch"):
                touch(ts)
        else:
            raise SystemExit(f"unknown phase {phase}")
        wall = time.perf_counter() - t
    return {"phase": phase, "cold": cold, "seconds": wall - gen.gen_s, "gen_seconds": gen.gen_s,
            "peak_rss": probe.peak["VmRSS"], "peak_anon": probe.peak["RssAnon"],
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "file_bytes": path.stat().st_size}


def child(phase, path, layers, cold) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", phase, "--path", str(path), "--layers",
                          str(layers)] + (["--cold"] if cold else []), capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", default="runs/bench_package")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", default="runs/bench_package.json")
    ap.add_argument("--child")
    ap.add_argument("--path")
    ap.add_argument("--cold", action="store_true")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_phase(a.child, Path(a.path), a.layers, a.cold)))
        return
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    per_layer = sum(n * k for _, n, k in LINEARS)
    need = (0 if a.skip_bf16 else 2 * (per_layer * a.layers + 2 * VOCAB * H)) + per_layer * a.layers // 2 \
        + 4 * VOCAB * H
    free = shutil.disk_usage(d).free
    print(f"{a.layers} of 32 Llama-3-8B layers; need ~{need / 1e9:.1f} GB on disk, {free / 1e9:.1f} GB free")
    if need * 1.2 > free:
        raise SystemExit("not enough free disk: lower --layers")
    sd2, bf16 = d / "model.sd2", d / "model_bf16.safetensors"
    results = [child("write_sd2", sd2, a.layers, False)]
    if not a.skip_bf16:
        results.append(child("write_bf16", bf16, a.layers, False))
    loads = [("sd2_full_touch", sd2), ("sd2_open", sd2), ("sd2_open_touch", sd2)]
    loads += [] if a.skip_bf16 else [("bf16_open", bf16), ("bf16_open_touch", bf16)]
    for phase, path in loads:
        results.append(child(phase, path, a.layers, True))
        warm = [child(phase, path, a.layers, False) for _ in range(a.repeats)]
        med = dict(warm[0])
        for key in ("seconds", "peak_rss", "peak_anon", "ru_maxrss"):
            med[key] = statistics.median(w[key] for w in warm)
        med["runs"] = [w["seconds"] for w in warm]
        results.append(med)
    print(f"\n{'phase':<16} {'cache':<5} {'seconds':>8} {'peak RSS':>10} {'peak anon':>10} {'file':>9}")
    for r in results:
        cache = "" if r["phase"].startswith("write") else ("cold" if r["cold"] else "warm")
        print(f"{r['phase']:<16} {cache:<5} {r['seconds']:>8.2f} {r['peak_rss'] / 1e9:>8.2f}GB "
              f"{r['peak_anon'] / 1e9:>8.2f}GB {r['file_bytes'] / 1e9:>7.2f}GB")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"layers": a.layers, "results": results,
                                        "torch": torch.__version__, "cpus": os.cpu_count()}, indent=1))
    if not a.keep:
        for p in (sd2, bf16):
            p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
