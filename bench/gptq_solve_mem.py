"""bench: peak RSS of one GPTQ solve of the 70B fused gate/up shape (57344 x 8192, g128, static act-order, MSE grid)
on CPU, with the current uint8 pack/unpack or the previous int64 one (argv[1] = new|old; "old" swaps only
pack/unpack). Recorded in bench/results/gptq_solve_mem_cpu_70b_gateup.log: the first two lines were run with
the earlier QuantizedWeight.dequantize, the third after it broadcast its parameters in place.

    python bench/gptq_solve_mem.py new        # ~5 min and ~7 GB RSS on 2 cores
"""
import resource, sys, time, torch
from sdquant.quant import qtensor
from sdquant.calibrate import gptq

def old_pack(codes, bits):
    n, k = codes.shape
    c = codes.to(torch.int64)
    per = 8 // bits
    c = c.view(n, k // per, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return (c << shifts).sum(-1).to(torch.uint8)

def old_unpack(packed, bits, in_features):
    n = packed.shape[0]
    p = packed.to(torch.int64)
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(n, -1)[:, :in_features].to(torch.uint8)

if sys.argv[1] == "old":
    qtensor.pack_codes, qtensor.unpack_codes = old_pack, old_unpack
torch.manual_seed(0)
n, k = 57344, 8192
W = torch.randn(n, k) * 0.02
x = torch.randn(2048, k)
H, _ = gptq.accumulate_hessian(None, x, 0)
del x
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
qw, st = gptq.gptq_quantize(W, H, 4, 128, False, act_order="static", mse_grid=10, overwrite_h=True)
print(sys.argv[1], "solve extra peak RSS GB", round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20, 2),
      "| inputs W+H GB", round((W.numel() + k * k) * 4 / 2**30, 2), "| s", round(time.perf_counter() - t, 1), "| loss/rtn", round(st.loss / st.rtn_loss, 3), flush=True)
