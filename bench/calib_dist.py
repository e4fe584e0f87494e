"""Data-parallel calibration scaling: wall time of joint AWQ+GPTQ on a Llama-3-8B-shaped model (random
weights; hidden 4096, 32/8 heads, MLP 14336) with 1, 2, ... GPUs.

    torchrun --nproc-per-node 1 bench/calib_dist.py --layers 4 --out $OUT/dist1.json
    torchrun --nproc-per-node 2 bench/calib_dist.py --layers 4 --out $OUT/dist2.json
    python bench/calib_dist.py --tiny            # CPU smoke test (gloo when launched by torchrun)
    python bench/calib_dist.py --compare $OUT/dist1.json $OUT/dist2.json   # the scaling table

Only the decoder blocks are calibrated; fewer layers than 32 keep the device time small, and the per-block
time is what scales (the report extrapolates to 32 blocks and says so). Every rank must reach the same
weights: the script checks a hash of the quantized tensors across ranks.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    if args.tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=260)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=args.vocab,
                          max_position_embeddings=4096)
    torch.manual_seed(0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(dtype)
    # random weights with a realistic spread: N(0, 0.02) everywhere, norms at 1
    return model.eval()


def compare(paths):
    """Scaling table from the JSON reports of runs with 1, 2, ... GPUs (same model and data)."""
    reps = sorted((json.load(open(p)) for p in paths), key=lambda r: r["world"])
    base = reps[0]
    print("| GPUs | wall s | s / block | speed-up | scaling efficiency | same weights as 1 GPU |")
    print("|---|---|---|---|---|---|")
    for r in reps:
        sp = base["wall_s"] / r["wall_s"]
        print(f"| {r['world']} | {r['wall_s']:.1f} | {r['s_per_block']:.2f} | {sp:.2f}x | "
              f"{100 * sp * base['world'] / r['world']:.0f}% | {r['digest'] == base['digest']} |")


def main():
    import sys
    if len(sys.argv) > 2 and sys.argv[1] == "--compare":
        return compare(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--method", default="awq+gptq")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.samples, args.seq, args.batch = 8, 32, 2

    import sdquant
    from sdquant.calibrate import distributed
    from sdquant.config import load_config

    d = distributed.init_from_env("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config(None, {"model.kind": "builtin", "model.name": "bench", "quant.method": args.method,
                             "quant.group_size": 128 if not args.tiny else 32, "device": device,
                             "dtype": "bfloat16" if not args.tiny else "float32",
                             "pipeline.batch_size": args.batch})
    ids = torch.randint(0, model.config.vocab_size, (args.samples, args.seq),
                        generator=torch.Generator().manual_seed(0))
    d.barrier()
    t0 = time.perf_counter()
    res = sdquant.calibrate(model, cfg, ids)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    d.barrier()
    wall = time.perf_counter() - t0
    h = hashlib.sha256()
    for n in sorted(res.weights):
        h.update(res.weights[n].qweight.cpu().numpy().tobytes())
        h.update(res.weights[n].scales.cpu().numpy().tobytes())
    digests = [None] * d.world
    if d.active:
        import torch.distributed as tdist
        tdist.all_gather_object(digests, h.hexdigest())
    else:
        digests = [h.hexdigest()]
    n_blocks = model.config.num_hidden_layers
    phase = {"forward_s": 0.0, "awq_s": 0.0, "gptq_s": 0.0}
    for k, v in res.scales.items():
        if k.endswith("forward_seconds"):
            phase["forward_s"] += float(v)
    for row in res.rows:
        phase["awq_s"] += float(row.get("awq_seconds", 0.0))
        phase["gptq_s"] += float(row.get("gptq_seconds", 0.0))
    rep = {"world": d.world, "digest": h.hexdigest(), "phases_rank0": phase, "layers": n_blocks, "samples": args.samples, "seq": args.seq, "method": args.method,
           "wall_s": wall, "s_per_block": wall / n_blocks, "extrapolated_32_blocks_s": wall / n_blocks * 32,
           "ranks_identical": len(set(digests)) == 1,
           "peak_gpu_gb": (res.peak_device_bytes / 2**30) if torch.cuda.is_available() else None,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if d.is_main:
        print(json.dumps(rep))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rep, f, indent=1)
    if d.active:
        import torch.distributed as tdist
        tdist.destroy_process_group()


if __name__ == "__main__":
    main()
