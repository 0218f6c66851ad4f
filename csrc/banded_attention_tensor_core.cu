// Tensor-core kernels of the banded attention: a band-restricted flash attention for float16 and
// bfloat16 inputs on sm_80 and newer (mma.sync.m16n8k16, float32 accumulation), head dims 32,
// 64 and 128. Same schema and semantics as local_attn::banded_forward / banded_backward; they
// are registered as banded_forward_tensor_core / banded_backward_tensor_core.
//
// A thread block has four warps of 16 rows each. Forward: a block of 64 queries walks the key
// tiles its band touches, S = Q K^T and O += P V on the tensor cores, with an online softmax in
// registers (FlashAttention-2), and writes the output and the row log-sum-exp. Backward
// recomputes P from the log-sum-exp, with D = rowsum(dO * O) and dS = P * (dP - D): one
// query-centred kernel gives dQ (and D), one key-centred kernel walks the query tiles that see
// its 64 keys and gives dK and dV. No atomics, so the gradients are deterministic.
//
// Inside a tile every warp skips the 8-column slices that lie outside its rows' band, and the
// mask of each element (window, sequence end, key padding) is applied to the logits, so only
// the band's neighbourhood costs tensor-core work.
#include "banded_attention.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace local_attn {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = 16;                   // rows of one mma tile
constexpr int kBlockRows = kWarps * kWarpRows;  // queries (or keys) a block owns
constexpr int kPad = 8;  // halves added to each shared row: conflict-free fragment loads
constexpr int kInlineHeads = 64;  // per-head windows passed in the kernel arguments up to this
constexpr int64_t kMaxLength = int64_t(1) << 30;  // positions and windows fit an int
constexpr size_t kDefaultSharedBytes = 48 * 1024;

constexpr int kForwardKeys = 64;  // keys per step of the forward kernel

// Keys per step of the dq kernel, and queries per step of the dk/dv kernel: fewer
// for head dim 128 so that the logit and accumulator tiles stay in registers.
template <int D>
constexpr int step_rows() {
  return D == 128 ? 32 : 64;
}

// Raw view of one call, passed to the kernels by value.
struct TcArgs {
  int64_t heads, length;
  int64_t width, max_left;  // band layout of the dropout keep-mask
  int left[kInlineHeads], right[kInlineHeads];
  const int* windows_on_device;  // (2H,) left then right, when heads > kInlineHeads
  const bool* key_padding;       // (B, T) or null
  const bool* keep;              // (B, H, T, W) or null
  float keep_scale, scale, scale_log2;
};

// The kernels need sm_80 (cp.async, bfloat16 mma). Compiled for an older arch they are stubs,
// which the host never launches: it checks the device's compute capability first.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define LOCAL_ATTN_TENSOR_CORE_STUBS
#endif

#ifndef LOCAL_ATTN_TENSOR_CORE_STUBS

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------
// Element types: float16 and bfloat16 bits as uint16_t, converted with the CUDA intrinsics.

template <typename scalar_t>
struct Half;

template <>
struct Half<at::Half> {
  __device__ __forceinline__ static float to_float(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  __device__ __forceinline__ static uint32_t pack(float low, float high) {
    return uint32_t(__half_as_ushort(__float2half_rn(low))) |
           (uint32_t(__half_as_ushort(__float2half_rn(high))) << 16);
  }
  // d += a (16x16, row-major) * b (16x8, column-major), float32 accumulation.
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <>
struct Half<at::BFloat16> {
  __device__ __forceinline__ static float to_float(uint16_t bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  __device__ __forceinline__ static uint32_t pack(float low, float high) {
    return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(low))) |
           (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(high))) << 16);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// ---------------------------------------------------------------------------------------------
// Shared memory tiles and mma fragments. A tile holds rows of D halves at a stride of D + kPad.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * g + t): A holds rows g and g + 8, columns
// 2t, 2t + 1 and 2t + 8, 2t + 9; B holds rows (the k index) 2t, 2t + 1 and 2t + 8, 2t + 9 of
// column g; the float32 accumulator C holds rows g (c0, c1) and g + 8 (c2, c3), columns 2t, 2t + 1.

struct LanePlace {
  int warp, lane, g, t;
  __device__ LanePlace()
      : warp(threadIdx.x / 32), lane(threadIdx.x % 32), g(lane / 4), t(lane % 4) {}
};

__device__ __forceinline__ void copy_16_bytes(void* shared_dst, const void* global_src,
                                              bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  const int src_bytes = valid ? 16 : 0;  // 0: no read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Starts copying rows first .. first + kRows of a (T, D) matrix into a tile; rows at or after
// `end` become zeros (so a masked weight never multiplies garbage).
template <int D, int kRows>
__device__ __forceinline__ void load_rows(uint16_t* tile, const uint16_t* matrix, int64_t first,
                                          int64_t end) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int row = c / kChunks, piece = c % kChunks;
    const bool valid = first + row < end;
    const uint16_t* src = valid ? matrix + (first + row) * D + piece * 8 : matrix;
    copy_16_bytes(tile + row * (D + kPad) + piece * 8, src, valid);
  }
}

template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* tile, int row0, int col0,
                                       const LanePlace& lp) {
  constexpr int kStride = D + kPad;
  const uint16_t* p = tile + (row0 + lp.g) * kStride + col0 + 2 * lp.t;
  a[0] = *reinterpret_cast<const uint32_t*>(p);
  a[1] = *reinterpret_cast<const uint32_t*>(p + 8 * kStride);
  a[2] = *reinterpret_cast<const uint32_t*>(p + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(p + 8 * kStride + 8);
}

// B fragment with B[k][n] = tile[row0 + n][col0 + k] (the tile holds B transposed: K for Q K^T).
template <int D>
__device__ __forceinline__ void load_b_transposed(uint32_t (&b)[2], const uint16_t* tile, int row0,
                                                  int col0, const LanePlace& lp) {
  const uint16_t* p = tile + (row0 + lp.g) * (D + kPad) + col0 + 2 * lp.t;
  b[0] = *reinterpret_cast<const uint32_t*>(p);
  b[1] = *reinterpret_cast<const uint32_t*>(p + 8);
}

// B fragments of columns col0 .. col0 + 7 and col0 + 8 .. col0 + 15 with B[k][n] =
// tile[row0 + k][col0 + n] (the tile holds B itself: V for P V), by ldmatrix.trans.
template <int D>
__device__ __forceinline__ void load_b_pair(uint32_t (&b0)[2], uint32_t (&b1)[2],
                                            const uint16_t* tile, int row0, int col0,
                                            const LanePlace& lp) {
  // Lanes 8m .. 8m + 7 give the rows of 8x8 matrix m: (k 0-7, n 0-7), (k 8-15, n 0-7),
  // (k 0-7, n 8-15), (k 8-15, n 8-15).
  const int row = row0 + (lp.lane & 7) + ((lp.lane >> 3) & 1) * 8;
  const int col = col0 + (lp.lane >> 4) * 8;
  const unsigned address =
      static_cast<unsigned>(__cvta_generic_to_shared(tile + row * (D + kPad) + col));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
               : "r"(address));
}

// acc[n] += A (16 rows from a_row0 of a_tile, all D columns) * B^T, B being rows n * 8 .. n * 8
// + 7 of b_tile, for the column slices first <= n < last (the others stay as they are).
template <typename scalar_t, int D, int kSlices>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kSlices][4], const uint16_t* a_tile,
                                                 int a_row0, const uint16_t* b_tile, int first,
                                                 int last, const LanePlace& lp) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a<D>(a, a_tile, a_row0, kk * 16, lp);
#pragma unroll
    for (int n = 0; n < kSlices; ++n) {
      if (n < first || n >= last) continue;
      uint32_t b[2];
      load_b_transposed<D>(b, b_tile, n * 8, kk * 16, lp);
      Half<scalar_t>::mma(acc[n], a, b);
    }
  }
}

// acc (16 x D) += W (16 x kSlices * 8, the float accumulator layout of mma_rows_by_rows,
// rounded to scalar_t) * rows 0 .. kSlices * 8 - 1 of tile. Slices outside [first, last) are
// zero weights and are skipped in pairs.
template <typename scalar_t, int D, int kSlices>
__device__ __forceinline__ void mma_weights_by_rows(float (&acc)[D / 8][4],
                                                    const float (&w)[kSlices][4],
                                                    const uint16_t* tile, int first, int last,
                                                    const LanePlace& lp) {
  static_assert(kSlices % 2 == 0, "weights come in 16-column steps");
#pragma unroll
  for (int kk = 0; kk < kSlices / 2; ++kk) {
    if (2 * kk + 1 < first || 2 * kk >= last) continue;
    // The accumulator of two 8-column slices is the A fragment of one 16-column step.
    const uint32_t a[4] = {Half<scalar_t>::pack(w[2 * kk][0], w[2 * kk][1]),
                           Half<scalar_t>::pack(w[2 * kk][2], w[2 * kk][3]),
                           Half<scalar_t>::pack(w[2 * kk + 1][0], w[2 * kk + 1][1]),
                           Half<scalar_t>::pack(w[2 * kk + 1][2], w[2 * kk + 1][3])};
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      uint32_t b0[2], b1[2];
      load_b_pair<D>(b0, b1, tile, kk * 16, dd * 16, lp);
      Half<scalar_t>::mma(acc[2 * dd], a, b0);
      Half<scalar_t>::mma(acc[2 * dd + 1], a, b1);
    }
  }
}

template <int kSlices>
__device__ __forceinline__ void zero(float (&x)[kSlices][4]) {
#pragma unroll
  for (int n = 0; n < kSlices; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[n][e] = 0.f;
  }
}

// Stores rows g and g + 8 (from row0) of a 16 x D accumulator, those below `length`.
template <typename scalar_t, int D>
__device__ __forceinline__ void store_rows(uint16_t* matrix, int64_t row0, int64_t length,
                                           const float (&acc)[D / 8][4], const float (&factor)[2],
                                           const LanePlace& lp) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + lp.g + 8 * r;
    if (row >= length) continue;
    uint32_t* dst = reinterpret_cast<uint32_t*>(matrix + row * D + 2 * lp.t);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dst[n * 4] = Half<scalar_t>::pack(acc[n][2 * r] * factor[r], acc[n][2 * r + 1] * factor[r]);
    }
  }
}

__device__ __forceinline__ float group_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float group_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------------------------
// Band geometry.

struct BlockPlace {
  int64_t bh, batch, first;  // (batch * head), batch, first row (query or key) of the block
  int length, left, right;   // windows clipped to length - 1
  int64_t base;              // offset of this (batch, head) in a (B, H, T, D) tensor
};

template <int D>
__device__ __forceinline__ BlockPlace place_block(const TcArgs& a) {
  const int64_t tiles = (a.length + kBlockRows - 1) / kBlockRows;
  BlockPlace p;
  p.bh = blockIdx.x / tiles;
  p.first = (blockIdx.x % tiles) * kBlockRows;
  p.batch = p.bh / a.heads;
  const int h = static_cast<int>(p.bh % a.heads);
  p.length = static_cast<int>(a.length);
  p.left = a.windows_on_device ? a.windows_on_device[h] : a.left[h];
  p.right = a.windows_on_device ? a.windows_on_device[a.heads + h] : a.right[h];
  p.base = p.bh * a.length * D;
  return p;
}

__device__ __forceinline__ bool in_window(int query, int key, int left, int right) {
  const int offset = key - query;
  return offset >= -left && offset <= right;
}

// Positions [begin, end) of the other side (keys of queries, or queries of keys) that rows
// first .. first + rows - 1 reach, `back` behind and `ahead` in front, inside 0 .. length - 1.
struct Span {
  int64_t begin, end;
};

__device__ __forceinline__ Span reach(int64_t first, int rows, int64_t length, int back,
                                      int ahead) {
  const int64_t last = first + rows <= length ? first + rows - 1 : length - 1;
  const int64_t begin = first - back, end = last + ahead + 1;
  return Span{begin > 0 ? begin : 0, end < length ? end : length};
}

__device__ __forceinline__ bool key_padded(const TcArgs& a, int64_t batch, int key) {
  return a.key_padding != nullptr && a.key_padding[batch * a.length + key];
}

// Dropout multiplier of an allowed (query, key) pair: keep / (1 - p).
__device__ __forceinline__ float keep_factor(const TcArgs& a, int64_t bh, int query, int key) {
  const int64_t column = key - query + a.max_left;
  return a.keep[(bh * a.length + query) * a.width + column] ? a.keep_scale : 0.f;
}

// The 8-column slices [first, last) of a tile starting at `tile` that hold positions in
// [begin, end); first >= last when there are none.
struct Slices {
  int first, last;
};

__device__ __forceinline__ Slices slices_of(int64_t tile, int64_t begin, int64_t end) {
  const int64_t lo = max(begin, tile) - tile, hi = end - tile;
  return Slices{static_cast<int>(lo / 8), hi <= lo ? 0 : static_cast<int>((hi + 7) / 8)};
}

#endif  // LOCAL_ATTN_TENSOR_CORE_STUBS

// ---------------------------------------------------------------------------------------------
// Forward.

template <int D>
constexpr size_t forward_shared_bytes() {
  return size_t(kBlockRows + 2 * kForwardKeys) * (D + kPad) * 2 + kForwardKeys;
}

template <typename scalar_t, int D>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const TcArgs a, const uint16_t* __restrict__ q,
                   const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                   uint16_t* __restrict__ out, float* __restrict__ lse) {
#ifdef LOCAL_ATTN_TENSOR_CORE_STUBS
  __trap();
#else
  constexpr int kKeys = kForwardKeys, kSlices = kKeys / 8, kStride = D + kPad;
  static_assert(kSlices * 4 <= 32, "one bit per logit of a thread");
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(shared_bytes);
  uint16_t* k_tile = q_tile + kBlockRows * kStride;
  uint16_t* v_tile = k_tile + kKeys * kStride;
  bool* key_ok = reinterpret_cast<bool*>(v_tile + kKeys * kStride);

  const LanePlace lp;
  const BlockPlace bp = place_block<D>(a);
  const Span keys = reach(bp.first, kBlockRows, bp.length, bp.left, bp.right);
  const int64_t warp_row0 = bp.first + lp.warp * kWarpRows;
  const Span warp_keys = reach(warp_row0, kWarpRows, bp.length, bp.left, bp.right);
  const int rows[2] = {static_cast<int>(warp_row0) + lp.g, static_cast<int>(warp_row0) + lp.g + 8};

  load_rows<D, kBlockRows>(q_tile, q + bp.base, bp.first, bp.length);

  float o[D / 8][4];
  zero(o);
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  for (int64_t tile = keys.begin; tile < keys.end; tile += kKeys) {
    __syncthreads();  // every warp is done with the previous tile
    load_rows<D, kKeys>(k_tile, k + bp.base, tile, keys.end);
    load_rows<D, kKeys>(v_tile, v + bp.base, tile, keys.end);
    for (int n = threadIdx.x; n < kKeys; n += kThreads) {
      const int64_t key = tile + n;
      key_ok[n] = key < keys.end && !key_padded(a, bp.batch, static_cast<int>(key));
    }
    wait_copies();
    __syncthreads();
    const Slices sl = slices_of(tile, warp_keys.begin, warp_keys.end);
    if (sl.first >= sl.last) continue;  // this warp's rows see no key of the tile

    float s[kSlices][4];
    zero(s);
    mma_rows_by_rows<scalar_t, D, kSlices>(s, q_tile, lp.warp * kWarpRows, k_tile, sl.first,
                                           sl.last, lp);
    uint32_t allowed = 0;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kSlices; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = n * 8 + 2 * lp.t + (e & 1);
        const int key = static_cast<int>(tile) + column;
        // Rows past the end are computed but not stored; they must not read the keep-mask.
        const bool ok = rows[e / 2] < bp.length && key_ok[column] &&
                        in_window(rows[e / 2], key, bp.left, bp.right);
        allowed |= uint32_t(ok) << (n * 4 + e);
        s[n][e] = ok ? s[n][e] * a.scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
      }
    }
    float shift[2];  // the running maximum, 0 while a row has seen no key (no inf - inf)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float new_max = fmaxf(row_max[r], group_max(tile_max[r]));
      shift[r] = new_max == -INFINITY ? 0.f : new_max;
      const float rescale = exp2f(row_max[r] - shift[r]);
      row_max[r] = new_max;
      row_sum[r] *= rescale;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * r] *= rescale;
        o[n][2 * r + 1] *= rescale;
      }
    }
#pragma unroll
    for (int n = 0; n < kSlices; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[n][e] - shift[e / 2]);  // masked: exp2(-inf) = 0
        row_sum[e / 2] += p;
        if (a.keep != nullptr && (allowed >> (n * 4 + e) & 1u)) {
          p *= keep_factor(a, bp.bh, rows[e / 2],
                           static_cast<int>(tile) + n * 8 + 2 * lp.t + (e & 1));
        }
        s[n][e] = p;
      }
    }
    mma_weights_by_rows<scalar_t, D, kSlices>(o, s, v_tile, sl.first, sl.last, lp);
  }

  float inverse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float total = group_sum(row_sum[r]);
    // 0 for a row without keys (zeros, lse = -inf); NaN for a row whose logits are NaN, which
    // has keys: its output and lse are NaN, as on every other route.
    const bool has_key = !(total <= 0.f);
    inverse[r] = has_key ? 1.f / total : 0.f;
    if (lp.t == 0 && rows[r] < bp.length) {
      lse[bp.bh * a.length + rows[r]] = has_key ? (row_max[r] + log2f(total)) * kLn2 : -INFINITY;
    }
  }
  store_rows<scalar_t, D>(out + bp.base, warp_row0, bp.length, o, inverse, lp);
#endif
}

// ---------------------------------------------------------------------------------------------
// Backward, query side: dQ = dS K, and D = rowsum(dO * O) for the key side.

template <int D>
constexpr size_t query_backward_shared_bytes() {
  return kBlockRows * sizeof(float) + size_t(2 * kBlockRows + 2 * step_rows<D>()) * (D + kPad) * 2 +
         step_rows<D>();
}

template <typename scalar_t, int D>
__global__ void __launch_bounds__(kThreads)
    backward_query_kernel(const TcArgs a, const uint16_t* __restrict__ grad_out,
                          const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                          const uint16_t* __restrict__ v, const uint16_t* __restrict__ out,
                          const float* __restrict__ lse, uint16_t* __restrict__ dq,
                          float* __restrict__ delta) {
#ifdef LOCAL_ATTN_TENSOR_CORE_STUBS
  __trap();
#else
  constexpr int kKeys = step_rows<D>(), kSlices = kKeys / 8, kStride = D + kPad;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  float* delta_tile = reinterpret_cast<float*>(shared_bytes);
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(delta_tile + kBlockRows);
  uint16_t* g_tile = q_tile + kBlockRows * kStride;
  uint16_t* k_tile = g_tile + kBlockRows * kStride;
  uint16_t* v_tile = k_tile + kKeys * kStride;
  bool* key_ok = reinterpret_cast<bool*>(v_tile + kKeys * kStride);

  const LanePlace lp;
  const BlockPlace bp = place_block<D>(a);
  const Span keys = reach(bp.first, kBlockRows, bp.length, bp.left, bp.right);
  const int64_t warp_row0 = bp.first + lp.warp * kWarpRows;
  const Span warp_keys = reach(warp_row0, kWarpRows, bp.length, bp.left, bp.right);
  const int rows[2] = {static_cast<int>(warp_row0) + lp.g, static_cast<int>(warp_row0) + lp.g + 8};

  load_rows<D, kBlockRows>(q_tile, q + bp.base, bp.first, bp.length);
  load_rows<D, kBlockRows>(g_tile, grad_out + bp.base, bp.first, bp.length);
  {  // D of the warp's 16 rows, two lanes per row.
    const int64_t row = warp_row0 + lp.lane / 2;
    float partial = 0.f;
    if (row < bp.length) {
      const uint32_t* g_row = reinterpret_cast<const uint32_t*>(grad_out + bp.base + row * D);
      const uint32_t* o_row = reinterpret_cast<const uint32_t*>(out + bp.base + row * D);
      for (int w = lp.lane % 2; w < D / 2; w += 2) {
        const uint32_t gw = g_row[w], ow = o_row[w];
        partial += Half<scalar_t>::to_float(gw & 0xffffu) * Half<scalar_t>::to_float(ow & 0xffffu) +
                   Half<scalar_t>::to_float(gw >> 16) * Half<scalar_t>::to_float(ow >> 16);
      }
    }
    partial += __shfl_xor_sync(0xffffffffu, partial, 1);
    if (lp.lane % 2 == 0) {
      delta_tile[lp.warp * kWarpRows + lp.lane / 2] = partial;
      if (row < bp.length) delta[bp.bh * a.length + row] = partial;
    }
    __syncwarp();
  }
  float row_lse[2], row_delta[2];  // log-sum-exp in base 2
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_lse[r] = rows[r] < bp.length ? lse[bp.bh * a.length + rows[r]] * kLog2e : 0.f;
    row_delta[r] = delta_tile[lp.warp * kWarpRows + lp.g + 8 * r];
  }

  float grad_q[D / 8][4];
  zero(grad_q);
  for (int64_t tile = keys.begin; tile < keys.end; tile += kKeys) {
    __syncthreads();
    load_rows<D, kKeys>(k_tile, k + bp.base, tile, keys.end);
    load_rows<D, kKeys>(v_tile, v + bp.base, tile, keys.end);
    for (int n = threadIdx.x; n < kKeys; n += kThreads) {
      const int64_t key = tile + n;
      key_ok[n] = key < keys.end && !key_padded(a, bp.batch, static_cast<int>(key));
    }
    wait_copies();
    __syncthreads();
    const Slices sl = slices_of(tile, warp_keys.begin, warp_keys.end);
    if (sl.first >= sl.last) continue;

    float s[kSlices][4], dp[kSlices][4];
    zero(s);
    zero(dp);
    mma_rows_by_rows<scalar_t, D, kSlices>(s, q_tile, lp.warp * kWarpRows, k_tile, sl.first,
                                           sl.last, lp);
    mma_rows_by_rows<scalar_t, D, kSlices>(dp, g_tile, lp.warp * kWarpRows, v_tile, sl.first,
                                           sl.last, lp);
#pragma unroll
    for (int n = 0; n < kSlices; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = n * 8 + 2 * lp.t + (e & 1);
        const int key = static_cast<int>(tile) + column, row = rows[e / 2];
        const bool ok =
            row < bp.length && key_ok[column] && in_window(row, key, bp.left, bp.right);
        const float p = ok ? exp2f(s[n][e] * a.scale_log2 - row_lse[e / 2]) : 0.f;
        const float factor = ok && a.keep != nullptr ? keep_factor(a, bp.bh, row, key) : 1.f;
        s[n][e] = p * (dp[n][e] * factor - row_delta[e / 2]) * a.scale;  // dS
      }
    }
    mma_weights_by_rows<scalar_t, D, kSlices>(grad_q, s, k_tile, sl.first, sl.last, lp);
  }
  const float one[2] = {1.f, 1.f};
  store_rows<scalar_t, D>(dq + bp.base, warp_row0, bp.length, grad_q, one, lp);
#endif
}

// ---------------------------------------------------------------------------------------------
// Backward, key side: dV = (P * keep)^T dO and dK = dS^T Q over the queries that see each key.

template <int D>
constexpr size_t key_backward_shared_bytes() {
  return 2 * step_rows<D>() * sizeof(float) +
         size_t(2 * kBlockRows + 2 * step_rows<D>()) * (D + kPad) * 2;
}

template <typename scalar_t, int D>
__global__ void __launch_bounds__(kThreads)
    backward_key_kernel(const TcArgs a, const uint16_t* __restrict__ grad_out,
                        const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                        const uint16_t* __restrict__ v, const float* __restrict__ lse,
                        const float* __restrict__ delta, uint16_t* __restrict__ dk,
                        uint16_t* __restrict__ dv) {
#ifdef LOCAL_ATTN_TENSOR_CORE_STUBS
  __trap();
#else
  constexpr int kQueries = step_rows<D>(), kSlices = kQueries / 8, kStride = D + kPad;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  float* lse_tile = reinterpret_cast<float*>(shared_bytes);
  float* delta_tile = lse_tile + kQueries;
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(delta_tile + kQueries);
  uint16_t* v_tile = k_tile + kBlockRows * kStride;
  uint16_t* q_tile = v_tile + kBlockRows * kStride;
  uint16_t* g_tile = q_tile + kQueries * kStride;

  const LanePlace lp;
  const BlockPlace bp = place_block<D>(a);
  // Key j is seen by queries j - right .. j + left.
  const Span queries = reach(bp.first, kBlockRows, bp.length, bp.right, bp.left);
  const int64_t warp_key0 = bp.first + lp.warp * kWarpRows;
  const Span warp_queries = reach(warp_key0, kWarpRows, bp.length, bp.right, bp.left);
  const int keys[2] = {static_cast<int>(warp_key0) + lp.g, static_cast<int>(warp_key0) + lp.g + 8};
  bool key_ok[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    key_ok[r] = keys[r] < bp.length && !key_padded(a, bp.batch, keys[r]);
  }

  load_rows<D, kBlockRows>(k_tile, k + bp.base, bp.first, bp.length);
  load_rows<D, kBlockRows>(v_tile, v + bp.base, bp.first, bp.length);

  float grad_k[D / 8][4], grad_v[D / 8][4];
  zero(grad_k);
  zero(grad_v);
  for (int64_t tile = queries.begin; tile < queries.end; tile += kQueries) {
    __syncthreads();
    load_rows<D, kQueries>(q_tile, q + bp.base, tile, queries.end);
    load_rows<D, kQueries>(g_tile, grad_out + bp.base, tile, queries.end);
    for (int n = threadIdx.x; n < kQueries; n += kThreads) {
      const int64_t query = tile + n;
      const bool valid = query < queries.end;
      lse_tile[n] = valid ? lse[bp.bh * a.length + query] * kLog2e : 0.f;
      delta_tile[n] = valid ? delta[bp.bh * a.length + query] : 0.f;
    }
    wait_copies();
    __syncthreads();
    const Slices sl = slices_of(tile, warp_queries.begin, warp_queries.end);
    if (sl.first >= sl.last) continue;

    float s[kSlices][4], dp[kSlices][4];  // transposed: rows are keys, columns queries
    zero(s);
    zero(dp);
    mma_rows_by_rows<scalar_t, D, kSlices>(s, k_tile, lp.warp * kWarpRows, q_tile, sl.first,
                                           sl.last, lp);
    mma_rows_by_rows<scalar_t, D, kSlices>(dp, v_tile, lp.warp * kWarpRows, g_tile, sl.first,
                                           sl.last, lp);
#pragma unroll
    for (int n = 0; n < kSlices; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = n * 8 + 2 * lp.t + (e & 1);
        const int query = static_cast<int>(tile) + column, key = keys[e / 2];
        // A key allowed for a query gives that query a key, hence a finite log-sum-exp.
        const bool ok = query < queries.end && key_ok[e / 2] &&
                        in_window(query, key, bp.left, bp.right);
        const float p = ok ? exp2f(s[n][e] * a.scale_log2 - lse_tile[column]) : 0.f;
        const float factor = ok && a.keep != nullptr ? keep_factor(a, bp.bh, query, key) : 1.f;
        s[n][e] = p * (dp[n][e] * factor - delta_tile[column]) * a.scale;  // dS^T
        dp[n][e] = p * factor;                                              // kept P^T
      }
    }
    mma_weights_by_rows<scalar_t, D, kSlices>(grad_v, dp, g_tile, sl.first, sl.last, lp);
    mma_weights_by_rows<scalar_t, D, kSlices>(grad_k, s, q_tile, sl.first, sl.last, lp);
  }
  const float one[2] = {1.f, 1.f};
  store_rows<scalar_t, D>(dk + bp.base, warp_key0, bp.length, grad_k, one, lp);
  store_rows<scalar_t, D>(dv + bp.base, warp_key0, bp.length, grad_v, one, lp);
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

constexpr const char* kFallbackHint =
    "; the CUDA-core operators local_attn::banded_forward / banded_backward take every dtype "
    "and head dim";

// Checks that the operator has a kernel for these inputs (after make_problem's checks).
void check_supported(const at::Tensor& q, const char* op) {
  TORCH_CHECK(q.is_cuda(), "local_attn::", op, " runs on CUDA tensors, got ", q.device(),
              kFallbackHint);
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "local_attn::",
              op, " supports float16 and bfloat16 inputs, got ", q.scalar_type(), kFallbackHint);
  const int64_t dim = q.size(3);
  TORCH_CHECK(dim == 32 || dim == 64 || dim == 128, "local_attn::", op,
              " supports head dims 32, 64 and 128, got ", dim, kFallbackHint);
  TORCH_CHECK(q.size(2) <= kMaxLength, "local_attn::", op, " supports lengths up to ",
              kMaxLength, ", got ", q.size(2));
  int major = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
  TORCH_CHECK(major >= 8, "local_attn::", op,
              " needs a GPU of compute capability 8.0 or newer (tensor-core mma for float16 "
              "and bfloat16), this one is ",
              major, ".x", kFallbackHint);
}

// A contiguous tensor whose data starts on a 16-byte boundary (the kernels copy 16-byte pieces).
at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

struct HostArgs {
  TcArgs args;
  at::Tensor windows;  // keeps the device copy of the windows alive (heads > kInlineHeads)
};

HostArgs make_args(const at::Tensor& q, const BandProblem& pb, const at::Tensor& padding,
                   const at::Tensor& keep) {
  HostArgs h;
  TcArgs& a = h.args;
  a.heads = pb.heads;
  a.length = pb.length;
  a.width = pb.width();
  a.max_left = pb.max_left;
  // Keys beyond the sequence are never allowed: clipping the windows to T - 1 changes nothing.
  const int64_t longest = std::max<int64_t>(pb.length - 1, 0);
  std::vector<int> windows;
  for (int64_t w : pb.left) windows.push_back(static_cast<int>(std::min(w, longest)));
  for (int64_t w : pb.right) windows.push_back(static_cast<int>(std::min(w, longest)));
  std::fill(a.left, a.left + kInlineHeads, 0);
  std::fill(a.right, a.right + kInlineHeads, 0);
  a.windows_on_device = nullptr;
  if (pb.heads <= kInlineHeads) {
    std::copy(windows.begin(), windows.begin() + pb.heads, a.left);
    std::copy(windows.begin() + pb.heads, windows.end(), a.right);
  } else {
    h.windows = at::tensor(windows, at::kInt).to(q.device());
    a.windows_on_device = h.windows.data_ptr<int>();
  }
  a.key_padding = padding.defined() ? padding.data_ptr<bool>() : nullptr;
  a.keep = keep.defined() ? keep.data_ptr<bool>() : nullptr;
  a.keep_scale = static_cast<float>(pb.keep_scale);
  a.scale = static_cast<float>(pb.scale);
  a.scale_log2 = static_cast<float>(pb.scale * 1.4426950408889634);  // scale * log2(e)
  return h;
}

dim3 grid_of(const BandProblem& pb) {
  const int64_t blocks = pb.batch_heads() * ((pb.length + kBlockRows - 1) / kBlockRows);
  TORCH_CHECK(blocks < (int64_t(1) << 31), "banded_attention: too many rows for one launch");
  return dim3(static_cast<unsigned>(blocks));
}

template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes > kDefaultSharedBytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}

// Calls fn(scalar_t tag, head dim constant) for a supported (dtype, head dim).
template <typename Fn>
void with_kernel_types(at::ScalarType dtype, int64_t dim, Fn&& fn) {
  auto with_dim = [&](auto tag) {
    switch (dim) {
      case 32: fn(tag, std::integral_constant<int, 32>()); break;
      case 64: fn(tag, std::integral_constant<int, 64>()); break;
      default: fn(tag, std::integral_constant<int, 128>()); break;
    }
  };
  if (dtype == at::kHalf) {
    with_dim(at::Half());
  } else {
    with_dim(at::BFloat16());
  }
}

const uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

uint16_t* mutable_bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

std::tuple<at::Tensor, at::Tensor> banded_forward_tensor_core_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef left,
    at::IntArrayRef right, const c10::optional<at::Tensor>& key_padding_mask,
    const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const at::Tensor padding = contiguous_mask(key_padding_mask);
  const at::Tensor keep = contiguous_mask(dropout_keep);
  const BandProblem pb = make_problem(q, k, v, left, right, padding, keep, scale, dropout_p);
  check_supported(q, "banded_forward_tensor_core");
  const at::Tensor qc = aligned(q), kc = aligned(k), vc = aligned(v);
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  at::Tensor lse = at::empty({pb.batch, pb.heads, pb.length}, qc.options().dtype(at::kFloat));
  if (qc.numel() == 0) return {out, lse};
  const HostArgs h = make_args(qc, pb, padding, keep);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_kernel_types(q.scalar_type(), pb.dim, [&](auto tag, auto dim) {
    using scalar_t = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const auto kernel = forward_kernel<scalar_t, D>;
    constexpr size_t smem = forward_shared_bytes<D>();
    allow_shared_memory(kernel, smem);
    kernel<<<grid_of(pb), kThreads, smem, stream>>>(h.args, bits(qc), bits(kc), bits(vc),
                                                     mutable_bits(out), lse.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_backward_tensor_core_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, at::IntArrayRef left, at::IntArrayRef right,
    const c10::optional<at::Tensor>& key_padding_mask,
    const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const at::Tensor padding = contiguous_mask(key_padding_mask);
  const at::Tensor keep = contiguous_mask(dropout_keep);
  const BandProblem pb = make_problem(q, k, v, left, right, padding, keep, scale, dropout_p);
  check_supported(q, "banded_backward_tensor_core");
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "banded_backward_tensor_core: grad_out and out must have the shape of q");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(),
              "banded_backward_tensor_core: out must have the dtype of q");
  TORCH_CHECK(grad_out.device() == q.device() && out.device() == q.device() &&
                  lse.device() == q.device(),
              "banded_backward_tensor_core: grad_out, out and lse must be on q's device");
  TORCH_CHECK(lse.sizes() == at::IntArrayRef({pb.batch, pb.heads, pb.length}) &&
                  lse.scalar_type() == at::kFloat,
              "banded_backward_tensor_core: lse must be the (batch, heads, length) float32 "
              "tensor returned by the forward");
  const at::Tensor qc = aligned(q), kc = aligned(k), vc = aligned(v);
  const at::Tensor gc = aligned(grad_out.to(q.scalar_type())), oc = aligned(out);
  const at::Tensor lc = lse.contiguous();
  at::Tensor dq = at::empty(qc.sizes(), qc.options());
  at::Tensor dk = at::empty(qc.sizes(), qc.options());
  at::Tensor dv = at::empty(qc.sizes(), qc.options());
  if (qc.numel() == 0) return {dq, dk, dv};
  at::Tensor delta = at::empty(lc.sizes(), lc.options());
  const HostArgs h = make_args(qc, pb, padding, keep);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_kernel_types(q.scalar_type(), pb.dim, [&](auto tag, auto dim) {
    using scalar_t = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const auto query_kernel = backward_query_kernel<scalar_t, D>;
    constexpr size_t query_smem = query_backward_shared_bytes<D>();
    allow_shared_memory(query_kernel, query_smem);
    query_kernel<<<grid_of(pb), kThreads, query_smem, stream>>>(
        h.args, bits(gc), bits(qc), bits(kc), bits(vc), bits(oc), lc.data_ptr<float>(),
        mutable_bits(dq), delta.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto key_kernel = backward_key_kernel<scalar_t, D>;
    constexpr size_t key_smem = key_backward_shared_bytes<D>();
    allow_shared_memory(key_kernel, key_smem);
    key_kernel<<<grid_of(pb), kThreads, key_smem, stream>>>(
        h.args, bits(gc), bits(qc), bits(kc), bits(vc), lc.data_ptr<float>(),
        delta.data_ptr<float>(), mutable_bits(dk), mutable_bits(dv));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(local_attn, CUDA, m) {
  m.impl("banded_forward_tensor_core", &banded_forward_tensor_core_cuda);
  m.impl("banded_backward_tensor_core", &banded_backward_tensor_core_cuda);
}

}  // namespace local_attn
