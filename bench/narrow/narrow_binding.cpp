// Torch binding of the narrow-tile experiment (bench/narrow_tile.py builds it; not part of the sdquant extension).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "w4a16_narrow.h"

// y [m, n] = x [m, k] @ W^T over the narrow layout (qn [n/16, k/64, 32, 4] int32, sn fp16 / zn x.dtype [G, n/16, 8, 2])
torch::Tensor narrow(torch::Tensor x, torch::Tensor qn, torch::Tensor sn, torch::Tensor zn, int64_t variant,
                     int64_t pdl) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x: a contiguous CUDA [M, K] matrix");
  TORCH_CHECK(qn.dim() == 4 && qn.is_contiguous() && qn.size(2) == 32 && qn.size(3) == 4, "qn: [N/16, K/64, 32, 4]");
  TORCH_CHECK(sn.dim() == 4 && zn.dim() == 4 && sn.is_contiguous() && zn.is_contiguous(), "sn / zn: [G, N/16, 8, 2]");
  TORCH_CHECK(sn.scalar_type() == at::kHalf && zn.scalar_type() == x.scalar_type(), "sn fp16, zn x.dtype");
  const int64_t m = x.size(0), k = x.size(1), n = qn.size(0) * 16;
  TORCH_CHECK(qn.size(1) * 64 == k && sn.size(1) * 16 == n && k % sn.size(0) == 0, "K / N / groups of the layout");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({m, n}, x.options());
  SdqNarrowParams p{};
  p.a = x.data_ptr();
  p.b = qn.data_ptr();
  p.s = sn.data_ptr();
  p.z = zn.data_ptr();
  p.out = out.data_ptr();
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.group_k16 = static_cast<int>(k / sn.size(0) / 16);
  p.variant = static_cast<int>(variant);
  p.pdl = static_cast<int>(pdl);
  const int rc = sdq_narrow_launch(&p, x.scalar_type() == at::kBFloat16, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(rc == 0, "sdq_narrow_launch: ", rc == -1 ? "shape not supported" : cudaGetErrorString(static_cast<cudaError_t>(rc)));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("narrow", &narrow); }
