// CPU kernels of the banded attention: per-thread buffers, the parallel loops over
// (batch * head, query block), and the run-time choice between three copies of the block
// kernels, for the baseline x86-64 ISA, AVX2+FMA and AVX-512 (the build uses portable flags, so
// the wide-vector copies are selected by asking the CPU, not by -march).
#include "banded_attention.h"

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace local_attn {

// Sizes shared by every block of one call.
struct CpuGeometry {
  int64_t block_rows;  // queries per block, a multiple of 4
  int64_t dim_padded;  // head dim rounded up to two vectors
  int64_t key_cols;    // capacity of a key window: block_rows + W - 1 plus room for over-reads
};

// Per-thread scratch of a block (see banded_cpu_kernels.h for the layouts).
template <typename acc_t>
struct Workspace {
  acc_t *q, *dout, *kt, *vt, *kb, *vb, *s, *dp, *p, *ds, *o, *kw, *vw, *t;
  unsigned char* key_ok;
};

namespace baseline {
#define BANDED_ISA_ATTR
#define BANDED_VECTOR_BYTES 32
#include "banded_cpu_kernels.h"
#undef BANDED_VECTOR_BYTES
#undef BANDED_ISA_ATTR
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__)
#define LOCAL_ATTN_HAVE_X86_COPIES 1
namespace avx2 {
#define BANDED_ISA_ATTR __attribute__((target("avx2,fma")))
#define BANDED_VECTOR_BYTES 32
#include "banded_cpu_kernels.h"
#undef BANDED_VECTOR_BYTES
#undef BANDED_ISA_ATTR
}  // namespace avx2

namespace avx512 {
#define BANDED_ISA_ATTR __attribute__((target("avx512f,avx2,fma")))
#define BANDED_VECTOR_BYTES 64
#include "banded_cpu_kernels.h"
#undef BANDED_VECTOR_BYTES
#undef BANDED_ISA_ATTR
}  // namespace avx512
#endif

namespace {

constexpr int64_t kBlockRows = 64;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

enum class Isa { baseline, avx2, avx512 };

int64_t vector_bytes(Isa isa) { return isa == Isa::avx512 ? 64 : 32; }

template <typename acc_t>
CpuGeometry make_geometry(const BandProblem& pb, Isa isa) {
  const int64_t lanes = vector_bytes(isa) / static_cast<int64_t>(sizeof(acc_t));
  CpuGeometry g;
  g.block_rows = std::min(kBlockRows, round_up(pb.length, 8));  // kDotRows divides it
  g.dim_padded = round_up(pb.dim, 2 * lanes);
  g.key_cols = round_up(g.block_rows + pb.width() + 2 * lanes, 2 * lanes);
  return g;
}

// Buffers carved out of one zero-filled allocation per thread; the block kernels clear what
// they rely on being zero. Allocated through c10's CPU allocator, so that torch's memory
// profiler sees them like any tensor.
template <typename acc_t>
class WorkspaceStorage {
 public:
  WorkspaceStorage(const CpuGeometry& g, bool backward) {
    const int64_t rows = g.block_rows, Dp = g.dim_padded, ld = g.key_cols;
    const int64_t row_block = rows * Dp, window = ld * Dp, strip = rows * ld;
    const int64_t sizes[] = {
        row_block,                 // q
        backward ? row_block : 0,  // dout
        window,                    // kt
        backward ? window : 0,     // vt
        backward ? window : 0,     // kb
        backward ? 0 : window,     // vb
        strip,                     // s
        backward ? strip : 0,      // dp
        strip,                     // p
        backward ? strip : 0,      // ds
        row_block,                 // o
        backward ? window : 0,     // kw
        backward ? window : 0,     // vw
        ld + 16,                   // t
    };
    int64_t total = 0;
    for (int64_t size : sizes) total += size;
    data_ = c10::GetCPUAllocator()->allocate(total * sizeof(acc_t));
    std::memset(data_.get(), 0, total * sizeof(acc_t));
    flags_.assign(ld, 0);
    acc_t** slots[] = {&view.q, &view.dout, &view.kt, &view.vt, &view.kb, &view.vb, &view.s,
                       &view.dp, &view.p, &view.ds, &view.o, &view.kw, &view.vw, &view.t};
    acc_t* next = static_cast<acc_t*>(data_.get());
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
      *slots[i] = sizes[i] ? next : nullptr;
      next += sizes[i];
    }
    view.key_ok = flags_.data();
  }

  Workspace<acc_t> view;

 private:
  c10::DataPtr data_;
  std::vector<unsigned char> flags_;
};

// Blocks per parallel task, so that a task has about a million multiply-adds (tens of
// microseconds): smaller problems (short sentences, gradcheck) run on one thread, because waking
// the pool costs more than their work, and far more on a busy machine.
int64_t grain_size(const CpuGeometry& g, const BandProblem& pb) {
  constexpr int64_t kMinTaskWork = int64_t(1) << 20;  // multiply-adds
  const int64_t block_work = g.block_rows * pb.width() * std::max<int64_t>(pb.dim, 1);
  return std::max<int64_t>(1, kMinTaskWork / block_work);
}

// Runs work(workspace, item) for every item in [0, count) on torch's intra-op threads. Items are
// handed out one at a time from a shared counter rather than split in equal shares up front:
// on a shared machine one thread may be descheduled for a while, and the others then take
// over its blocks instead of waiting for it.
template <typename acc_t, typename Work>
void run_blocks(const CpuGeometry& g, bool backward, int64_t count, int64_t grain,
                const Work& work) {
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (count + grain - 1) / grain);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(tasks, 1), 1, [&](int64_t, int64_t) {
    WorkspaceStorage<acc_t> ws(g, backward);
    for (int64_t item = next++; item < count; item = next++) work(ws.view, item);
  });
}

Isa widest_supported_isa() {
#ifdef LOCAL_ATTN_HAVE_X86_COPIES
  const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2_fma && __builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (avx2_fma) return Isa::avx2;
#endif
  return Isa::baseline;
}

// The widest copy this CPU runs, or a narrower one named by LOCAL_ATTN_CPU_ISA (baseline, avx2).
Isa cpu_isa() {
  static const Isa supported = widest_supported_isa();
  const char* forced = std::getenv("LOCAL_ATTN_CPU_ISA");
  if (forced && std::strcmp(forced, "baseline") == 0) return Isa::baseline;
  if (forced && std::strcmp(forced, "avx2") == 0 && supported != Isa::baseline) return Isa::avx2;
  return supported;
}

template <typename scalar_t, typename acc_t>
using ForwardBlock = void (*)(const BandProblem&, const CpuGeometry&, const Workspace<acc_t>&,
                              int64_t, int64_t, const scalar_t*, const scalar_t*,
                              const scalar_t*, scalar_t*, acc_t*);

template <typename scalar_t, typename acc_t>
using BackwardBlock = void (*)(const BandProblem&, const CpuGeometry&, const Workspace<acc_t>&,
                               int64_t, int64_t, const scalar_t*, const scalar_t*,
                               const scalar_t*, const scalar_t*, const scalar_t*, const acc_t*,
                               scalar_t*, acc_t*, acc_t*);

template <typename scalar_t, typename acc_t>
ForwardBlock<scalar_t, acc_t> pick_forward(Isa isa) {
#ifdef LOCAL_ATTN_HAVE_X86_COPIES
  if (isa == Isa::avx512) return &avx512::forward_block<scalar_t, acc_t>;
  if (isa == Isa::avx2) return &avx2::forward_block<scalar_t, acc_t>;
#endif
  return &baseline::forward_block<scalar_t, acc_t>;
}

template <typename scalar_t, typename acc_t>
BackwardBlock<scalar_t, acc_t> pick_backward(Isa isa) {
#ifdef LOCAL_ATTN_HAVE_X86_COPIES
  if (isa == Isa::avx512) return &avx512::backward_block<scalar_t, acc_t>;
  if (isa == Isa::avx2) return &avx2::backward_block<scalar_t, acc_t>;
#endif
  return &baseline::backward_block<scalar_t, acc_t>;
}

}  // namespace

const char* cpu_isa_name() {
  switch (cpu_isa()) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

template <typename scalar_t, typename acc_t>
void forward_cpu(const BandProblem& pb, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                 scalar_t* out, acc_t* lse) {
  if (pb.batch_heads() == 0 || pb.length == 0) return;
  const Isa isa = cpu_isa();
  const CpuGeometry g = make_geometry<acc_t>(pb, isa);
  const int64_t blocks = (pb.length + g.block_rows - 1) / g.block_rows;
  const auto block_fn = pick_forward<scalar_t, acc_t>(isa);
  run_blocks<acc_t>(g, /*backward=*/false, pb.batch_heads() * blocks, grain_size(g, pb),
                    [&](const Workspace<acc_t>& ws, int64_t item) {
                      const int64_t first = (item % blocks) * g.block_rows;
                      block_fn(pb, g, ws, item / blocks, first, q, k, v, out, lse);
                    });
}

// Blocks b and b + phases have disjoint key windows, so each phase runs its blocks in parallel
// and adds into dk/dv without atomics (and deterministically).
template <typename scalar_t, typename acc_t>
void backward_cpu(const BandProblem& pb, const scalar_t* grad_out, const scalar_t* q,
                  const scalar_t* k, const scalar_t* v, const scalar_t* out, const acc_t* lse,
                  scalar_t* dq, acc_t* dk_acc, acc_t* dv_acc) {
  if (pb.batch_heads() == 0 || pb.length == 0) return;
  const Isa isa = cpu_isa();
  const CpuGeometry g = make_geometry<acc_t>(pb, isa);
  const int64_t blocks = (pb.length + g.block_rows - 1) / g.block_rows;
  const int64_t phases = 1 + (pb.width() - 1 + g.block_rows - 1) / g.block_rows;
  const auto block_fn = pick_backward<scalar_t, acc_t>(isa);
  const int64_t grain = grain_size(g, pb);
  for (int64_t phase = 0; phase < std::min(phases, blocks); ++phase) {
    const int64_t per_head = (blocks - phase + phases - 1) / phases;
    run_blocks<acc_t>(g, /*backward=*/true, pb.batch_heads() * per_head, grain,
                      [&](const Workspace<acc_t>& ws, int64_t item) {
                        const int64_t block = phase + (item % per_head) * phases;
                        block_fn(pb, g, ws, item / per_head, block * g.block_rows, grad_out, q,
                                 k, v, out, lse, dq, dk_acc, dv_acc);
                      });
  }
}

#define LOCAL_ATTN_INSTANTIATE(scalar_t, acc_t)                                              \
  template void forward_cpu<scalar_t, acc_t>(const BandProblem&, const scalar_t*,           \
                                             const scalar_t*, const scalar_t*, scalar_t*,   \
                                             acc_t*);                                       \
  template void backward_cpu<scalar_t, acc_t>(                                              \
      const BandProblem&, const scalar_t*, const scalar_t*, const scalar_t*, const scalar_t*, \
      const scalar_t*, const acc_t*, scalar_t*, acc_t*, acc_t*);

LOCAL_ATTN_INSTANTIATE(float, float)
LOCAL_ATTN_INSTANTIATE(double, double)
LOCAL_ATTN_INSTANTIATE(c10::BFloat16, float)
LOCAL_ATTN_INSTANTIATE(c10::Half, float)

}  // namespace local_attn
