// CUDA kernels of the banded attention (float32, float16, bfloat16 and float64 inputs; float
// accumulation, double for double).
//
// A thread block handles kWarps consecutive queries (or keys, for dk/dv), one warp each, with
// the head dim spread over the lanes. The block walks through the union of its rows' bands in
// tiles: each tile of K and V (or Q and dO) is loaded into shared memory once and read by every
// warp of the block. Forward uses an online softmax, so one pass gives the output and the
// row log-sum-exp; backward recomputes the weights from the log-sum-exp, in one kernel for dq
// (which also stores dO . out per row) and one, key-centred, for dk and dv: no atomics.
#include "banded_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
// c10's stream and guard headers only: ATen/cuda/CUDAContext.h pulls in cuBLAS and cuSPARSE
// headers, which a minimal CUDA toolkit does not ship.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace local_attn {
namespace {

constexpr int kWarps = 8;           // rows (queries or keys) per thread block
constexpr int kThreads = kWarps * 32;
constexpr int kMaxDimPerLane = 8;   // head dim <= 256
constexpr int kTileBytes = 32 * 1024;

// Raw view of one call, passed to the kernels by value.
struct BandArgs {
  int64_t heads, length, dim, width, max_left;
  const int64_t* left;   // (H,) on the device
  const int64_t* right;  // (H,) on the device
  const bool* key_padding;
  const bool* keep;
  float keep_scale;
  double scale;
};

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

__device__ __forceinline__ bool key_padded(const BandArgs& a, int64_t batch, int64_t j) {
  return a.key_padding != nullptr && a.key_padding[batch * a.length + j];
}

// Dropout multiplier of key j for query i of (batch, head) bh.
template <typename acc_t>
__device__ __forceinline__ acc_t keep_factor(const BandArgs& a, int64_t bh, int64_t i,
                                             int64_t j) {
  if (a.keep == nullptr) return acc_t(1);
  const int64_t column = j - i + a.max_left;
  return a.keep[(bh * a.length + i) * a.width + column] ? acc_t(a.keep_scale) : acc_t(0);
}

// Rows [first, first + count) of a (length, dim) matrix into shared memory as acc_t.
template <typename scalar_t, typename acc_t>
__device__ void load_tile(const scalar_t* src, int64_t first, int64_t count, int64_t dim,
                          acc_t* tile) {
  for (int64_t e = threadIdx.x; e < count * dim; e += blockDim.x) {
    tile[e] = static_cast<acc_t>(src[first * dim + e]);
  }
}

// This lane's share of a row: elements lane, lane + 32, ...
template <typename acc_t, int kPerLane>
struct LaneRow {
  acc_t x[kPerLane];

  template <typename scalar_t>
  __device__ void load(const scalar_t* row, int64_t dim) {
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int64_t d = threadIdx.x % 32 + 32 * r;
      x[r] = d < dim ? static_cast<acc_t>(row[d]) : acc_t(0);
    }
  }

  __device__ void fill(acc_t value) {
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) x[r] = value;
  }

  __device__ acc_t dot(const acc_t* row, int64_t dim) const {
    acc_t partial = 0;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int64_t d = threadIdx.x % 32 + 32 * r;
      if (d < dim) partial += x[r] * row[d];
    }
    return warp_sum(partial);
  }

  __device__ void add_scaled(acc_t factor, const acc_t* row, int64_t dim) {
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int64_t d = threadIdx.x % 32 + 32 * r;
      if (d < dim) x[r] += factor * row[d];
    }
  }

  template <typename scalar_t>
  __device__ void store(scalar_t* row, int64_t dim, acc_t factor) const {
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int64_t d = threadIdx.x % 32 + 32 * r;
      if (d < dim) row[d] = static_cast<scalar_t>(x[r] * factor);
    }
  }
};

// Block geometry: which (batch * head) and which rows this block owns.
struct BlockRows {
  int64_t bh, first, row;
  bool active;
};

__device__ BlockRows block_rows(int64_t length) {
  const int64_t tiles = (length + kWarps - 1) / kWarps;
  BlockRows r;
  r.bh = blockIdx.x / tiles;
  r.first = (blockIdx.x % tiles) * kWarps;
  r.row = r.first + threadIdx.x / 32;
  r.active = r.row < length;
  return r;
}

template <typename scalar_t, typename acc_t, int kPerLane>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(BandArgs a, const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                   const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                   acc_t* __restrict__ lse, int64_t tile_rows) {
  extern __shared__ unsigned char shared_bytes[];
  acc_t* k_tile = reinterpret_cast<acc_t*>(shared_bytes);
  acc_t* v_tile = k_tile + tile_rows * a.dim;
  const BlockRows br = block_rows(a.length);
  const int64_t h = br.bh % a.heads, batch = br.bh / a.heads, base = br.bh * a.length * a.dim;
  const int64_t left = a.left[h], right = a.right[h], i = br.row;
  const int64_t last = min(br.first + kWarps, a.length) - 1;
  const int64_t keys_begin = max(int64_t(0), br.first - left);
  const int64_t keys_end = min(a.length, last + right + 1);
  const acc_t scale = acc_t(a.scale), neg_inf = -INFINITY;

  LaneRow<acc_t, kPerLane> query, acc;
  if (br.active) query.load(q + base + i * a.dim, a.dim);
  acc.fill(acc_t(0));
  acc_t row_max = neg_inf, total = 0;
  for (int64_t tile = keys_begin; tile < keys_end; tile += tile_rows) {
    const int64_t count = min(tile_rows, keys_end - tile);
    __syncthreads();
    load_tile(k + base, tile, count, a.dim, k_tile);
    load_tile(v + base, tile, count, a.dim, v_tile);
    __syncthreads();
    if (!br.active) continue;
    const int64_t j_begin = max(tile, i - left), j_end = min(tile + count, i + right + 1);
    for (int64_t j = j_begin; j < j_end; ++j) {
      if (key_padded(a, batch, j)) continue;
      const acc_t* key = k_tile + (j - tile) * a.dim;
      const acc_t logit = query.dot(key, a.dim) * scale;
      const acc_t new_max = max(row_max, logit);
      const acc_t rescale = row_max == neg_inf ? acc_t(0) : exp(row_max - new_max);
      const acc_t weight = exp(logit - new_max);
      total = total * rescale + weight;
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) acc.x[r] *= rescale;
      acc.add_scaled(weight * keep_factor<acc_t>(a, br.bh, i, j), v_tile + (j - tile) * a.dim,
                     a.dim);
      row_max = new_max;
    }
  }
  if (!br.active) return;
  // total is 0 for a row without keys (zeros, lse = -inf) and NaN for a row whose logits are
  // NaN, which has keys: its output and lse are NaN, as on every other route.
  const bool has_key = !(total <= acc_t(0));
  acc.store(out + base + i * a.dim, a.dim, has_key ? acc_t(1) / total : acc_t(0));
  if (threadIdx.x % 32 == 0) {
    lse[br.bh * a.length + i] = has_key ? row_max + log(total) : neg_inf;
  }
}

// dq of each query, and delta = dO . out (the row sum of P * dP) for the key-side kernel.
template <typename scalar_t, typename acc_t, int kPerLane>
__global__ void __launch_bounds__(kThreads)
    backward_query_kernel(BandArgs a, const scalar_t* __restrict__ grad_out,
                          const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                          const scalar_t* __restrict__ v, const scalar_t* __restrict__ out,
                          const acc_t* __restrict__ lse, scalar_t* __restrict__ dq,
                          acc_t* __restrict__ delta, int64_t tile_rows) {
  extern __shared__ unsigned char shared_bytes[];
  acc_t* k_tile = reinterpret_cast<acc_t*>(shared_bytes);
  acc_t* v_tile = k_tile + tile_rows * a.dim;
  const BlockRows br = block_rows(a.length);
  const int64_t h = br.bh % a.heads, batch = br.bh / a.heads, base = br.bh * a.length * a.dim;
  const int64_t left = a.left[h], right = a.right[h], i = br.row;
  const int64_t last = min(br.first + kWarps, a.length) - 1;
  const int64_t keys_begin = max(int64_t(0), br.first - left);
  const int64_t keys_end = min(a.length, last + right + 1);
  const acc_t scale = acc_t(a.scale);

  LaneRow<acc_t, kPerLane> query, grad, grad_q;
  acc_t row_lse = -INFINITY, row_delta = 0;
  if (br.active) {
    query.load(q + base + i * a.dim, a.dim);
    grad.load(grad_out + base + i * a.dim, a.dim);
    LaneRow<acc_t, kPerLane> output;
    output.load(out + base + i * a.dim, a.dim);
    acc_t partial = 0;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) partial += grad.x[r] * output.x[r];
    row_delta = warp_sum(partial);
    row_lse = lse[br.bh * a.length + i];
    if (threadIdx.x % 32 == 0) delta[br.bh * a.length + i] = row_delta;
  }
  grad_q.fill(acc_t(0));
  const bool has_key = row_lse != -INFINITY;
  for (int64_t tile = keys_begin; tile < keys_end; tile += tile_rows) {
    const int64_t count = min(tile_rows, keys_end - tile);
    __syncthreads();
    load_tile(k + base, tile, count, a.dim, k_tile);
    load_tile(v + base, tile, count, a.dim, v_tile);
    __syncthreads();
    if (!br.active || !has_key) continue;
    const int64_t j_begin = max(tile, i - left), j_end = min(tile + count, i + right + 1);
    for (int64_t j = j_begin; j < j_end; ++j) {
      if (key_padded(a, batch, j)) continue;
      const acc_t* key = k_tile + (j - tile) * a.dim;
      const acc_t prob = exp(query.dot(key, a.dim) * scale - row_lse);
      const acc_t grad_weight = grad.dot(v_tile + (j - tile) * a.dim, a.dim);
      const acc_t factor = keep_factor<acc_t>(a, br.bh, i, j);
      grad_q.add_scaled(prob * (grad_weight * factor - row_delta) * scale, key, a.dim);
    }
  }
  if (br.active) grad_q.store(dq + base + i * a.dim, a.dim, acc_t(1));
}

// dk and dv of each key, from the queries whose band contains it.
template <typename scalar_t, typename acc_t, int kPerLane>
__global__ void __launch_bounds__(kThreads)
    backward_key_kernel(BandArgs a, const scalar_t* __restrict__ grad_out,
                        const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                        const scalar_t* __restrict__ v, const acc_t* __restrict__ lse,
                        const acc_t* __restrict__ delta, scalar_t* __restrict__ dk,
                        scalar_t* __restrict__ dv, int64_t tile_rows) {
  extern __shared__ unsigned char shared_bytes[];
  acc_t* q_tile = reinterpret_cast<acc_t*>(shared_bytes);
  acc_t* g_tile = q_tile + tile_rows * a.dim;
  acc_t* lse_tile = g_tile + tile_rows * a.dim;
  acc_t* delta_tile = lse_tile + tile_rows;
  const BlockRows br = block_rows(a.length);
  const int64_t h = br.bh % a.heads, batch = br.bh / a.heads, base = br.bh * a.length * a.dim;
  const int64_t left = a.left[h], right = a.right[h], j = br.row;
  const int64_t last = min(br.first + kWarps, a.length) - 1;
  // Key j is used by queries j - right .. j + left.
  const int64_t queries_begin = max(int64_t(0), br.first - right);
  const int64_t queries_end = min(a.length, last + left + 1);
  const acc_t scale = acc_t(a.scale);
  const bool live = br.active && !key_padded(a, batch, j);

  LaneRow<acc_t, kPerLane> key, value, grad_k, grad_v;
  if (live) {
    key.load(k + base + j * a.dim, a.dim);
    value.load(v + base + j * a.dim, a.dim);
  }
  grad_k.fill(acc_t(0));
  grad_v.fill(acc_t(0));
  for (int64_t tile = queries_begin; tile < queries_end; tile += tile_rows) {
    const int64_t count = min(tile_rows, queries_end - tile);
    __syncthreads();
    load_tile(q + base, tile, count, a.dim, q_tile);
    load_tile(grad_out + base, tile, count, a.dim, g_tile);
    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
      lse_tile[e] = lse[br.bh * a.length + tile + e];
      delta_tile[e] = delta[br.bh * a.length + tile + e];
    }
    __syncthreads();
    if (!live) continue;
    const int64_t i_begin = max(tile, j - right), i_end = min(tile + count, j + left + 1);
    for (int64_t i = i_begin; i < i_end; ++i) {
      const acc_t* query = q_tile + (i - tile) * a.dim;
      const acc_t* grad = g_tile + (i - tile) * a.dim;
      // Query i allows key j, so its row has a key and a finite log-sum-exp.
      const acc_t prob = exp(key.dot(query, a.dim) * scale - lse_tile[i - tile]);
      const acc_t grad_weight = value.dot(grad, a.dim);
      const acc_t factor = keep_factor<acc_t>(a, br.bh, i, j);
      grad_k.add_scaled(prob * (grad_weight * factor - delta_tile[i - tile]) * scale, query,
                        a.dim);
      grad_v.add_scaled(prob * factor, grad, a.dim);
    }
  }
  if (!br.active) return;
  grad_k.store(dk + base + j * a.dim, a.dim, acc_t(1));
  grad_v.store(dv + base + j * a.dim, a.dim, acc_t(1));
}

// Everything a launch needs besides the data pointers.
struct Launch {
  BandArgs args;
  at::Tensor windows;  // keeps the device copy of left/right alive
  dim3 grid;
  int64_t tile_rows;
  cudaStream_t stream;
};

// Enough for every distinct set of per-head windows of a model, on every device it uses.
constexpr size_t kMaxCachedWindows = 256;

// The per-head windows on the device, copied once per (device, windows): a copy from pageable
// host memory on every launch would make the host wait for the GPU three times a call.
at::Tensor device_windows(const std::vector<int64_t>& windows, const at::Device& device) {
  using Key = std::pair<c10::DeviceIndex, std::vector<int64_t>>;
  static std::mutex mutex;
  // Never destroyed: freeing device memory while the process exits can fail after CUDA's own
  // teardown.
  static auto* cache = new std::map<Key, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  Key key{device.index(), windows};
  const auto found = cache->find(key);
  if (found != cache->end()) return found->second;
  // Clearing is safe with launches still queued: freed device memory is reused in stream order.
  if (cache->size() >= kMaxCachedWindows) cache->clear();
  at::Tensor copy = at::tensor(windows, at::kLong).to(device);
  cache->emplace(std::move(key), copy);
  return copy;
}

template <typename acc_t>
Launch make_launch(const at::Tensor& q, const BandProblem& pb, const at::Tensor& padding,
                   const at::Tensor& keep, int64_t extra_per_row) {
  TORCH_CHECK(pb.dim <= 32 * kMaxDimPerLane, "banded_attention on CUDA supports head_dim <= ",
              32 * kMaxDimPerLane, ", got ", pb.dim);
  Launch l;
  std::vector<int64_t> windows(pb.left);
  windows.insert(windows.end(), pb.right.begin(), pb.right.end());
  l.windows = device_windows(windows, q.device());
  const int64_t* w = l.windows.data_ptr<int64_t>();
  l.args = BandArgs{pb.heads,  pb.length,
                    pb.dim,    pb.width(),
                    pb.max_left, w,
                    w + pb.heads, padding.defined() ? padding.data_ptr<bool>() : nullptr,
                    keep.defined() ? keep.data_ptr<bool>() : nullptr,
                    static_cast<float>(pb.keep_scale), pb.scale};
  const int64_t row_bytes = (2 * pb.dim + extra_per_row) * static_cast<int64_t>(sizeof(acc_t));
  l.tile_rows = std::max<int64_t>(kWarps, kTileBytes / std::max<int64_t>(row_bytes, 1));
  const int64_t blocks = pb.batch_heads() * ((pb.length + kWarps - 1) / kWarps);
  TORCH_CHECK(blocks < (int64_t(1) << 31), "banded_attention: too many rows for one launch");
  l.grid = dim3(static_cast<unsigned>(blocks));
  l.stream = c10::cuda::getCurrentCUDAStream();
  return l;
}

int64_t shared_memory_bytes(const Launch& l, int64_t dim, int64_t extra_per_row, size_t elem) {
  return l.tile_rows * (2 * dim + extra_per_row) * static_cast<int64_t>(elem);
}

// Calls fn with the per-lane width (compile-time) that fits the head dim.
template <typename Fn>
void with_lane_width(int64_t dim, Fn&& fn) {
  if (dim <= 32) {
    fn(std::integral_constant<int, 1>());
  } else if (dim <= 64) {
    fn(std::integral_constant<int, 2>());
  } else if (dim <= 128) {
    fn(std::integral_constant<int, 4>());
  } else {
    fn(std::integral_constant<int, 8>());
  }
}

std::tuple<at::Tensor, at::Tensor> banded_forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef left,
    at::IntArrayRef right, const c10::optional<at::Tensor>& key_padding_mask,
    const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const at::Tensor padding = contiguous_mask(key_padding_mask);
  const at::Tensor keep = contiguous_mask(dropout_keep);
  const BandProblem pb = make_problem(q, k, v, left, right, padding, keep, scale, dropout_p);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  at::Tensor lse =
      at::empty({pb.batch, pb.heads, pb.length}, qc.options().dtype(lse_dtype(q.scalar_type())));
  if (qc.numel() == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "banded_forward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const Launch l = make_launch<acc_t>(qc, pb, padding, keep, 0);
        const int64_t smem = shared_memory_bytes(l, pb.dim, 0, sizeof(acc_t));
        with_lane_width(pb.dim, [&](auto per_lane) {
          forward_kernel<scalar_t, acc_t, decltype(per_lane)::value>
              <<<l.grid, kThreads, smem, l.stream>>>(
                  l.args, qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(),
                  vc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>(),
                  l.tile_rows);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, at::IntArrayRef left, at::IntArrayRef right,
    const c10::optional<at::Tensor>& key_padding_mask,
    const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const at::Tensor padding = contiguous_mask(key_padding_mask);
  const at::Tensor keep = contiguous_mask(dropout_keep);
  const BandProblem pb = make_problem(q, k, v, left, right, padding, keep, scale, dropout_p);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "banded_backward: grad_out and out must have the shape of q");
  TORCH_CHECK(lse.sizes() == at::IntArrayRef({pb.batch, pb.heads, pb.length}) &&
                  lse.scalar_type() == lse_dtype(q.scalar_type()),
              "banded_backward: lse must be the tensor returned by banded_forward");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor gc = grad_out.to(q.scalar_type()).contiguous();
  const at::Tensor oc = out.contiguous(), lc = lse.contiguous();
  at::Tensor dq = at::empty(qc.sizes(), qc.options());
  at::Tensor dk = at::empty(qc.sizes(), qc.options());
  at::Tensor dv = at::empty(qc.sizes(), qc.options());
  if (qc.numel() == 0) return {dq, dk, dv};
  at::Tensor delta = at::empty(lc.sizes(), lc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "banded_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const Launch lq = make_launch<acc_t>(qc, pb, padding, keep, 0);
        const Launch lk = make_launch<acc_t>(qc, pb, padding, keep, 2);
        const int64_t smem_q = shared_memory_bytes(lq, pb.dim, 0, sizeof(acc_t));
        const int64_t smem_k = shared_memory_bytes(lk, pb.dim, 2, sizeof(acc_t));
        with_lane_width(pb.dim, [&](auto per_lane) {
          constexpr int kPerLane = decltype(per_lane)::value;
          backward_query_kernel<scalar_t, acc_t, kPerLane>
              <<<lq.grid, kThreads, smem_q, lq.stream>>>(
                  lq.args, gc.data_ptr<scalar_t>(), qc.data_ptr<scalar_t>(),
                  kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), oc.data_ptr<scalar_t>(),
                  lc.data_ptr<acc_t>(), dq.data_ptr<scalar_t>(), delta.data_ptr<acc_t>(),
                  lq.tile_rows);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          backward_key_kernel<scalar_t, acc_t, kPerLane>
              <<<lk.grid, kThreads, smem_k, lk.stream>>>(
                  lk.args, gc.data_ptr<scalar_t>(), qc.data_ptr<scalar_t>(),
                  kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), lc.data_ptr<acc_t>(),
                  delta.data_ptr<acc_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                  lk.tile_rows);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(local_attn, CUDA, m) {
  m.impl("banded_forward", &banded_forward_cuda);
  m.impl("banded_backward", &banded_backward_cuda);
}

}  // namespace local_attn
