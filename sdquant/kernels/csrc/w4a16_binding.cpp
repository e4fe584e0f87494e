// Torch binding of the sm_90 W4A16 kernel (built by sdquant/kernels/int4_cuda.py on first use).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "w4a16.h"

namespace {

constexpr int64_t kMaxRows = 32;        // rows per launch (4 token tiles of 8)
constexpr int64_t kMaxRowsWgmma = 256;  // variants 62-63 (the wgmma kernel): 4 token tiles of 64

// The checks both GEMM entries share (the activations and the CUDA layout); `op` names the entry in the message
void check_layout_args(const char* op, const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                       const torch::Tensor& zeros, const torch::Tensor& locks) {
  TORCH_CHECK(x.is_cuda() && qweight.is_cuda() && scales.is_cuda() && zeros.is_cuda() && locks.is_cuda(), op,
              ": all tensors must be on a CUDA device");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op, ": x must be float16 or bfloat16");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == x.scalar_type(), op,
              ": scales must be float16 and zeros of x's dtype");
  TORCH_CHECK(scales.is_contiguous() && zeros.is_contiguous() && scales.sizes() == zeros.sizes(), op,
              ": scales/zeros must be contiguous [G, N/64, 8, 8]");
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 4 && qweight.size(2) == 32 &&
                  qweight.size(3) == 4 && qweight.is_contiguous(),
              op, ": qweight must be int32 [N/64, K/16, 32, 4]");
  TORCH_CHECK(locks.scalar_type() == at::kInt, op, ": locks must be int32");
  const int64_t k = x.size(1), n = qweight.size(0) * 64, g = scales.size(0);
  TORCH_CHECK(qweight.size(1) * 16 == k, op, ": x has K=", k, " but qweight holds K=", qweight.size(1) * 16);
  TORCH_CHECK(g > 0 && k % (16 * g) == 0, op, ": ", g, " groups do not divide K=", k);
  TORCH_CHECK(locks.numel() >= std::max<int64_t>(n / 64, SDQ_LOCKS_MIN), op, ": locks too small (need max(N/64, ",
              SDQ_LOCKS_MIN, ") ints: int4_layout.repack_cuda's)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, op, ": x must be 16-byte aligned");
}

// The fields every entry sets from its layout: a / c point at the launch's first row of x / out, m rows of them
void set_layout(SdqW4A16Params& p, const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                const torch::Tensor& zeros, const void* a, void* c, int64_t m) {
  const int64_t k = x.size(1);
  p.a = a;
  p.b = qweight.data_ptr();
  p.s = scales.data_ptr();
  p.zs = zeros.data_ptr();
  p.c = c;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(qweight.size(0) * 64);
  p.k = static_cast<int>(k);
  p.group_k16 = static_cast<int>(k / 16 / scales.size(0));
  p.is_bf16 = x.scalar_type() == at::kBFloat16;
}

torch::Tensor w4a16(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                    torch::Tensor locks, int64_t splits, bool evict_first, int64_t variant, int64_t target2,
                    int64_t pdl, int64_t xs, c10::optional<torch::Tensor> out_opt) {
  check_layout_args("w4a16_cuda", x, qweight, scales, zeros, locks);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0) * 64, g = scales.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  // out: where the caller wants y (e.g. a row slice of a larger output, so a split launch needs no concatenation)
  if (out_opt.has_value()) {
    const auto& o = *out_opt;
    TORCH_CHECK(o.is_cuda() && o.device() == x.device() && o.scalar_type() == x.scalar_type() && o.dim() == 2 &&
                    o.size(0) == m && o.size(1) == n && o.is_contiguous() &&
                    reinterpret_cast<uintptr_t>(o.data_ptr()) % 16 == 0,
                "w4a16_cuda: out must be a contiguous, 16-byte aligned [", m, ", ", n, "] tensor of x's dtype and device");
  }
  auto out = out_opt.has_value() ? *out_opt : at::empty({m, n}, x.options());
  if (m == 0) return out;
  const int group_k16 = static_cast<int>(k / 16 / g);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool wgmma = variant == 62 || variant == 63;
  int64_t max_rows = wgmma ? kMaxRowsWgmma : kMaxRows;
  if (wgmma && m > kMaxRowsWgmma) {  // 256 rows a launch, or all of them where the launcher says (wgmma_rows)
    SdqW4A16Params q{};
    set_layout(q, x, qweight, scales, zeros, x.data_ptr(), nullptr, std::min<int64_t>(m, INT32_MAX / 2));
    q.variant = static_cast<int>(variant);
    max_rows = sdq_w4a16_launch_rows(&q);
  }
  for (int64_t r0 = 0; r0 < m; r0 += max_rows) {
    const int rows = static_cast<int>(std::min(max_rows, m - r0));
    int sp = splits > 0 ? static_cast<int>(splits)
                        : sdq_w4a16_auto_splits(rows, static_cast<int>(n), static_cast<int>(k), group_k16,
                                                x.scalar_type() == at::kBFloat16, static_cast<int>(variant),
                                                static_cast<int>(target2));
    SdqW4A16Params p{};
    set_layout(p, x, qweight, scales, zeros, static_cast<const char*>(x.data_ptr()) + r0 * k * x.element_size(),
               static_cast<char*>(out.data_ptr()) + r0 * n * out.element_size(), rows);
    p.locks = locks.data_ptr<int>();
    p.splits = sp;
    p.evict_first = evict_first ? 1 : 0;
    p.variant = static_cast<int>(variant);
    p.pdl = static_cast<int>(pdl);
    p.xs = static_cast<int>(xs);
    const long long scratch = sdq_w4a16_scratch_floats(&p);  // split-K or stream-K partials
    at::Tensor partial;
    if (scratch > 0) partial = at::empty({scratch}, x.options().dtype(at::kFloat));
    p.partial = scratch > 0 ? partial.data_ptr<float>() : nullptr;
    const int rc = sdq_w4a16_launch(&p, stream);
    TORCH_CHECK(rc == 0, "w4a16_cuda: launch failed (code ", rc, ": ",
                rc > 0 ? cudaGetErrorString(static_cast<cudaError_t>(rc)) : "unsupported shape", ")");
  }
  return out;
}

// The tight kernel with the fused decode-block prologue / epilogue (w4a16.h, SdqW4A16FusedParams): one launch, m <= 8.
// Returns (out, out2, ss_out): out [m, n] or [m, n/2] with silu; out2 = out * gamma and ss_out [m, n_out/64] fp32 (the
// sums of squares of out's 64-column blocks) when gamma is given, else empty.
std::vector<torch::Tensor> w4a16_fused(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                                       torch::Tensor zeros, torch::Tensor locks, int64_t variant, int64_t target2,
                                       int64_t pdl, c10::optional<torch::Tensor> rms_ss, double rms_eps, bool silu,
                                       c10::optional<torch::Tensor> resid, c10::optional<torch::Tensor> gamma,
                                       c10::optional<torch::Tensor> kv, c10::optional<torch::Tensor> pos,
                                       c10::optional<torch::Tensor> cos, c10::optional<torch::Tensor> sin,
                                       int64_t rope_q) {
  check_layout_args("w4a16_fused", x, qweight, scales, zeros, locks);
  const int64_t m = x.size(0), n = qweight.size(0) * 64;
  TORCH_CHECK(m >= 1 && m <= 8, "w4a16_fused: M=", m, " (the fused kernel takes 1..8 rows)");
  const int64_t n_out = silu ? n / 2 : n;
  if (rms_ss)
    TORCH_CHECK(rms_ss->is_cuda() && rms_ss->scalar_type() == at::kFloat && rms_ss->is_contiguous() &&
                    rms_ss->dim() == 2 && rms_ss->size(0) == m && rms_ss->size(1) >= 1 && rms_ss->size(1) <= 256,
                "w4a16_fused: rms_ss must be a contiguous float32 [", m, ", T] tensor, 1 <= T <= 256");
  if (resid)
    TORCH_CHECK(resid->is_cuda() && resid->scalar_type() == x.scalar_type() && resid->is_contiguous() &&
                    resid->dim() == 2 && resid->size(0) == m && resid->size(1) == n_out &&
                    reinterpret_cast<uintptr_t>(resid->data_ptr()) % 4 == 0,
                "w4a16_fused: resid must be a contiguous [", m, ", ", n_out, "] tensor of x's dtype");
  if (gamma)
    TORCH_CHECK(gamma->is_cuda() && gamma->scalar_type() == x.scalar_type() && gamma->is_contiguous() &&
                    gamma->numel() == n_out && reinterpret_cast<uintptr_t>(gamma->data_ptr()) % 4 == 0,
                "w4a16_fused: gamma must be a contiguous [", n_out, "] vector of x's dtype");
  if (kv) {  // the RoPE / KV-cache epilogue (w4a16.h): a decode step's qkv projection, 128-feature heads
    TORCH_CHECK(!silu && !resid && !gamma && pos && cos && sin,
                "w4a16_fused: the RoPE epilogue takes rms_ss only, with pos, cos and sin");
    TORCH_CHECK(kv->is_cuda() && kv->scalar_type() == x.scalar_type() && kv->dim() == 5 && kv->size(0) == 2 &&
                    kv->size(1) >= m && kv->size(4) == 128 && kv->stride(4) == 1 &&
                    rope_q % 128 == 0 && rope_q + 2 * kv->size(2) * 128 == n,
                "w4a16_fused: kv must be a [2, B >= ", m, ", nkv, T, 128] cache of x's dtype with q columns (", rope_q,
                ") + 2 nkv * 128 = ", n);
    TORCH_CHECK(pos->is_cuda() && pos->scalar_type() == at::kLong && pos->numel() == 1,
                "w4a16_fused: pos must be one int64 position on the GPU");
    for (const auto* t : {&*cos, &*sin})
      TORCH_CHECK(t->is_cuda() && t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->numel() == 128 &&
                      reinterpret_cast<uintptr_t>(t->data_ptr()) % 4 == 0,
                  "w4a16_fused: cos and sin must be 128 contiguous values of x's dtype");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({m, n_out}, x.options());
  auto out2 = gamma ? at::empty({m, n_out}, x.options()) : at::empty({0}, x.options());
  auto ss_out = gamma ? at::empty({m, n_out / 64}, x.options().dtype(at::kFloat)) : at::empty({0}, x.options().dtype(at::kFloat));
  SdqW4A16FusedParams p{};
  set_layout(p, x, qweight, scales, zeros, x.data_ptr(), out.data_ptr(), m);
  p.locks = locks.data_ptr<int>();
  p.variant = static_cast<int>(variant);
  p.pdl = static_cast<int>(pdl);
  p.splits = sdq_w4a16_auto_splits(p.m, p.n, p.k, p.group_k16, p.is_bf16, p.variant, static_cast<int>(target2));
  p.rms_ss = rms_ss ? rms_ss->data_ptr<float>() : nullptr;
  p.rms_t = rms_ss ? static_cast<int>(rms_ss->size(1)) : 0;
  p.rms_eps = static_cast<float>(rms_eps);
  p.silu = silu ? 1 : 0;
  p.resid = resid ? resid->data_ptr() : nullptr;
  p.gamma = gamma ? gamma->data_ptr() : nullptr;
  p.c2 = gamma ? out2.data_ptr() : nullptr;
  p.ss_out = gamma ? ss_out.data_ptr<float>() : nullptr;
  if (kv) {
    p.kv = kv->data_ptr();
    p.pos = reinterpret_cast<const long long*>(pos->data_ptr<int64_t>());
    p.cos = cos->data_ptr();
    p.sin = sin->data_ptr();
    p.rope_q = static_cast<int>(rope_q);
    p.rope_kv = static_cast<int>(kv->size(2) * 128);
    p.kv_sk = kv->stride(0);
    p.kv_sb = kv->stride(1);
    p.kv_sh = kv->stride(2);
    p.kv_st = kv->stride(3);
  }
  const long long scratch = p.splits > 1 ? static_cast<long long>(p.splits) * m * n : 0;
  at::Tensor partial;
  if (scratch > 0) partial = at::empty({scratch}, x.options().dtype(at::kFloat));
  p.partial = scratch > 0 ? partial.data_ptr<float>() : nullptr;
  const int rc = sdq_w4a16_launch_fused(&p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(rc == 0, "w4a16_fused: launch failed (code ", rc, ": ",
              rc > 0 ? cudaGetErrorString(static_cast<cudaError_t>(rc)) : "variant, group or shape not supported", ")");
  return {out, out2, ss_out};
}

int64_t auto_splits(int64_t m, int64_t n, int64_t k, int64_t group_k16, bool is_bf16, int64_t variant,
                    int64_t target2) {
  return sdq_w4a16_auto_splits(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                               static_cast<int>(group_k16), is_bf16 ? 1 : 0, static_cast<int>(variant),
                               static_cast<int>(target2));
}

int64_t occupancy(int64_t m, int64_t group_k16, bool is_bf16, int64_t variant) {
  return sdq_w4a16_occupancy(static_cast<int>(m), static_cast<int>(group_k16), is_bf16 ? 1 : 0,
                             static_cast<int>(variant));
}

// A parameter block with only the shape fields set (for the launcher's queries)
SdqW4A16Params shape_params(int64_t m, int64_t n, int64_t k, int64_t group_k16, bool is_bf16, int64_t variant) {
  SdqW4A16Params q{};
  q.m = static_cast<int>(m);
  q.n = static_cast<int>(n);
  q.k = static_cast<int>(k);
  q.group_k16 = static_cast<int>(group_k16);
  q.is_bf16 = is_bf16 ? 1 : 0;
  q.variant = static_cast<int>(variant);
  return q;
}

int64_t launch_rows(int64_t m, int64_t n, int64_t k, int64_t group_k16, bool is_bf16, int64_t variant) {
  const SdqW4A16Params q = shape_params(m, n, k, group_k16, is_bf16, variant);
  return sdq_w4a16_launch_rows(&q);
}

int64_t wg_path(int64_t m, int64_t n, int64_t k, int64_t group_k16, bool is_bf16, int64_t variant, int64_t splits) {
  SdqW4A16Params q = shape_params(m, n, k, group_k16, is_bf16, variant);
  q.splits = splits > 0 ? static_cast<int>(splits)
                        : sdq_w4a16_auto_splits(q.m, q.n, q.k, q.group_k16, q.is_bf16, q.variant, 0);
  return sdq_w4a16_wg_path(&q);
}

int64_t wg_max_clusters(int64_t size, bool is_bf16) {
  return sdq_w4a16_wg_max_clusters(static_cast<int>(size), is_bf16 ? 1 : 0);
}

// Read-bandwidth probe (w4a16.h): times like a GEMM call over the same layout, computes nothing useful.
torch::Tensor read_probe(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                         int64_t kind, int64_t ctas) {
  TORCH_CHECK(x.is_cuda() && qweight.is_cuda() && x.dim() == 2 && x.is_contiguous(), "read_probe: bad inputs");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({1, 1}, x.options());
  SdqW4A16Params p{};
  set_layout(p, x, qweight, scales, zeros, x.data_ptr(), out.data_ptr(), x.size(0));
  p.splits = 1;
  const int rc = sdq_w4a16_probe(&p, static_cast<int>(kind), static_cast<int>(ctas), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(rc == 0, "read_probe: launch failed (code ", rc, ")");
  return out;
}

int64_t set_wg_schedule(int64_t mode) { return sdq_w4a16_set_wg_schedule(static_cast<int>(mode)); }

int64_t set_wg_rows(int64_t rows) { return sdq_w4a16_set_wg_rows(static_cast<int>(rows)); }

int64_t set_wg_one_launch_k(int64_t k_max) { return sdq_w4a16_set_wg_one_launch_k(static_cast<int>(k_max)); }

int64_t set_wg_cluster(int64_t on) { return sdq_w4a16_set_wg_cluster(static_cast<int>(on)); }

int64_t set_wg_cluster_rows(int64_t rows) { return sdq_w4a16_set_wg_cluster_rows(static_cast<int>(rows)); }

int64_t set_wg_wave_splits(int64_t on) { return sdq_w4a16_set_wg_wave_splits(static_cast<int>(on)); }

int64_t set_wg_wave_cost(int64_t stages) { return sdq_w4a16_set_wg_wave_cost(static_cast<int>(stages)); }

int64_t set_wg_sk_big(int64_t on) { return sdq_w4a16_set_wg_sk_big(static_cast<int>(on)); }

int64_t set_wg_two(int64_t mode) { return sdq_w4a16_set_wg_two(static_cast<int>(mode)); }

// the warp-specialized kernel's phase trace: a device buffer's address (0 = off) for a -DSDQ_WS_TRACE=1 build's launches
// (bench/ws_trace.py); returns whether this build writes it
int64_t set_ws_trace(int64_t ptr) {
  sdq_w4a16_set_ws_trace(reinterpret_cast<void*>(static_cast<intptr_t>(ptr)));
  return sdq_w4a16_ws_trace_built();
}

int64_t probe_evict_first() { return sdq_probe_evict_first(at::cuda::getCurrentCUDAStream()); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("w4a16", &w4a16, "W4A16 GEMM over the fragment layout (sm_90)", py::arg("x"), py::arg("qweight"),
          py::arg("scales"), py::arg("zeros"), py::arg("locks"), py::arg("splits"), py::arg("evict_first"),
          py::arg("variant"), py::arg("target2"), py::arg("pdl"), py::arg("xs"), py::arg("out") = py::none());
  mod.def("w4a16_fused", &w4a16_fused, "the tight W4A16 kernel with the fused RMSNorm / SiLU / residual ends (sm_90)");
  mod.def("auto_splits", &auto_splits, "split-K factor the launcher picks for a shape, variant and CTA target");
  mod.def("occupancy", &occupancy, "resident CTAs per SM of a variant's kernel");
  mod.def("wg_path", &wg_path, "the wgmma kernel's path at this shape (0 split, 1 stream, 2 ws, 3 ws + cluster sum, 4 ws stream-K)");
  mod.def("wg_max_clusters", &wg_max_clusters, "clusters of that many warp-specialized CTAs resident at once");
  mod.def("launch_rows", &launch_rows, "rows a launch of a variant takes at this M (larger M: several launches)");
  mod.def("read_probe", &read_probe, "read-bandwidth probe over the fragment layout (kind 0 linear, 1-3 stream-K loads)");
  mod.def("set_wg_schedule", &set_wg_schedule,
          "the wgmma kernel's 128-token tile from now on (0 auto, 1 split-K, 2 stream-K, 3 warp-specialized split-K, "
          "4 warp-specialized stream-K); "
          "returns the old");
  mod.def("set_wg_rows", &set_wg_rows,
          "rows a launch of the wgmma kernel takes from now on (0 automatic, 256 always 256); returns the old");
  mod.def("set_wg_one_launch_k", &set_wg_one_launch_k,
          "K up to which M > 256 runs in one launch whatever the fill test says (4096 default, 0 off); returns the old");
  mod.def("set_wg_cluster", &set_wg_cluster,
          "the warp-specialized split-K sums its splits in a cluster (1) or by a second kernel (0); returns the old");
  mod.def("set_wg_cluster_rows", &set_wg_cluster_rows,
          "the fewest rows the cluster sum takes at the 128-token tile (65 default, 65-257); returns the old");
  mod.def("set_wg_wave_splits", &set_wg_wave_splits,
          "the one-launch path at M > 256 splits in two where the waves gain (1) or not (0); returns the old");
  mod.def("set_wg_wave_cost", &set_wg_wave_cost,
          "the wave splits' cluster-sum cost in 128-K stages (0: the fill rule alone); returns the old");
  mod.def("set_wg_sk_big", &set_wg_sk_big,
          "M > 256 runs stream-K where the one launch's waves leave enough idle (1) or never (0); returns the old");
  mod.def("set_wg_two", &set_wg_two,
          "two warpgroups at the 32- and 64-token tiles: 1 where the rule says, 0 never, 2 always; returns the old");
  mod.def("set_ws_trace", &set_ws_trace,
          "trace buffer address for the warp-specialized kernel (0 off); returns 1 in a -DSDQ_WS_TRACE=1 build");
  mod.def("probe_evict_first", &probe_evict_first, "0 if cp.async with an L2 evict-first policy runs here");
}
