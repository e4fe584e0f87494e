// Torch binding of the batch-1 MLP experiment (bench/mlp_fused.py builds it; not part of the sdquant extension).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "w4a16_mlp.h"

// y [m, n2] = down(silu(gate(x)) * up(x)) over two repack_cuda layouts (gate/up blocks alternating); partial: fp32
// scratch of at least n1 / 128 * m * n2 floats
// sum_v: 0 / 1 (the sum kernel's two forms); pdl: programmatic dependent launch; what: 3 both kernels, 1 the MLP
// kernel, 2 the sum kernel only (timing breakdown; with 1 or 2 the output is not complete)
torch::Tensor mlp(torch::Tensor x, torch::Tensor b1, torch::Tensor s1, torch::Tensor z1, torch::Tensor b2,
                  torch::Tensor s2, torch::Tensor z2, torch::Tensor partial, int64_t sum_v, bool pdl,
                  int64_t what) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x: a contiguous CUDA [M, K] matrix");
  TORCH_CHECK(b1.dim() == 4 && b2.dim() == 4 && b1.is_contiguous() && b2.is_contiguous(), "qweights: [N/64, K/16, 32, 4]");
  TORCH_CHECK(partial.scalar_type() == at::kFloat, "partial: fp32");
  const int64_t m = x.size(0), k1 = x.size(1), n1 = b1.size(0) * 64, n2 = b2.size(0) * 64;
  TORCH_CHECK(b1.size(1) * 16 == k1 && b2.size(1) * 16 == n1 / 2, "K of the layouts");
  TORCH_CHECK(partial.numel() >= n1 / 128 * m * n2, "partial too small");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({m, n2}, x.options());
  SdqMlpParams p{};
  p.x = x.data_ptr();
  p.b1 = b1.data_ptr(); p.s1 = s1.data_ptr(); p.z1 = z1.data_ptr();
  p.b2 = b2.data_ptr(); p.s2 = s2.data_ptr(); p.z2 = z2.data_ptr();
  p.partial = partial.data_ptr<float>();
  p.out = out.data_ptr();
  p.m = static_cast<int>(m); p.k1 = static_cast<int>(k1); p.n1 = static_cast<int>(n1); p.n2 = static_cast<int>(n2);
  p.g1_k16 = static_cast<int>(k1 / 16 / s1.size(0));
  p.g2_k16 = static_cast<int>(n1 / 2 / 16 / s2.size(0));
  p.sum_v = static_cast<int>(sum_v);
  p.pdl = pdl ? 1 : 0;
  p.what = static_cast<int>(what);
  const int rc = sdq_mlp_launch(&p, x.scalar_type() == at::kBFloat16, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(rc == 0, "sdq_mlp_launch: ", rc == -1 ? "shape not supported" : cudaGetErrorString(static_cast<cudaError_t>(rc)));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("mlp", &mlp); }
