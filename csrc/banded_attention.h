// Banded (local) self-attention: shared declarations of the CPU and CUDA kernels.
//
// Query i of head h attends to keys j with i - left[h] <= j <= i + right[h], 0 <= j < T, that
// are not padding; the softmax is renormalised over those keys. Band layout: column c of a
// (B, H, T, W) band tensor, W = max(left) + max(right) + 1, is key j = i - max(left) + c.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace local_attn {

// One validated call: sizes, windows and the raw pointers of the optional masks.
struct BandProblem {
  int64_t batch = 0, heads = 0, length = 0, dim = 0;
  std::vector<int64_t> left, right;  // per head
  int64_t max_left = 0, max_right = 0;
  double scale = 1.0;
  // Factor applied to kept attention weights: 1 / (1 - p), or 0 when p == 1 (all dropped).
  double keep_scale = 1.0;
  const bool* key_padding = nullptr;  // (B, T), true = padded key; null = no padding
  const bool* keep = nullptr;         // (B, H, T, W) dropout keep-mask; null = no dropout

  int64_t width() const { return max_left + max_right + 1; }
  int64_t batch_heads() const { return batch * heads; }
};

// Checks shapes, dtypes and devices (TORCH_CHECK with a message naming the argument) and fills
// a BandProblem whose mask pointers point into `padding` and `keep`: contiguous bool tensors
// from contiguous_mask (or undefined), which the caller keeps alive while the kernels run.
BandProblem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         at::IntArrayRef left, at::IntArrayRef right, const at::Tensor& padding,
                         const at::Tensor& keep, double scale, double dropout_p);

// A contiguous bool copy of an optional mask (undefined when absent).
at::Tensor contiguous_mask(const c10::optional<at::Tensor>& mask);

// dtype of the row log-sum-exp: float32, or float64 for float64 inputs.
at::ScalarType lse_dtype(at::ScalarType input);

// Which copy of the CPU block kernels runs here: "avx2" or "baseline" (set
// LOCAL_ATTN_CPU_ISA=baseline to force the portable one).
const char* cpu_isa_name();

// CPU kernels (banded_attention_cpu.cpp). acc_t is float, or double for double inputs.
// dk_acc and dv_acc must be zero-filled (B, H, T, D) accumulators.
template <typename scalar_t, typename acc_t>
void forward_cpu(const BandProblem& pb, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                 scalar_t* out, acc_t* lse);

template <typename scalar_t, typename acc_t>
void backward_cpu(const BandProblem& pb, const scalar_t* grad_out, const scalar_t* q,
                  const scalar_t* k, const scalar_t* v, const scalar_t* out, const acc_t* lse,
                  scalar_t* dq, acc_t* dk_acc, acc_t* dv_acc);

}  // namespace local_attn
