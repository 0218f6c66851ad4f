// Block kernels of the banded attention on the CPU.
//
// banded_attention_cpu.cpp includes this file three times, inside three namespaces: for the
// baseline x86-64 ISA, and with BANDED_ISA_ATTR = __attribute__((target(...))) for AVX2+FMA and
// for AVX-512, and picks one at run time. So this file includes no header and calls into no
// other library's templates: everything it defines carries the ISA attribute of its copy, and
// nothing compiled for a wider ISA can leak into code that an older CPU runs.
//
// The unit of work is a block of `rows` consecutive queries of one (batch, head). Its keys
// i - max_left .. i + max_right lie in a window of ny = rows + W - 1 consecutive positions,
// copied once into per-thread buffers (the "key window"; column y is key first - max_left + y,
// zero outside the sequence). Query row x of the block uses columns x + lo .. x + hi of the
// window, with lo = max_left - left[h] and hi = max_left + right[h]. All products are small
// dense kernels over that diagonal strip, with 4 rows x 2 vectors of accumulators in registers.

// Vectors of BANDED_VECTOR_BYTES (32, or 64 for the AVX-512 copy), as GCC vector types: the
// compiler lowers them to whatever the copy's ISA has.
template <typename acc_t>
struct Lanes;

template <>
struct Lanes<float> {
  typedef float vec __attribute__((vector_size(BANDED_VECTOR_BYTES), aligned(4)));
  typedef int32_t ivec __attribute__((vector_size(BANDED_VECTOR_BYTES), aligned(4)));
  static constexpr int64_t count = BANDED_VECTOR_BYTES / 4;
};

template <>
struct Lanes<double> {
  typedef double vec __attribute__((vector_size(BANDED_VECTOR_BYTES), aligned(8)));
  static constexpr int64_t count = BANDED_VECTOR_BYTES / 8;
};

template <typename V, typename T>
BANDED_ISA_ATTR __attribute__((always_inline)) inline V load_vec(const T* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V, typename T>
BANDED_ISA_ATTR __attribute__((always_inline)) inline void store_vec(T* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

BANDED_ISA_ATTR inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
BANDED_ISA_ATTR inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// c[x][y] = sum_{d < depth} a[x][d] * bt[d][y] for x < rows (a multiple of kDotRows) and every
// y in x + lo .. x + hi; whole vectors are computed, so a few columns past hi are written as
// well (the buffers leave room for them). Eight accumulators hide the FMA latency: 4 rows x 2
// vectors, or 8 rows x 1 vector where vectors are so wide that 2 of them would compute too
// many columns outside the band.
constexpr int64_t kDotRows = 8;

template <typename acc_t>
BANDED_ISA_ATTR void band_dots(const acc_t* a, int64_t lda, const acc_t* bt, int64_t ldb,
                               int64_t depth, int64_t rows, int64_t lo, int64_t hi, acc_t* c,
                               int64_t ldc) {
  using V = typename Lanes<acc_t>::vec;
  constexpr int64_t L = Lanes<acc_t>::count;
  constexpr int kCols = L >= 16 ? 1 : 2;
  constexpr int kRows = 8 / kCols;
  for (int64_t x0 = 0; x0 < rows; x0 += kRows) {
    const acc_t* a0 = a + x0 * lda;
    for (int64_t y = x0 + lo; y <= x0 + kRows - 1 + hi; y += kCols * L) {
      V acc[kRows][kCols] = {};
      const acc_t* b = bt + y;
      for (int64_t d = 0; d < depth; ++d, b += ldb) {
        V bv[kCols];
#pragma GCC unroll 2
        for (int j = 0; j < kCols; ++j) bv[j] = load_vec<V>(b + j * L);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const acc_t av = a0[r * lda + d];
#pragma GCC unroll 2
          for (int j = 0; j < kCols; ++j) acc[r][j] += av * bv[j];
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
        for (int j = 0; j < kCols; ++j) store_vec(c + (x0 + r) * ldc + y + j * L, acc[r][j]);
      }
    }
  }
}

// c[x][:width] = sum_y P(x, y) * m[y][:width] over y in x + lo .. x + hi clipped to [0, inner),
// for x < rows (a multiple of 4), where P(x, y) = p[x * p_row + y * p_col]: p_col = 1 reads p
// as it is, p_row = 1 reads its transpose. P must be zero outside each row's own range,
// because the 4 rows of a group share the union of their ranges. width is a multiple of 2
// vectors.
template <typename acc_t>
BANDED_ISA_ATTR void band_combine(const acc_t* p, int64_t p_row, int64_t p_col, const acc_t* m,
                                  int64_t ldm, int64_t width, int64_t rows, int64_t inner,
                                  int64_t lo, int64_t hi, acc_t* c, int64_t ldc) {
  using V = typename Lanes<acc_t>::vec;
  constexpr int64_t L = Lanes<acc_t>::count;
  for (int64_t x0 = 0; x0 < rows; x0 += 4) {
    const int64_t y_begin = imax(0, x0 + lo), y_end = imin(inner, x0 + 4 + hi);
    const acc_t* p0 = p + x0 * p_row;
    const acc_t* p1 = p0 + p_row;
    const acc_t* p2 = p1 + p_row;
    const acc_t* p3 = p2 + p_row;
    for (int64_t col = 0; col < width; col += 2 * L) {
      V c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {}, c30 = {}, c31 = {};
      for (int64_t y = y_begin; y < y_end; ++y) {
        const acc_t* row = m + y * ldm + col;
        const V m0 = load_vec<V>(row), m1 = load_vec<V>(row + L);
        const int64_t at = y * p_col;
        c00 += p0[at] * m0;
        c01 += p0[at] * m1;
        c10 += p1[at] * m0;
        c11 += p1[at] * m1;
        c20 += p2[at] * m0;
        c21 += p2[at] * m1;
        c30 += p3[at] * m0;
        c31 += p3[at] * m1;
      }
      acc_t* out = c + x0 * ldc + col;
      store_vec(out, c00);
      store_vec(out + L, c01);
      store_vec(out + ldc, c10);
      store_vec(out + ldc + L, c11);
      store_vec(out + 2 * ldc, c20);
      store_vec(out + 2 * ldc + L, c21);
      store_vec(out + 3 * ldc, c30);
      store_vec(out + 3 * ldc + L, c31);
    }
  }
}

// t[i] = exp(t[i]) for i < n (n a multiple of the vector length). The float version is a
// vectorised Cephes-style polynomial (about 2 ulp): the scalar libm call per band entry would
// cost as much as the dot products. Inputs are clamped to [-87, 88], so callers zero the
// entries of masked keys themselves.
BANDED_ISA_ATTR inline void exp_inplace(float* t, int64_t n) {
  using V = Lanes<float>::vec;
  using VI = Lanes<float>::ivec;
  for (int64_t i = 0; i < n; i += Lanes<float>::count) {
    V x = load_vec<V>(t + i);
    x = x < -87.0f ? V{} - 87.0f : x;
    x = x > 88.0f ? V{} + 88.0f : x;
    // x = n ln2 + r with |r| <= ln2 / 2; exp(x) = 2^n exp(r).
    V fn = x * 1.44269504088896341f + 0.5f;
    V whole = __builtin_convertvector(__builtin_convertvector(fn, VI), V);
    fn = whole > fn ? whole - 1.0f : whole;
    x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    const V z = x * x;
    V y = x * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    const VI exponent = (__builtin_convertvector(fn, VI) + 127) << 23;
    V pow2n;
    __builtin_memcpy(&pow2n, &exponent, sizeof(V));
    store_vec(t + i, y * pow2n);
  }
}

BANDED_ISA_ATTR inline void exp_inplace(double* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) t[i] = std::exp(t[i]);
}

template <typename scalar_t, typename acc_t>
BANDED_ISA_ATTR void load_rows(const scalar_t* src, int64_t n, int64_t dim, int64_t ld,
                               acc_t* dst) {
  for (int64_t x = 0; x < n; ++x) {
    for (int64_t d = 0; d < dim; ++d) dst[x * ld + d] = static_cast<acc_t>(src[x * dim + d]);
  }
}

// The key window of one (batch, head) as rows: row y (of ld values) is key key0 + y, zero
// outside the sequence (masked keys get weight 0, and 0 * stale could be NaN).
template <typename scalar_t, typename acc_t>
BANDED_ISA_ATTR void load_window_rows(const scalar_t* src, int64_t key0, int64_t ny,
                                      int64_t length, int64_t dim, acc_t* rows, int64_t ld) {
  const int64_t y_begin = imax(0, -key0), y_end = imin(ny, length - key0);
  for (int64_t y = 0; y < ny; ++y) {
    acc_t* dst = rows + y * ld;
    if (y < y_begin || y >= y_end) {
      for (int64_t d = 0; d < dim; ++d) dst[d] = acc_t(0);
      continue;
    }
    const scalar_t* s = src + (key0 + y) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<acc_t>(s[d]);
  }
}

// The key window transposed: cols[d * ldt + y] is feature d of key key0 + y. Columns outside
// the sequence are left as they are: they only produce logits of masked keys, never read.
template <typename scalar_t, typename acc_t>
BANDED_ISA_ATTR void load_window_cols(const scalar_t* src, int64_t key0, int64_t ny,
                                      int64_t length, int64_t dim, acc_t* cols, int64_t ldt) {
  const int64_t y_begin = imax(0, -key0), y_end = imin(ny, length - key0);
  const scalar_t* s = src + key0 * dim;
  for (int64_t d = 0; d < dim; ++d) {
    acc_t* dst = cols + d * ldt;
    for (int64_t y = y_begin; y < y_end; ++y) dst[y] = static_cast<acc_t>(s[y * dim + d]);
  }
}

// Zero the columns of rows 0 .. rows - 1 of a probability strip that the combine kernels may
// read: row x's own band widened by 3 on each side (the reach of a group of 4 rows or keys).
template <typename acc_t>
BANDED_ISA_ATTR void clear_strip(acc_t* strip, int64_t ld, int64_t rows, int64_t lo,
                                 int64_t hi) {
  for (int64_t x = 0; x < rows; ++x) {
    const int64_t begin = imax(0, x + lo - 3), end = imin(ld, x + hi + 4);
    for (int64_t y = begin; y < end; ++y) strip[x * ld + y] = acc_t(0);
  }
}

// Which window columns are real keys: inside the sequence and not padding.
BANDED_ISA_ATTR inline void mark_keys(const BandProblem& pb, int64_t batch, int64_t key0,
                                      int64_t ny, unsigned char* key_ok) {
  const bool* pad = pb.key_padding ? pb.key_padding + batch * pb.length : nullptr;
  for (int64_t y = 0; y < ny; ++y) {
    const int64_t j = key0 + y;
    key_ok[y] = j >= 0 && j < pb.length && !(pad && pad[j]);
  }
}

// Columns of row x that can hold an allowed key (band of the head, clipped to the window).
struct RowSpan {
  int64_t begin, end;  // [begin, end) in window columns
};

BANDED_ISA_ATTR inline RowSpan row_span(int64_t x, int64_t lo, int64_t hi, int64_t key0,
                                        int64_t length) {
  return {imax(x + lo, -key0), imin(x + hi + 1, length - key0)};
}

// Multiplier of the weight in band column c of query i: the dropout keep-mask times 1/(1-p).
BANDED_ISA_ATTR inline double keep_factor(const BandProblem& pb, int64_t bh, int64_t i,
                                          int64_t c) {
  if (!pb.keep) return 1.0;
  return pb.keep[(bh * pb.length + i) * pb.width() + c] ? pb.keep_scale : 0.0;
}

// Softmax of window row x of the logits (scaled by pb.scale) into t[0 .. span length),
// zero for masked keys. Returns the row's log-sum-exp, -inf when no key is allowed, NaN when
// an allowed logit is NaN (a NaN or inf in q or k): then every allowed weight is NaN, as a
// softmax over such a row gives on the other routes, not the zeros of a row without keys.
template <typename acc_t>
BANDED_ISA_ATTR acc_t row_softmax(const acc_t* logits, const unsigned char* key_ok, RowSpan span,
                                  acc_t scale, acc_t* t) {
  constexpr int64_t L = Lanes<acc_t>::count;
  const acc_t neg_inf = -__builtin_inf();
  acc_t row_max = neg_inf;
  bool nan_logit = false;
  for (int64_t y = span.begin; y < span.end; ++y) {
    if (!key_ok[y]) continue;
    const acc_t z = logits[y] * scale;
    if (z > row_max) {
      row_max = z;
    } else if (z != z) {
      nan_logit = true;
    }
  }
  if (nan_logit) {
    const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
    for (int64_t k = 0; k < span.end - span.begin; ++k) {
      t[k] = key_ok[span.begin + k] ? nan : acc_t(0);
    }
    return nan;
  }
  if (row_max == neg_inf) return neg_inf;
  const int64_t n = span.end - span.begin, padded = (n + L - 1) / L * L;
  for (int64_t k = 0; k < padded; ++k) {
    const int64_t y = span.begin + k;
    t[k] = k < n && key_ok[y] ? logits[y] * scale - row_max : acc_t(-100);
  }
  exp_inplace(t, padded);
  acc_t sum = 0;
  for (int64_t k = 0; k < n; ++k) {
    t[k] = key_ok[span.begin + k] ? t[k] : acc_t(0);
    sum += t[k];
  }
  const acc_t inv = acc_t(1) / sum;
  for (int64_t k = 0; k < n; ++k) t[k] *= inv;
  return row_max + std::log(sum);
}

// Probabilities of row x recomputed from its log-sum-exp (backward), zero for masked keys.
template <typename acc_t>
BANDED_ISA_ATTR void row_probs(const acc_t* logits, const unsigned char* key_ok, RowSpan span,
                               acc_t scale, acc_t lse, acc_t* t) {
  constexpr int64_t L = Lanes<acc_t>::count;
  const int64_t n = span.end - span.begin, padded = (n + L - 1) / L * L;
  for (int64_t k = 0; k < padded; ++k) {
    const int64_t y = span.begin + k;
    t[k] = k < n && key_ok[y] ? logits[y] * scale - lse : acc_t(-100);
  }
  exp_inplace(t, padded);
  for (int64_t k = 0; k < n; ++k) t[k] = key_ok[span.begin + k] ? t[k] : acc_t(0);
}

// Queries first .. first + n - 1 of (batch, head) bh: output rows and log-sum-exp.
template <typename scalar_t, typename acc_t>
BANDED_ISA_ATTR void forward_block(const BandProblem& pb, const CpuGeometry& g,
                                   const Workspace<acc_t>& ws, int64_t bh, int64_t first,
                                   const scalar_t* q, const scalar_t* k, const scalar_t* v,
                                   scalar_t* out, acc_t* lse) {
  const int64_t T = pb.length, D = pb.dim, Dp = g.dim_padded, ld = g.key_cols;
  const int64_t h = bh % pb.heads, n = imin(g.block_rows, T - first);
  const int64_t rows = (n + kDotRows - 1) / kDotRows * kDotRows;
  const int64_t ny = n + pb.width() - 1, key0 = first - pb.max_left;
  const int64_t lo = pb.max_left - pb.left[h], hi = pb.max_left + pb.right[h];
  const int64_t base = bh * T * D;
  load_rows(q + base + first * D, n, D, Dp, ws.q);
  load_window_cols(k + base, key0, ny, T, D, ws.kt, ld);
  load_window_rows(v + base, key0, ny, T, D, ws.vb, Dp);
  clear_strip(ws.p, ld, rows, lo, hi);
  mark_keys(pb, bh / pb.heads, key0, ny, ws.key_ok);
  band_dots(ws.q, Dp, ws.kt, ld, D, rows, lo, hi, ws.s, ld);
  for (int64_t x = 0; x < n; ++x) {
    const RowSpan span = row_span(x, lo, hi, key0, T);
    const acc_t row_lse = row_softmax(ws.s + x * ld, ws.key_ok, span, acc_t(pb.scale), ws.t);
    lse[bh * T + first + x] = row_lse;
    if (row_lse == -__builtin_inf()) continue;
    acc_t* p = ws.p + x * ld;
    for (int64_t y = span.begin; y < span.end; ++y) {
      p[y] = ws.t[y - span.begin] * acc_t(keep_factor(pb, bh, first + x, y - x));
    }
  }
  band_combine(ws.p, ld, 1, ws.vb, Dp, Dp, rows, ny, lo, hi, ws.o, Dp);
  scalar_t* dst = out + base + first * D;
  for (int64_t x = 0; x < n; ++x) {
    for (int64_t d = 0; d < D; ++d) dst[x * D + d] = static_cast<scalar_t>(ws.o[x * Dp + d]);
  }
}

// Backward of one query block: dq of its rows, and its contributions to dk and dv of the
// keys of its window, added into the accumulators (the caller runs blocks whose windows
// overlap in different phases, so no two threads add to the same key).
template <typename scalar_t, typename acc_t>
BANDED_ISA_ATTR void backward_block(const BandProblem& pb, const CpuGeometry& g,
                                    const Workspace<acc_t>& ws, int64_t bh, int64_t first,
                                    const scalar_t* grad_out, const scalar_t* q,
                                    const scalar_t* k, const scalar_t* v, const scalar_t* out,
                                    const acc_t* lse, scalar_t* dq, acc_t* dk_acc,
                                    acc_t* dv_acc) {
  const int64_t T = pb.length, D = pb.dim, Dp = g.dim_padded, ld = g.key_cols;
  const int64_t h = bh % pb.heads, n = imin(g.block_rows, T - first);
  const int64_t rows = (n + kDotRows - 1) / kDotRows * kDotRows;
  const int64_t ny = n + pb.width() - 1, ny4 = (ny + 3) / 4 * 4, key0 = first - pb.max_left;
  const int64_t lo = pb.max_left - pb.left[h], hi = pb.max_left + pb.right[h];
  const int64_t base = bh * T * D;
  const acc_t scale = acc_t(pb.scale);
  load_rows(q + base + first * D, n, D, Dp, ws.q);
  load_rows(grad_out + base + first * D, n, D, Dp, ws.dout);
  load_window_cols(k + base, key0, ny, T, D, ws.kt, ld);
  load_window_rows(k + base, key0, ny, T, D, ws.kb, Dp);
  load_window_cols(v + base, key0, ny, T, D, ws.vt, ld);
  clear_strip(ws.p, ld, rows, lo, hi);
  clear_strip(ws.ds, ld, rows, lo, hi);
  mark_keys(pb, bh / pb.heads, key0, ny, ws.key_ok);
  band_dots(ws.q, Dp, ws.kt, ld, D, rows, lo, hi, ws.s, ld);
  band_dots(ws.dout, Dp, ws.vt, ld, D, rows, lo, hi, ws.dp, ld);
  for (int64_t x = 0; x < n; ++x) {
    const int64_t i = first + x;
    const acc_t row_lse = lse[bh * T + i];
    if (row_lse == -__builtin_inf()) continue;  // no allowed key: no gradient either
    // delta = sum_c P_c dP_c = dO . out, also with dropout (out already carries the mask).
    acc_t delta = 0;
    for (int64_t d = 0; d < D; ++d) delta += ws.dout[x * Dp + d] * acc_t(out[base + i * D + d]);
    const RowSpan span = row_span(x, lo, hi, key0, T);
    row_probs(ws.s + x * ld, ws.key_ok, span, scale, row_lse, ws.t);
    const acc_t* dp = ws.dp + x * ld;
    acc_t* kept = ws.p + x * ld;
    acc_t* ds = ws.ds + x * ld;
    for (int64_t y = span.begin; y < span.end; ++y) {
      const acc_t prob = ws.t[y - span.begin];
      const acc_t factor = acc_t(keep_factor(pb, bh, i, y - x));
      kept[y] = prob * factor;
      ds[y] = prob * (dp[y] * factor - delta) * scale;
    }
  }
  band_combine(ws.ds, ld, 1, ws.kb, Dp, Dp, rows, ny, lo, hi, ws.o, Dp);
  scalar_t* dq_rows = dq + base + first * D;
  for (int64_t x = 0; x < n; ++x) {
    for (int64_t d = 0; d < D; ++d) dq_rows[x * D + d] = static_cast<scalar_t>(ws.o[x * Dp + d]);
  }
  // Key side, reading the strips transposed: key y of the window is used by rows y - hi .. y - lo.
  band_combine(ws.ds, 1, ld, ws.q, Dp, Dp, ny4, n, -hi, -lo, ws.kw, Dp);
  band_combine(ws.p, 1, ld, ws.dout, Dp, Dp, ny4, n, -hi, -lo, ws.vw, Dp);
  const int64_t y_begin = imax(0, -key0), y_end = imin(ny, T - key0);
  for (int64_t y = y_begin; y < y_end; ++y) {
    if (!ws.key_ok[y]) continue;
    acc_t* dk_row = dk_acc + base + (key0 + y) * D;
    acc_t* dv_row = dv_acc + base + (key0 + y) * D;
    for (int64_t d = 0; d < D; ++d) {
      dk_row[d] += ws.kw[y * Dp + d];
      dv_row[d] += ws.vw[y * Dp + d];
    }
  }
}
