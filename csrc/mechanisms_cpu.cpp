// CPU operators of two locality mechanisms, each one C++ call forward and one backward: Yang et
// al.'s Gaussian localness bias, Nguyen et al.'s dynamic window mask and the additive window's
// term made from it, the dense attention that takes these terms, and that attention with a
// Gaussian or a window layer's mechanism under its own autograd node. At the lengths where
// translation trains, the dozens of small PyTorch operations these mechanisms are made of cost
// more than the attention they modify (docs/banded_attention.md, "Cost per call"); here the
// products go to ATen and the elementwise work to one loop per attention row.
//
// locality/gaussian.py and locality/dynamic_window.py define the mechanisms and compute them on
// every other device and dtype; ops/mechanisms.py says when these operators are used, and the
// tests hold them to the PyTorch definitions, outputs and gradients.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "operator_autograd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace local_attn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// An operator of this file for its Autograd kernel: the argument positions that take
// gradients, and what computes the second derivatives its kernels refuse.
OperatorInfo mechanism_operator(const std::string& name, std::vector<int64_t> differentiable) {
  return {"local_attn::" + name, "local_attn::" + name + "_backward", std::move(differentiable),
          "LOCAL_ATTN_MECHANISM_IMPL=torch"};
}

using NamedTensor = std::pair<const at::Tensor*, const char*>;

// CPU tensors of one floating dtype, float32 or float64 (the tests' gradient checks).
template <size_t N>
void check_cpu_floats(const NamedTensor (&inputs)[N], const char* op) {
  const at::ScalarType dtype = inputs[0].first->scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, op, ": ", inputs[0].second,
              " must be float32 or float64, got ", dtype);
  for (const auto& [t, name] : inputs) {
    TORCH_CHECK(t->device().is_cpu(), op, ": ", name, " must be a CPU tensor");
    TORCH_CHECK(t->scalar_type() == dtype, op, ": ", name, " must be ", dtype, " like ",
                inputs[0].second, ", got ", t->scalar_type());
  }
}

// Rows of (rows, inner) work, split over threads in chunks worth at least a few thousand
// elements each (a thread per row would cost more than the row at these sizes).
template <typename F>
void for_rows(int64_t rows, int64_t inner, const F& body) {
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(inner, 1));
  at::parallel_for(0, rows, grain, body);
}

bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A row of a (B, heads, T, ...) layout: its batch, head and query.
struct Row {
  int64_t b, h, t;
  Row(int64_t row, int64_t heads, int64_t tgt_len)
      : b(row / (heads * tgt_len)), h((row / tgt_len) % heads), t(row % tgt_len) {}
};

// ---------------------------------------------------------------------------------------------
// Gaussian localness (Yang et al. 2018, Eqs. 6-9 and 11):
//   hidden = tanh(query W_p^T), p = hidden U_p^T, z = hidden U_d^T,
//   P = span * sigmoid(p),
//   D = length * sigmoid(z) + window_offset   (query strategy: U_d given), or
//   D = window[h]                             (fixed and head strategies: the windows given),
//   out[b, h, i, j] = logits[b, h, i, j] - (positions[b, j] - P)^2 * 2 / max(D, min_window)^2.
// The two products are ATen's; everything else is one loop over the rows (b, h, i).

template <typename scalar_t>
scalar_t sigmoid_of(scalar_t x) {
  return scalar_t(1) / (scalar_t(1) + std::exp(-x));
}

// A (B, T) tensor read through its strides (span and length are often expanded views).
template <typename scalar_t>
struct PerQuery {
  const scalar_t* data;
  int64_t batch_stride, query_stride;
  scalar_t operator()(int64_t b, int64_t t) const {
    return data[b * batch_stride + t * query_stride];
  }
};

template <typename scalar_t>
PerQuery<scalar_t> per_query(const at::Tensor& t) {
  return {t.data_ptr<scalar_t>(), t.stride(0), t.stride(1)};
}

struct LocalnessGeometry {
  int64_t bsz, heads, tgt_len, src_len, scores_width;  // scores_width: H, or 2H with U_d
  bool window_given;
  double window_offset, min_window;
};

template <typename scalar_t>
void localness_forward_rows(const LocalnessGeometry& g, const scalar_t* scores,
                            PerQuery<scalar_t> span, PerQuery<scalar_t> length,
                            const scalar_t* window, const scalar_t* positions,
                            const scalar_t* logits, scalar_t* centre_out, scalar_t* window_out,
                            scalar_t* out) {
  const scalar_t min_window = static_cast<scalar_t>(g.min_window);
  const scalar_t offset = static_cast<scalar_t>(g.window_offset);
  for_rows(g.bsz * g.heads * g.tgt_len, g.src_len, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const auto [b, h, t] = Row(row, g.heads, g.tgt_len);
      const scalar_t* score = scores + (b * g.tgt_len + t) * g.scores_width;
      const scalar_t c = span(b, t) * sigmoid_of(score[h]);
      const scalar_t d = g.window_given ? window[h]
                                        : length(b, t) * sigmoid_of(score[g.heads + h]) + offset;
      centre_out[row] = c;
      window_out[row] = d;
      const scalar_t clamped = std::max(d, min_window);
      const scalar_t scale = scalar_t(-2) / (clamped * clamped);
      const scalar_t* pos = positions + b * g.src_len;
      const scalar_t* l = logits ? logits + row * g.src_len : nullptr;
      scalar_t* o = out + row * g.src_len;
      for (int64_t j = 0; j < g.src_len; ++j) {
        const scalar_t offset_j = pos[j] - c;
        o[j] = (l ? l[j] : scalar_t(0)) + offset_j * offset_j * scale;
      }
    }
  });
}

// The gradient of the scores (p and z, (B T, scores_width)) from that of out, and of each row's
// given window (B, H, T).
template <typename scalar_t>
void localness_backward_rows(const LocalnessGeometry& g, const scalar_t* grad,
                             const scalar_t* scores, PerQuery<scalar_t> span,
                             PerQuery<scalar_t> length, const scalar_t* positions,
                             const scalar_t* centre, const scalar_t* window,
                             scalar_t* grad_scores, scalar_t* grad_window_rows) {
  const scalar_t min_window = static_cast<scalar_t>(g.min_window);
  for_rows(g.bsz * g.heads * g.tgt_len, g.src_len, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const auto [b, h, t] = Row(row, g.heads, g.tgt_len);
      const scalar_t* pos = positions + b * g.src_len;
      const scalar_t* gr = grad + row * g.src_len;
      const scalar_t c = centre[row];
      const scalar_t d = std::max(window[row], min_window);
      double sum_g_offset = 0, sum_g_offset_sq = 0;
      for (int64_t j = 0; j < g.src_len; ++j) {
        const double offset_j = pos[j] - c;
        sum_g_offset += gr[j] * offset_j;
        sum_g_offset_sq += gr[j] * offset_j * offset_j;
      }
      // out = logits + offset^2 * s with s = -2 / d^2: d out / d P = -2 offset s, and
      // d out / d d = offset^2 * 4 / d^3 (none where clamp_min held d at min_window)
      const double grad_c = 4.0 * sum_g_offset / (double(d) * d);
      const double grad_d =
          window[row] < min_window ? 0.0 : sum_g_offset_sq * 4.0 / (double(d) * d * d);
      scalar_t* grad_score = grad_scores + (b * g.tgt_len + t) * g.scores_width;
      const scalar_t sig_p = sigmoid_of(scores[(b * g.tgt_len + t) * g.scores_width + h]);
      grad_score[h] = static_cast<scalar_t>(grad_c * span(b, t) * sig_p * (1 - sig_p));
      if (g.window_given) {
        grad_window_rows[row] = static_cast<scalar_t>(grad_d);
      } else {
        const scalar_t sig_z =
            sigmoid_of(scores[(b * g.tgt_len + t) * g.scores_width + g.heads + h]);
        grad_score[g.heads + h] =
            static_cast<scalar_t>(grad_d * length(b, t) * sig_z * (1 - sig_z));
      }
    }
  });
}

struct LocalnessForward {
  at::Tensor out, centre, window, query2d, u, hidden, scores;
};

LocalnessForward localness_forward(const at::Tensor& query, const at::Tensor& w_p,
                                   const at::Tensor& u_p, const c10::optional<at::Tensor>& u_d,
                                   const at::Tensor& span, const at::Tensor& length,
                                   const at::Tensor& positions,
                                   const c10::optional<at::Tensor>& window,
                                   const c10::optional<at::Tensor>& logits, double window_offset,
                                   double min_window) {
  const char* op = "local_attn::gaussian_localness";
  const NamedTensor inputs[] = {{&query, "query"}, {&w_p, "w_p"},   {&u_p, "u_p"},
                                {&span, "span"},   {&length, "length"}, {&positions, "positions"}};
  check_cpu_floats(inputs, op);
  const bool window_given = given(window);
  TORCH_CHECK(window_given != given(u_d), op,
              ": give U_d (windows from the queries) or the windows, not both");
  TORCH_CHECK(query.dim() == 3 && positions.dim() == 2 && span.dim() == 2 && length.dim() == 2,
              op, ": expected query (B, T, d), span and length (B, T), positions (B, S)");
  const int64_t bsz = query.size(0), tgt_len = query.size(1), dim = query.size(2),
                src_len = positions.size(1), heads = u_p.size(0);
  TORCH_CHECK(w_p.size(0) == dim && w_p.size(1) == dim && u_p.size(1) == dim, op,
              ": W_p must be (d, d) and U_p (H, d) for queries of width d = ", dim);
  TORCH_CHECK(span.size(0) == bsz && span.size(1) == tgt_len && length.sizes() == span.sizes() &&
                  positions.size(0) == bsz,
              op, ": span, length (B, T) and positions (B, S) must match query's B and T");
  LocalnessForward f;
  f.u = window_given ? u_p : at::cat({u_p, *u_d});
  TORCH_CHECK(f.u.size(1) == dim && f.u.size(0) == (window_given ? heads : 2 * heads), op,
              ": U_d must be shaped like U_p");
  at::Tensor window_c;
  if (window_given) {
    TORCH_CHECK(window->numel() == heads && window->scalar_type() == query.scalar_type(), op,
                ": the windows must be (H,) of query's dtype");
    window_c = window->contiguous();
  }
  at::Tensor logits_c;
  if (given(logits)) {
    TORCH_CHECK(logits->sizes() == at::IntArrayRef({bsz, heads, tgt_len, src_len}) &&
                    logits->scalar_type() == query.scalar_type(),
                op, ": logits must be (B, H, T, S) of query's dtype");
    logits_c = logits->contiguous();
  }
  f.query2d = query.reshape({bsz * tgt_len, dim});
  f.hidden = at::mm(f.query2d, w_p.t()).tanh_();
  f.scores = at::mm(f.hidden, f.u.t());
  f.centre = at::empty({bsz, heads, tgt_len}, query.options());
  f.window = at::empty_like(f.centre);
  f.out = at::empty({bsz, heads, tgt_len, src_len}, query.options());
  const at::Tensor positions_c = positions.contiguous();
  const LocalnessGeometry g{bsz,         heads,        tgt_len,      src_len,
                            f.u.size(0), window_given, window_offset, min_window};
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "gaussian_localness_cpu", [&] {
    localness_forward_rows<scalar_t>(
        g, f.scores.data_ptr<scalar_t>(), per_query<scalar_t>(span), per_query<scalar_t>(length),
        window_given ? window_c.data_ptr<scalar_t>() : nullptr, positions_c.data_ptr<scalar_t>(),
        logits_c.defined() ? logits_c.data_ptr<scalar_t>() : nullptr,
        f.centre.data_ptr<scalar_t>(), f.window.data_ptr<scalar_t>(), f.out.data_ptr<scalar_t>());
  });
  return f;
}

// What the backward of the bias reads, as its forward saves it.
std::vector<at::Tensor> localness_saved(const LocalnessForward& f, const at::Tensor& w_p,
                                        const at::Tensor& span, const at::Tensor& length,
                                        const at::Tensor& positions) {
  return {f.query2d, w_p, f.u, span, length, positions, f.hidden, f.scores, f.centre, f.window};
}
constexpr size_t kLocalnessSaved = 10;

struct LocalnessGrads {
  at::Tensor query2d, w_p, u_p, u_d, window;  // d query as (B T, d); u_d or window undefined
};

// The gradients of the bias's inputs from that of its output (B, H, T, S), with what
// localness_saved kept (the first kLocalnessSaved of saved).
LocalnessGrads localness_backward(const variable_list& saved, bool window_given,
                                  double min_window, const at::Tensor& grad_in) {
  const at::Tensor &query2d = saved[0], &w_p = saved[1], &u = saved[2], &span = saved[3],
                   &length = saved[4], &positions = saved[5], &hidden = saved[6],
                   &scores = saved[7], &centre = saved[8], &window = saved[9];
  const at::Tensor grad = grad_in.contiguous();
  const int64_t heads = centre.size(1);
  const LocalnessGeometry g{centre.size(0),    heads,        centre.size(2),
                            positions.size(1), u.size(0),    window_given,
                            0.0,               min_window};
  at::Tensor grad_scores = at::empty_like(scores);
  at::Tensor grad_window_rows = window_given ? at::empty_like(centre) : at::Tensor();
  const at::Tensor positions_c = positions.contiguous();
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "gaussian_localness_backward_cpu", [&] {
    localness_backward_rows<scalar_t>(
        g, grad.data_ptr<scalar_t>(), scores.data_ptr<scalar_t>(), per_query<scalar_t>(span),
        per_query<scalar_t>(length), positions_c.data_ptr<scalar_t>(),
        centre.data_ptr<scalar_t>(), window.data_ptr<scalar_t>(),
        grad_scores.data_ptr<scalar_t>(),
        window_given ? grad_window_rows.data_ptr<scalar_t>() : nullptr);
  });
  LocalnessGrads grads;
  // each weight's gradient its own tensor: autograd keeps it as the .grad, where a view of a
  // shared one would be copied
  grads.u_p = at::mm(grad_scores.narrow(1, 0, heads).t(), hidden);
  if (window_given) {
    grads.window = grad_window_rows.sum(at::IntArrayRef{0, 2});
  } else {
    grads.u_d = at::mm(grad_scores.narrow(1, heads, heads).t(), hidden);
  }
  // back through hidden = tanh(pre)
  at::Tensor grad_pre = at::mm(grad_scores, u);
  AT_DISPATCH_FLOATING_TYPES(grad_pre.scalar_type(), "gaussian_localness_tanh_backward", [&] {
    scalar_t* out = grad_pre.data_ptr<scalar_t>();
    const scalar_t* h = hidden.data_ptr<scalar_t>();
    for (int64_t i = 0; i < grad_pre.numel(); ++i) out[i] *= scalar_t(1) - h[i] * h[i];
  });
  grads.w_p = at::mm(grad_pre.t(), query2d);
  grads.query2d = at::mm(grad_pre, w_p);
  return grads;
}

// The bias's part of a Function's forward, after its saved tensors (localness_saved's): the
// settings its backward reads; P and D are outputs without gradients.
void keep_localness(AutogradContext* ctx, const LocalnessForward& l, const at::Tensor& query,
                    const c10::optional<at::Tensor>& window, double min_window) {
  ctx->saved_data["query_shape"] = query.sizes().vec();
  ctx->saved_data["window_given"] = given(window);
  ctx->saved_data["min_window"] = min_window;
  ctx->mark_non_differentiable({l.centre, l.window});
  ctx->set_materialize_grads(false);  // P and D have none
}

// Into `result`, the gradients of the bias's arguments, which both operators that compute it
// take in one order from position `query` on: query, W_p, U_p, U_d, span, length, positions,
// window. From what keep_localness and localness_saved kept.
void localness_gradients(AutogradContext* ctx, const variable_list& saved,
                         const at::Tensor& grad, int64_t query, variable_list& result) {
  const LocalnessGrads g =
      localness_backward(saved, ctx->saved_data["window_given"].toBool(),
                         ctx->saved_data["min_window"].toDouble(), grad);
  result[query] = g.query2d.view(ctx->saved_data["query_shape"].toIntVector());
  result[query + 1] = g.w_p;
  result[query + 2] = g.u_p;
  result[query + 3] = g.u_d;
  result[query + 7] = g.window;
}

class GaussianLocalnessFunction : public torch::autograd::Function<GaussianLocalnessFunction> {
 public:
  // argument positions, for the gradients
  enum { kQuery, kWp, kUp, kUd, kSpan, kLength, kPositions, kWindow, kLogits, kArgs = 11 };

  static const OperatorInfo& info() {
    static const OperatorInfo info =
        mechanism_operator("gaussian_localness", {kQuery, kWp, kUp, kUd, kWindow, kLogits});
    return info;
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& query,
                               const at::Tensor& w_p, const at::Tensor& u_p,
                               const c10::optional<at::Tensor>& u_d, const at::Tensor& span,
                               const at::Tensor& length, const at::Tensor& positions,
                               const c10::optional<at::Tensor>& window,
                               const c10::optional<at::Tensor>& logits, double window_offset,
                               double min_window) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    LocalnessForward f = localness_forward(query, w_p, u_p, u_d, span, length, positions,
                                           window, logits, window_offset, min_window);
    ctx->save_for_backward(localness_saved(f, w_p, span, length, positions));
    keep_localness(ctx, f, query, window, min_window);
    ctx->saved_data["logits_given"] = given(logits);
    return {f.out, f.centre, f.window};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kArgs);
    if (!grads[0].defined()) return result;
    localness_gradients(ctx, ctx->get_saved_variables(), grads[0], kQuery, result);
    if (ctx->saved_data["logits_given"].toBool()) result[kLogits] = grads[0];  // weight 1
    return refuse_second_derivatives(result, grads, info());
  }
};

// ---------------------------------------------------------------------------------------------
// Dynamic window mask (Nguyen et al. 2020, Eqs. 7-11): the pointers
//   phi = softmax over the visible keys of (query W^Q / sqrt(d_h)) . keys
// for the left boundaries (heads 0..H-1) and the right ones (H..2H-1), and the mask
//   M[j] = P(l <= end_j) P(r >= start_j) + P(r <= end_j) P(l >= start_j),
// with start_j = end_j = j for token windows and the bounds of j's segment otherwise; 0 on padded
// keys. Queries with no visible key get zero pointers. Sums of probabilities accumulate in
// double, as PyTorch's CPU cumsum does.

struct Visibility {
  const bool* data = nullptr;  // nullptr: every key visible
  int64_t batch_stride = 0, query_stride = 0, key_stride = 0;

  bool operator()(int64_t b, int64_t t, int64_t j) const {
    return data == nullptr || data[b * batch_stride + t * query_stride + j * key_stride];
  }
};

struct WindowGeometry {
  int64_t bsz, heads, tgt_len, src_len;
  const bool* real;  // (B, S) or nullptr
  const int64_t* segment_start;  // (B, S) or nullptr (token windows)
  const int64_t* segment_end;
};

// The softmax of each pointer row of scale * logits over its visible keys (zeros for a row
// without any).
template <typename scalar_t>
void pointer_softmax_rows(const scalar_t* logits, scalar_t scale, scalar_t* phi,
                          const Visibility& visible, const WindowGeometry& g) {
  const int64_t rows = g.bsz * 2 * g.heads * g.tgt_len;
  for_rows(rows, g.src_len, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (2 * g.heads * g.tgt_len), t = row % g.tgt_len;
      const scalar_t* l = logits + row * g.src_len;
      scalar_t* p = phi + row * g.src_len;
      scalar_t top = -std::numeric_limits<scalar_t>::infinity();
      for (int64_t j = 0; j < g.src_len; ++j) {
        if (visible(b, t, j)) top = std::max(top, l[j] * scale);
      }
      if (top == -std::numeric_limits<scalar_t>::infinity()) {  // no visible key
        std::fill(p, p + g.src_len, scalar_t(0));
        continue;
      }
      scalar_t total = 0;
      for (int64_t j = 0; j < g.src_len; ++j) {
        p[j] = visible(b, t, j) ? std::exp(l[j] * scale - top) : scalar_t(0);
        total += p[j];
      }
      const scalar_t inverse = scalar_t(1) / total;
      for (int64_t j = 0; j < g.src_len; ++j) p[j] *= inverse;
    }
  });
}

// P(pointer <= j) and P(pointer >= j) of a row's left and right pointers, each rounded to
// scalar_t as a stored cumulative sum is. The four running sums are independent chains of
// additions, advanced in one loop so that each add waits only on its own chain; each adds in
// the order a cumulative sum does.
template <typename scalar_t>
void boundary_sums(const scalar_t* left, const scalar_t* right, int64_t n, scalar_t* l_most,
                   scalar_t* l_least, scalar_t* r_most, scalar_t* r_least) {
  double lm = 0, ll = 0, rm = 0, rl = 0;
  for (int64_t j = 0, i = n - 1; j < n; ++j, --i) {
    l_most[j] = static_cast<scalar_t>(lm += left[j]);
    r_most[j] = static_cast<scalar_t>(rm += right[j]);
    l_least[i] = static_cast<scalar_t>(ll += left[i]);
    r_least[i] = static_cast<scalar_t>(rl += right[i]);
  }
}

template <typename scalar_t>
void window_mask_rows(const scalar_t* phi, scalar_t* mask, const WindowGeometry& g) {
  const int64_t rows = g.bsz * g.heads * g.tgt_len, n = g.src_len;
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> sums(4 * n);
    scalar_t *l_most = sums.data(), *l_least = l_most + n, *r_most = l_least + n,
             *r_least = r_most + n;
    for (int64_t row = begin; row < end; ++row) {
      const auto [b, h, t] = Row(row, g.heads, g.tgt_len);
      const scalar_t* left = phi + ((b * 2 * g.heads + h) * g.tgt_len + t) * n;
      const scalar_t* right = left + g.heads * g.tgt_len * n;
      boundary_sums(left, right, n, l_most, l_least, r_most, r_least);
      scalar_t* m = mask + row * n;
      for (int64_t j = 0; j < n; ++j) {
        if (g.real && !g.real[b * n + j]) {
          m[j] = 0;
          continue;
        }
        const int64_t e = g.segment_end ? g.segment_end[b * n + j] : j;
        const int64_t s = g.segment_start ? g.segment_start[b * n + j] : j;
        m[j] = l_most[e] * r_least[s] + r_most[e] * l_least[s];
      }
    }
  });
}

// The gradient of the unscaled pointer logits from that of the mask: back through the products,
// the (segment-gathered) cumulative sums and the softmax of scale * logits.
template <typename scalar_t>
void window_mask_backward_rows(const scalar_t* grad_mask, const scalar_t* phi, double scale,
                               scalar_t* grad_logits, const WindowGeometry& g) {
  const int64_t rows = g.bsz * g.heads * g.tgt_len, n = g.src_len;
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> sums(4 * n);
    std::vector<double> grads(4 * n);
    scalar_t *l_most = sums.data(), *l_least = l_most + n, *r_most = l_least + n,
             *r_least = r_most + n;
    double *gl_most = grads.data(), *gl_least = gl_most + n, *gr_most = gl_least + n,
           *gr_least = gr_most + n;
    std::vector<double> grad_phi(2 * n);
    double *grad_left = grad_phi.data(), *grad_right = grad_left + n;
    for (int64_t row = begin; row < end; ++row) {
      const auto [b, h, t] = Row(row, g.heads, g.tgt_len);
      const int64_t left_offset = ((b * 2 * g.heads + h) * g.tgt_len + t) * n;
      const int64_t right_offset = left_offset + g.heads * g.tgt_len * n;
      boundary_sums(phi + left_offset, phi + right_offset, n, l_most, l_least, r_most, r_least);
      std::fill(grads.begin(), grads.end(), 0.0);
      const scalar_t* gm = grad_mask + row * n;
      for (int64_t j = 0; j < n; ++j) {
        if (g.real && !g.real[b * n + j]) continue;  // the mask is 0 there whatever phi is
        const int64_t e = g.segment_end ? g.segment_end[b * n + j] : j;
        const int64_t s = g.segment_start ? g.segment_start[b * n + j] : j;
        gl_most[e] += double(gm[j]) * r_least[s];
        gr_least[s] += double(gm[j]) * l_most[e];
        gr_most[e] += double(gm[j]) * l_least[s];
        gl_least[s] += double(gm[j]) * r_most[e];
      }
      // d at_most[e] / d phi[i] = [i <= e], d at_least[s] / d phi[i] = [i >= s]; then the
      // softmax: d logit_i = phi_i (d phi_i - sum_k phi_k d phi_k). The left and right
      // pointers' chains of sums advance in the same loops.
      const scalar_t *p_left = phi + left_offset, *p_right = phi + right_offset;
      double left_sum = 0, right_sum = 0;
      for (int64_t i = n - 1; i >= 0; --i) {
        grad_left[i] = (left_sum += gl_most[i]);
        grad_right[i] = (right_sum += gr_most[i]);
      }
      left_sum = right_sum = 0;
      double left_dot = 0, right_dot = 0;
      for (int64_t i = 0; i < n; ++i) {
        grad_left[i] += (left_sum += gl_least[i]);
        grad_right[i] += (right_sum += gr_least[i]);
        left_dot += grad_left[i] * p_left[i];
        right_dot += grad_right[i] * p_right[i];
      }
      scalar_t *out_left = grad_logits + left_offset, *out_right = grad_logits + right_offset;
      for (int64_t i = 0; i < n; ++i) {
        out_left[i] = static_cast<scalar_t>(scale * p_left[i] * (grad_left[i] - left_dot));
        out_right[i] = static_cast<scalar_t>(scale * p_right[i] * (grad_right[i] - right_dot));
      }
    }
  });
}

struct WindowInputs {
  Visibility visible;
  WindowGeometry geometry;
  at::Tensor visible_mask, real, segment_start, segment_end;  // kept alive for the pointers
};

WindowInputs window_inputs(const at::Tensor& query, const at::Tensor& keys,
                           const c10::optional<at::Tensor>& visible,
                           const c10::optional<at::Tensor>& real,
                           const c10::optional<at::Tensor>& segment_start,
                           const c10::optional<at::Tensor>& segment_end) {
  WindowInputs in;
  const int64_t bsz = query.size(0), tgt_len = query.size(1), src_len = keys.size(2);
  TORCH_CHECK(keys.size(1) % 2 == 0, "local_attn::dynamic_window_mask: keys hold 2 * heads");
  in.geometry = {bsz, keys.size(1) / 2, tgt_len, src_len, nullptr, nullptr, nullptr};
  if (given(visible)) {
    TORCH_CHECK(visible->scalar_type() == at::kBool && visible->dim() == 4,
                "local_attn::dynamic_window_mask: visible must be bool (B, 1, T or 1, S)");
    in.visible_mask = visible->expand({bsz, 1, tgt_len, src_len});
    in.visible = {in.visible_mask.data_ptr<bool>(), in.visible_mask.stride(0),
                  in.visible_mask.stride(2), in.visible_mask.stride(3)};
  }
  if (given(real)) {
    TORCH_CHECK(real->scalar_type() == at::kBool &&
                    real->sizes() == at::IntArrayRef({bsz, src_len}),
                "local_attn::dynamic_window_mask: real must be bool (B, S)");
    in.real = real->contiguous();
    in.geometry.real = in.real.data_ptr<bool>();
  }
  const bool segments = given(segment_start);
  TORCH_CHECK(segments == given(segment_end),
              "local_attn::dynamic_window_mask: give both segment bounds or neither");
  if (segments) {
    for (const at::Tensor* bound : {&*segment_start, &*segment_end}) {
      TORCH_CHECK(bound->scalar_type() == at::kLong &&
                      bound->sizes() == at::IntArrayRef({bsz, src_len}),
                  "local_attn::dynamic_window_mask: segment bounds must be int64 (B, S)");
      TORCH_CHECK(bound->min().item<int64_t>() >= 0 && bound->max().item<int64_t>() < src_len,
                  "local_attn::dynamic_window_mask: segment bounds out of range");
    }
    in.segment_start = segment_start->contiguous();
    in.segment_end = segment_end->contiguous();
    in.geometry.segment_start = in.segment_start.data_ptr<int64_t>();
    in.geometry.segment_end = in.segment_end.data_ptr<int64_t>();
  }
  return in;
}

struct WindowForward {
  at::Tensor mask, phi, query2d, q_heads, keys;  // q_heads, keys: (B 2H, len, d_h), unscaled
};

WindowForward window_forward(const at::Tensor& query, const at::Tensor& w_q, const at::Tensor& keys,
                             const WindowInputs& in) {
  const char* op = "local_attn::dynamic_window_mask";
  const NamedTensor inputs[] = {{&query, "query"}, {&w_q, "w_q"}, {&keys, "keys"}};
  check_cpu_floats(inputs, op);
  const WindowGeometry& g = in.geometry;
  const int64_t head_dim = keys.size(3), dim = query.size(2);
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && keys.size(0) == g.bsz &&
                  w_q.size(0) == 2 * g.heads * head_dim && w_q.size(1) == dim,
              op, ": expected query (B, T, d), w_q (2 H d_h, d) and keys (B, 2H, S, d_h)");
  WindowForward f;
  f.query2d = query.reshape({g.bsz * g.tgt_len, dim});
  f.q_heads = at::mm(f.query2d, w_q.t())
                  .view({g.bsz, g.tgt_len, 2 * g.heads, head_dim})
                  .transpose(1, 2)
                  .reshape({g.bsz * 2 * g.heads, g.tgt_len, head_dim});
  f.keys = keys.reshape({g.bsz * 2 * g.heads, g.src_len, head_dim});
  const at::Tensor logits = at::bmm(f.q_heads, f.keys.transpose(1, 2));
  f.phi = at::empty({g.bsz, 2 * g.heads, g.tgt_len, g.src_len}, query.options());
  f.mask = at::empty({g.bsz, g.heads, g.tgt_len, g.src_len}, query.options());
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "dynamic_window_mask_cpu", [&] {
    pointer_softmax_rows<scalar_t>(logits.data_ptr<scalar_t>(),
                                   static_cast<scalar_t>(1.0 / std::sqrt(double(head_dim))),
                                   f.phi.data_ptr<scalar_t>(), in.visible, g);
    window_mask_rows<scalar_t>(f.phi.data_ptr<scalar_t>(), f.mask.data_ptr<scalar_t>(), g);
  });
  return f;
}

// What the backward of the pointers and the mask reads, as its forward saves it.
std::vector<at::Tensor> window_saved(const WindowForward& f, const at::Tensor& w_q,
                                     const WindowInputs& in) {
  return {f.query2d, w_q, f.keys, f.q_heads, f.phi, in.real, in.segment_start, in.segment_end};
}
constexpr size_t kWindowSaved = 8;

struct WindowGrads {
  at::Tensor query2d, w_q, keys;  // d query as (B T, d), d keys as (B 2H, S, d_h)
};

// d query, d w_q and d keys from d mask, with what window_saved kept (the first kWindowSaved).
WindowGrads window_backward(const variable_list& saved, const at::Tensor& grad_mask_in) {
  const at::Tensor &query2d = saved[0], &w_q = saved[1], &keys = saved[2],
                   &q_heads = saved[3], &phi = saved[4], &real = saved[5],
                   &segment_start = saved[6], &segment_end = saved[7];
  const at::Tensor grad_mask = grad_mask_in.contiguous();
  const int64_t bsz = phi.size(0), heads = phi.size(1) / 2, tgt_len = phi.size(2),
                src_len = phi.size(3), head_dim = keys.size(2);
  const WindowGeometry g{
      bsz,
      heads,
      tgt_len,
      src_len,
      real.defined() ? real.data_ptr<bool>() : nullptr,
      segment_start.defined() ? segment_start.data_ptr<int64_t>() : nullptr,
      segment_end.defined() ? segment_end.data_ptr<int64_t>() : nullptr};
  at::Tensor grad_logits = at::empty({bsz * 2 * heads, tgt_len, src_len}, phi.options());
  AT_DISPATCH_FLOATING_TYPES(phi.scalar_type(), "dynamic_window_mask_backward_cpu", [&] {
    window_mask_backward_rows<scalar_t>(grad_mask.data_ptr<scalar_t>(), phi.data_ptr<scalar_t>(),
                                        1.0 / std::sqrt(double(head_dim)),
                                        grad_logits.data_ptr<scalar_t>(), g);
  });
  WindowGrads grads;
  grads.keys = at::bmm(grad_logits.transpose(1, 2), q_heads);
  const at::Tensor grad_q = at::bmm(grad_logits, keys)
                                .view({bsz, 2 * heads, tgt_len, head_dim})
                                .transpose(1, 2)
                                .reshape({bsz * tgt_len, 2 * heads * head_dim});
  grads.w_q = at::mm(grad_q.t(), query2d);
  grads.query2d = at::mm(grad_q, w_q);
  return grads;
}

// The window's part of a Function's forward, after its saved tensors (window_saved's): the
// settings its backward reads; the pointers are an output without gradients.
void keep_window(AutogradContext* ctx, const at::Tensor& phi, const at::Tensor& query,
                 const at::Tensor& keys) {
  ctx->saved_data["query_shape"] = query.sizes().vec();
  ctx->saved_data["keys_shape"] = keys.sizes().vec();
  ctx->mark_non_differentiable({phi});
  ctx->set_materialize_grads(false);  // the pointers have none
}

// Into `result`, the gradients of the window's arguments, which the operators that compute it
// take in one order from position `query` on: query, w_q, keys.
void window_gradients(AutogradContext* ctx, const WindowGrads& g, int64_t query,
                      variable_list& result) {
  result[query] = g.query2d.view(ctx->saved_data["query_shape"].toIntVector());
  result[query + 1] = g.w_q;
  result[query + 2] = g.keys.view(ctx->saved_data["keys_shape"].toIntVector());
}

class DynamicWindowFunction : public torch::autograd::Function<DynamicWindowFunction> {
 public:
  enum { kQuery, kWq, kKeys, kArgs = 7 };  // argument positions, for the gradients

  static const OperatorInfo& info() {
    static const OperatorInfo info =
        mechanism_operator("dynamic_window_mask", {kQuery, kWq, kKeys});
    return info;
  }

  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& query, const at::Tensor& w_q,
      const at::Tensor& keys, const c10::optional<at::Tensor>& visible,
      const c10::optional<at::Tensor>& real, const c10::optional<at::Tensor>& segment_start,
      const c10::optional<at::Tensor>& segment_end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const WindowInputs in =
        window_inputs(query, keys, visible, real, segment_start, segment_end);
    WindowForward f = window_forward(query, w_q, keys, in);
    ctx->save_for_backward(window_saved(f, w_q, in));
    keep_window(ctx, f.phi, query, keys);
    return {f.mask, f.phi};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kArgs);
    if (!grads[0].defined()) return result;
    window_gradients(ctx, window_backward(ctx->get_saved_variables(), grads[0]), kQuery, result);
    return refuse_second_derivatives(result, grads, info());
  }
};

// ---------------------------------------------------------------------------------------------
// The additive window's term (Nguyen et al. 2020, Eqs. 14-16) of a layer whose every head is an
// AW head of one window group: the mask M above, times the local scores
//   term[b, h] = (scale (query W_loc^T + b_loc)_h) (local_keys_h)^T * M[b, h],
// in one call: the local query projection, its product with the local keys and the mask's
// pointers share the operator's single autograd node.

struct LocalScores {
  at::Tensor local_q, local_k, scores;  // (B H, T, d_l) scaled, (B H, S, d_l), (B, H, T, S)
};

LocalScores local_scores(const WindowForward& f, const at::Tensor& local_w,
                         const c10::optional<at::Tensor>& local_b, const at::Tensor& local_keys,
                         double scale, int64_t bsz, int64_t heads, int64_t tgt_len) {
  const char* op = "local_attn::additive_window_term";
  const NamedTensor inputs[] = {{&f.query2d, "query"}, {&local_w, "local_w"},
                                {&local_keys, "local_keys"}};
  check_cpu_floats(inputs, op);
  const int64_t dim = f.query2d.size(1);
  TORCH_CHECK(local_keys.dim() == 4 && local_keys.size(0) == bsz && local_keys.size(1) == heads,
              op, ": local_keys must be (B, H, S, d_l) with the H heads of the window");
  const int64_t src_len = local_keys.size(2), local_dim = local_keys.size(3);
  TORCH_CHECK(src_len == f.keys.size(1), op, ": local_keys must have the pointers' S keys");
  TORCH_CHECK(local_w.dim() == 2 && local_w.size(0) == heads * local_dim && local_w.size(1) == dim,
              op, ": local_w must be (H d_l, d)");
  const bool biased = given(local_b);
  TORCH_CHECK(!biased || (local_b->dim() == 1 && local_b->size(0) == heads * local_dim &&
                          local_b->scalar_type() == f.query2d.scalar_type()),
              op, ": local_b must be (H d_l,) of query's dtype");
  at::Tensor projected =
      biased ? at::addmm(*local_b, f.query2d, local_w.t()) : at::mm(f.query2d, local_w.t());
  LocalScores s;
  s.local_q = projected.mul_(scale)
                  .view({bsz, tgt_len, heads, local_dim})
                  .transpose(1, 2)
                  .reshape({bsz * heads, tgt_len, local_dim});
  s.local_k = local_keys.reshape({bsz * heads, src_len, local_dim});
  s.scores = at::bmm(s.local_q, s.local_k.transpose(1, 2)).view({bsz, heads, tgt_len, src_len});
  return s;
}

// What the backward of AW's term reads, as its forward saves it: window_saved's, then these.
std::vector<at::Tensor> additive_saved(const WindowForward& f, const at::Tensor& w_q,
                                       const WindowInputs& in, const at::Tensor& local_w,
                                       const LocalScores& s) {
  std::vector<at::Tensor> saved = window_saved(f, w_q, in);
  saved.insert(saved.end(), {local_w, s.local_q, s.local_k, s.scores, f.mask});
  return saved;
}
constexpr size_t kAdditiveSaved = kWindowSaved + 5;

// AW's term s_loc * M, with the window and the local scores it is made of (what its backward
// saves): the forward of the additive window's operator and of window_attention's AW layer.
struct AdditiveForward {
  WindowInputs in;
  WindowForward window;
  LocalScores local;
  at::Tensor term;
};

AdditiveForward additive_forward(const at::Tensor& query, const at::Tensor& w_q,
                                 const at::Tensor& keys, const c10::optional<at::Tensor>& visible,
                                 const c10::optional<at::Tensor>& real,
                                 const c10::optional<at::Tensor>& segment_start,
                                 const c10::optional<at::Tensor>& segment_end,
                                 const at::Tensor& local_w,
                                 const c10::optional<at::Tensor>& local_b,
                                 const at::Tensor& local_keys, double scale) {
  AdditiveForward a;
  a.in = window_inputs(query, keys, visible, real, segment_start, segment_end);
  a.window = window_forward(query, w_q, keys, a.in);
  const WindowGeometry& g = a.in.geometry;
  a.local = local_scores(a.window, local_w, local_b, local_keys, scale, g.bsz, g.heads, g.tgt_len);
  a.term = a.local.scores * a.window.mask;
  return a;
}

struct AdditiveGrads {
  WindowGrads window;  // its d query includes the local projection's
  at::Tensor local_w, local_b, local_keys;  // d local keys as (B H, S, d_l)
};

// The gradients of AW's term's inputs from that of the term, with what additive_saved kept.
AdditiveGrads additive_window_backward(const variable_list& saved, bool biased, double scale,
                                       const at::Tensor& grad_term) {
  const at::Tensor &local_w = saved[kWindowSaved], &local_q = saved[kWindowSaved + 1],
                   &local_k = saved[kWindowSaved + 2], &scores = saved[kWindowSaved + 3],
                   &mask = saved[kWindowSaved + 4];
  const at::Tensor grad = grad_term.contiguous();
  const int64_t bsz = mask.size(0), heads = mask.size(1), tgt_len = mask.size(2),
                src_len = mask.size(3), local_dim = local_q.size(2);
  // term = scores * M: back to the scores (then the local Q and K) and to the mask
  const at::Tensor grad_scores = (grad * mask).view({bsz * heads, tgt_len, src_len});
  AdditiveGrads grads;
  grads.local_keys = at::bmm(grad_scores.transpose(1, 2), local_q);
  const at::Tensor grad_local_q = at::bmm(grad_scores, local_k)
                                      .mul_(scale)
                                      .view({bsz, heads, tgt_len, local_dim})
                                      .transpose(1, 2)
                                      .reshape({bsz * tgt_len, heads * local_dim});
  grads.window = window_backward(saved, grad * scores);
  const at::Tensor& query2d = saved[0];
  grads.local_w = at::mm(grad_local_q.t(), query2d);
  if (biased) grads.local_b = grad_local_q.sum(0);
  // out of place: torch's FLOP counter (benchmarks/training_throughput.py) counts addmm, not addmm_
  grads.window.query2d = at::addmm(grads.window.query2d, grad_local_q, local_w);
  return grads;
}

class AdditiveWindowFunction : public torch::autograd::Function<AdditiveWindowFunction> {
 public:
  // argument positions, for the gradients
  enum { kQuery, kWq, kKeys, kLocalW = 7, kLocalB, kLocalKeys, kArgs = 11 };

  static const OperatorInfo& info() {
    static const OperatorInfo info = mechanism_operator(
        "additive_window_term", {kQuery, kWq, kKeys, kLocalW, kLocalB, kLocalKeys});
    return info;
  }

  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& query, const at::Tensor& w_q,
      const at::Tensor& keys, const c10::optional<at::Tensor>& visible,
      const c10::optional<at::Tensor>& real, const c10::optional<at::Tensor>& segment_start,
      const c10::optional<at::Tensor>& segment_end, const at::Tensor& local_w,
      const c10::optional<at::Tensor>& local_b, const at::Tensor& local_keys, double scale) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const AdditiveForward a = additive_forward(query, w_q, keys, visible, real, segment_start,
                                               segment_end, local_w, local_b, local_keys, scale);
    ctx->save_for_backward(additive_saved(a.window, w_q, a.in, local_w, a.local));
    keep_window(ctx, a.window.phi, query, keys);
    ctx->saved_data["local_keys_shape"] = local_keys.sizes().vec();
    ctx->saved_data["biased"] = given(local_b);
    ctx->saved_data["scale"] = scale;
    return {a.term, a.window.phi};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kArgs);
    if (!grads[0].defined()) return result;
    const AdditiveGrads g = additive_window_backward(
        ctx->get_saved_variables(), ctx->saved_data["biased"].toBool(),
        ctx->saved_data["scale"].toDouble(), grads[0]);
    window_gradients(ctx, g.window, kQuery, result);
    result[kLocalW] = g.local_w;
    result[kLocalB] = g.local_b;
    result[kLocalKeys] = g.local_keys.view(ctx->saved_data["local_keys_shape"].toIntVector());
    return refuse_second_derivatives(result, grads, info());
  }
};

// ---------------------------------------------------------------------------------------------
// Dense attention with the mechanisms' terms (steps 2-6 of the module's order of operations):
//   P = softmax(scale q k^T + bias + attn_mask, padded keys excluded)   (rows without a key: 0)
//   out = (P * multiplier * dropout_keep / (1 - dropout_p)) v
// bias: Gaussian localness or the additive window's local scores; multiplier: the
// multiplicative window. Products by ATen's bmm; the softmax and its backward one loop a row.

struct DenseGeometry {
  int64_t bsz, heads, tgt_len, src_len;
};

struct DenseTerms {
  at::Tensor bias, multiplier, attn_mask, key_padding_mask, keep;  // each optional
  double scale, dropout_p;
};

// The rows' softmax P, and the weights that multiply v.
template <typename scalar_t>
void dense_forward_rows(const DenseGeometry& g, const DenseTerms& terms, const scalar_t* logits,
                        scalar_t* probs, scalar_t* weights) {
  const scalar_t* bias = terms.bias.defined() ? terms.bias.data_ptr<scalar_t>() : nullptr;
  const scalar_t* mult =
      terms.multiplier.defined() ? terms.multiplier.data_ptr<scalar_t>() : nullptr;
  const scalar_t* attn_mask =
      terms.attn_mask.defined() ? terms.attn_mask.data_ptr<scalar_t>() : nullptr;
  const bool* padding =
      terms.key_padding_mask.defined() ? terms.key_padding_mask.data_ptr<bool>() : nullptr;
  const bool* keep = terms.keep.defined() ? terms.keep.data_ptr<bool>() : nullptr;
  const scalar_t scale = static_cast<scalar_t>(terms.scale);
  const scalar_t keep_scale = static_cast<scalar_t>(1.0 / (1.0 - terms.dropout_p));
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  const int64_t n = g.src_len;
  for_rows(g.bsz * g.heads * g.tgt_len, n, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (g.heads * g.tgt_len), t = row % g.tgt_len;
      const scalar_t* l = logits + row * n;
      scalar_t* p = probs + row * n;
      scalar_t top = minus_inf;
      for (int64_t j = 0; j < n; ++j) {
        scalar_t x = l[j] * scale;
        if (bias) x += bias[row * n + j];
        if (attn_mask) x += attn_mask[t * n + j];
        if (padding && padding[b * n + j]) x = minus_inf;
        p[j] = x;
        top = std::max(top, x);
      }
      scalar_t* w = weights + row * n;
      if (top == minus_inf) {  // no key: zeros, never NaN
        std::fill(p, p + n, scalar_t(0));
        std::fill(w, w + n, scalar_t(0));
        continue;
      }
      scalar_t total = 0;
      for (int64_t j = 0; j < n; ++j) total += (p[j] = std::exp(p[j] - top));
      const scalar_t inverse = scalar_t(1) / total;
      for (int64_t j = 0; j < n; ++j) {
        p[j] *= inverse;
        scalar_t x = mult ? p[j] * mult[row * n + j] : p[j];
        if (keep) x = keep[row * n + j] ? x * keep_scale : scalar_t(0);
        w[j] = x;
      }
    }
  });
}

// From d weights (in grad, overwritten with d logits before the scale): d bias = d logits,
// d multiplier (when there is one).
template <typename scalar_t>
void dense_backward_rows(const DenseGeometry& g, const DenseTerms& terms, const scalar_t* probs,
                         scalar_t* grad, scalar_t* grad_multiplier) {
  const scalar_t* mult =
      terms.multiplier.defined() ? terms.multiplier.data_ptr<scalar_t>() : nullptr;
  const bool* keep = terms.keep.defined() ? terms.keep.data_ptr<bool>() : nullptr;
  const scalar_t keep_scale = static_cast<scalar_t>(1.0 / (1.0 - terms.dropout_p));
  const int64_t n = g.src_len;
  for_rows(g.bsz * g.heads * g.tgt_len, n, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* p = probs + row * n;
      scalar_t* gr = grad + row * n;
      double dot = 0;
      for (int64_t j = 0; j < n; ++j) {
        scalar_t x = gr[j];  // d (P * multiplier), after the dropout's scaling
        if (keep) x = keep[row * n + j] ? x * keep_scale : scalar_t(0);
        if (mult) {
          grad_multiplier[row * n + j] = x * p[j];
          x *= mult[row * n + j];
        }
        gr[j] = x;  // d P
        dot += double(x) * p[j];
      }
      for (int64_t j = 0; j < n; ++j) gr[j] = p[j] * (gr[j] - static_cast<scalar_t>(dot));
    }
  });
}

// The terms as given (each absent or defined), checked against the call's shapes and made
// contiguous.
DenseTerms dense_terms(const DenseGeometry& g, const at::Tensor& q, const DenseTerms& given) {
  const char* op = "local_attn::dense_attention";
  const std::vector<int64_t> full{g.bsz, g.heads, g.tgt_len, g.src_len};
  auto checked = [op](const at::Tensor& t, at::IntArrayRef sizes, at::ScalarType dtype,
                      const char* requirement) {
    if (!t.defined()) return t;
    TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == dtype, op, ": ", requirement);
    return t.contiguous();
  };
  const at::ScalarType dtype = q.scalar_type();
  DenseTerms terms = given;
  terms.bias = checked(given.bias, full, dtype, "bias must be (B, H, T, S) of q's dtype");
  terms.multiplier =
      checked(given.multiplier, full, dtype, "multiplier must be (B, H, T, S) of q's dtype");
  terms.attn_mask = checked(given.attn_mask, {g.tgt_len, g.src_len}, dtype,
                            "attn_mask must be (T, S) of q's dtype");
  terms.key_padding_mask = checked(given.key_padding_mask, {g.bsz, g.src_len}, at::kBool,
                                   "key_padding_mask must be bool (B, S)");
  TORCH_CHECK(given.dropout_p >= 0.0 && given.dropout_p < 1.0, op,
              ": dropout_p must be in [0, 1)");
  terms.keep = checked(given.keep, full, at::kBool, "dropout_keep must be bool (B, H, T, S)");
  TORCH_CHECK(terms.keep.defined() || given.dropout_p == 0.0, op,
              ": dropout_p > 0 needs its dropout_keep mask");
  return terms;
}

struct DenseForward {
  at::Tensor out, q, k, v, probs;  // q, k, v as (B H, len, D)
  DenseTerms terms;
  DenseGeometry geometry;
};

DenseForward dense_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& multiplier,
                           const c10::optional<at::Tensor>& attn_mask,
                           const c10::optional<at::Tensor>& key_padding_mask,
                           const c10::optional<at::Tensor>& dropout_keep, double scale,
                           double dropout_p) {
  const char* op = "local_attn::dense_attention";
  const NamedTensor inputs[] = {{&q, "q"}, {&k, "k"}, {&v, "v"}};
  check_cpu_floats(inputs, op);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() &&
                  q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              op, ": expected q (B, H, T, D) and k, v (B, H, S, D)");
  DenseForward f;
  f.geometry = {q.size(0), q.size(1), q.size(2), k.size(2)};
  const DenseGeometry& g = f.geometry;
  const at::Tensor none;
  f.terms = dense_terms(g, q, {bias.value_or(none), multiplier.value_or(none),
                               attn_mask.value_or(none), key_padding_mask.value_or(none),
                               dropout_keep.value_or(none), scale, dropout_p});
  const int64_t dim = q.size(3);
  f.q = q.reshape({g.bsz * g.heads, g.tgt_len, dim});
  f.k = k.reshape({g.bsz * g.heads, g.src_len, dim});
  f.v = v.reshape({g.bsz * g.heads, g.src_len, dim});
  const at::Tensor logits = at::bmm(f.q, f.k.transpose(1, 2));
  f.probs = at::empty_like(logits);
  at::Tensor weights = at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dense_attention_cpu", [&] {
    dense_forward_rows<scalar_t>(g, f.terms, logits.data_ptr<scalar_t>(),
                                 f.probs.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>());
  });
  f.out = at::bmm(weights, f.v).view({g.bsz, g.heads, g.tgt_len, dim});
  return f;
}

// What the backward of the attention reads, as its forward saves it.
std::vector<at::Tensor> dense_saved(const DenseForward& f) {
  return {f.q, f.k, f.v, f.probs, f.terms.multiplier, f.terms.keep};
}

struct DenseGrads {
  at::Tensor q, k, v, logits, multiplier;  // d logits: that of the additive terms too
};

// The gradients of the attention's inputs from that of its output, with what dense_saved kept
// (the first six of saved).
DenseGrads dense_backward(const variable_list& saved, size_t first, double scale,
                          double dropout_p, const at::Tensor& grad_output) {
  const at::Tensor &q = saved[first], &k = saved[first + 1], &v = saved[first + 2],
                   &probs = saved[first + 3];
  DenseTerms terms{{}, saved[first + 4], {}, {}, saved[first + 5], scale, dropout_p};
  const DenseGeometry g{grad_output.size(0), grad_output.size(1), q.size(1), k.size(1)};
  const int64_t dim = q.size(2);
  const at::Tensor grad_out = grad_output.reshape({g.bsz * g.heads, g.tgt_len, dim});
  // the weights that multiplied v, rebuilt from P
  at::Tensor weights = probs;
  if (terms.multiplier.defined()) weights = weights * terms.multiplier.view_as(probs);
  if (terms.keep.defined()) weights = weights * terms.keep.view_as(probs) / (1.0 - dropout_p);
  DenseGrads grads;
  grads.v = at::bmm(weights.transpose(1, 2), grad_out).view({g.bsz, g.heads, g.src_len, dim});
  at::Tensor grad = at::bmm(grad_out, v.transpose(1, 2));
  if (terms.multiplier.defined()) grads.multiplier = at::empty_like(grad);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dense_attention_backward_cpu", [&] {
    dense_backward_rows<scalar_t>(
        g, terms, probs.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(),
        grads.multiplier.defined() ? grads.multiplier.data_ptr<scalar_t>() : nullptr);
  });
  grads.q = at::bmm(grad, k).mul_(scale).view({g.bsz, g.heads, g.tgt_len, dim});
  grads.k = at::bmm(grad.transpose(1, 2), q).mul_(scale).view({g.bsz, g.heads, g.src_len, dim});
  const std::vector<int64_t> full{g.bsz, g.heads, g.tgt_len, g.src_len};
  grads.logits = grad.view(full);
  if (grads.multiplier.defined()) grads.multiplier = grads.multiplier.view(full);
  return grads;
}

// The attention's part of a Function whose forward ends in dense_forward: its saved tensors
// after the mechanism's (`saved`), and its settings; `bias`: whether an additive term was given.
void save_attention(AutogradContext* ctx, std::vector<at::Tensor> saved, const DenseForward& d,
                    bool bias, double scale, double dropout_p) {
  const std::vector<at::Tensor> attention = dense_saved(d);
  saved.insert(saved.end(), attention.begin(), attention.end());
  ctx->save_for_backward(saved);
  ctx->saved_data["bias"] = bias;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["dropout_p"] = dropout_p;
}

// Argument positions shared by the attention operators.
enum AttentionArgument { kQ, kK, kV };

// The attention's gradients from what save_attention kept after the first `first` of `saved`:
// q's, k's and v's into `result`, and the additive term's (weight 1) at `bias_position`.
DenseGrads attention_gradients(AutogradContext* ctx, const variable_list& saved, size_t first,
                               const at::Tensor& grad, int64_t bias_position,
                               variable_list& result) {
  DenseGrads d = dense_backward(saved, first, ctx->saved_data["scale"].toDouble(),
                                ctx->saved_data["dropout_p"].toDouble(), grad);
  result[kQ] = d.q;
  result[kK] = d.k;
  result[kV] = d.v;
  if (ctx->saved_data["bias"].toBool()) result[bias_position] = d.logits;
  return d;
}

class DenseAttentionFunction : public torch::autograd::Function<DenseAttentionFunction> {
 public:
  enum { kBias = 3, kMultiplier, kArgs = 10 };  // argument positions, for the gradients

  static const OperatorInfo& info() {
    static const OperatorInfo info =
        mechanism_operator("dense_attention", {kQ, kK, kV, kBias, kMultiplier});
    return info;
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& multiplier,
                               const c10::optional<at::Tensor>& attn_mask,
                               const c10::optional<at::Tensor>& key_padding_mask,
                               const c10::optional<at::Tensor>& dropout_keep, double scale,
                               double dropout_p) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    DenseForward f = dense_forward(q, k, v, bias, multiplier, attn_mask, key_padding_mask,
                                   dropout_keep, scale, dropout_p);
    save_attention(ctx, {}, f, given(bias), scale, dropout_p);
    return {f.out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kArgs);
    const DenseGrads g =
        attention_gradients(ctx, ctx->get_saved_variables(), 0, grads[0], kBias, result);
    result[kMultiplier] = g.multiplier;
    return refuse_second_derivatives(result, grads, info());
  }
};

// ---------------------------------------------------------------------------------------------
// A layer of Gaussian heads in one call: the Gaussian bias (plus any other additive term, such
// as AW's) and the dense attention that takes it, under one autograd node: at translation
// lengths the node, the dispatch and the (B, H, T, S) bias passed between two operators cost
// more than the bias's arithmetic.

class GaussianAttentionFunction : public torch::autograd::Function<GaussianAttentionFunction> {
 public:
  // argument positions, for the gradients
  enum {
    kQuery = 3, kWp, kUp, kUd, kSpan, kLength, kPositions, kWindow, kWindowOffset, kMinWindow,
    kBias, kMultiplier, kArgs = 20
  };

  static const OperatorInfo& info() {
    static const OperatorInfo info = mechanism_operator(
        "gaussian_attention", {kQ, kK, kV, kQuery, kWp, kUp, kUd, kWindow, kBias, kMultiplier});
    return info;
  }

  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const at::Tensor& query, const at::Tensor& w_p, const at::Tensor& u_p,
      const c10::optional<at::Tensor>& u_d, const at::Tensor& span, const at::Tensor& length,
      const at::Tensor& positions, const c10::optional<at::Tensor>& window,
      double window_offset, double min_window, const c10::optional<at::Tensor>& bias,
      const c10::optional<at::Tensor>& multiplier, const c10::optional<at::Tensor>& attn_mask,
      const c10::optional<at::Tensor>& key_padding_mask,
      const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // the bias's "logits" are the other additive term: one (B, H, T, S) sum of both
    LocalnessForward l = localness_forward(query, w_p, u_p, u_d, span, length, positions,
                                           window, bias, window_offset, min_window);
    DenseForward d = dense_forward(q, k, v, l.out, multiplier, attn_mask, key_padding_mask,
                                   dropout_keep, scale, dropout_p);
    save_attention(ctx, localness_saved(l, w_p, span, length, positions), d, given(bias), scale,
                   dropout_p);
    keep_localness(ctx, l, query, window, min_window);
    return {d.out, l.centre, l.window};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kArgs);
    if (!grads[0].defined()) return result;
    const variable_list saved = ctx->get_saved_variables();
    const DenseGrads d =
        attention_gradients(ctx, saved, kLocalnessSaved, grads[0], kBias, result);
    localness_gradients(ctx, saved, d.logits, kQuery, result);
    result[kMultiplier] = d.multiplier;
    return refuse_second_derivatives(result, grads, info());
  }
};

// ---------------------------------------------------------------------------------------------
// A layer of dynamic-window heads of one window in one call: the pointers and M, then the dense
// attention with M among its multipliers (MW) or AW's term s_loc * M among its additive terms,
// under one autograd node.

constexpr size_t kMultiplicativeSaved = kWindowSaved + 2;

class WindowAttentionFunction : public torch::autograd::Function<WindowAttentionFunction> {
 public:
  // argument positions, for the gradients
  enum {
    kQuery = 3, kWq, kKeys, kLocalW = 10, kLocalB, kLocalKeys, kBias = 14, kMultiplier,
    kArgs = 21
  };

  static const OperatorInfo& info() {
    static const OperatorInfo info = mechanism_operator(
        "window_attention",
        {kQ, kK, kV, kQuery, kWq, kKeys, kLocalW, kLocalB, kLocalKeys, kBias, kMultiplier});
    return info;
  }

  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const at::Tensor& query, const at::Tensor& w_q, const at::Tensor& keys,
      const c10::optional<at::Tensor>& visible, const c10::optional<at::Tensor>& real,
      const c10::optional<at::Tensor>& segment_start,
      const c10::optional<at::Tensor>& segment_end, const c10::optional<at::Tensor>& local_w,
      const c10::optional<at::Tensor>& local_b, const c10::optional<at::Tensor>& local_keys,
      double local_scale, const c10::optional<at::Tensor>& bias,
      const c10::optional<at::Tensor>& multiplier, const c10::optional<at::Tensor>& attn_mask,
      const c10::optional<at::Tensor>& key_padding_mask,
      const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool additive = given(local_w);
    TORCH_CHECK(additive == given(local_keys), "local_attn::window_attention: give local_w and "
                "local_keys (the additive window) or neither (the multiplicative one)");
    std::vector<at::Tensor> saved;  // the window's (and AW's); the attention's follow
    at::Tensor phi;
    c10::optional<at::Tensor> bias_total = bias, multiplier_total = multiplier;
    if (additive) {
      AdditiveForward a = additive_forward(query, w_q, keys, visible, real, segment_start,
                                           segment_end, *local_w, local_b, *local_keys,
                                           local_scale);
      phi = a.window.phi;
      bias_total = given(bias) ? a.term.add_(*bias) : a.term;
      saved = additive_saved(a.window, w_q, a.in, *local_w, a.local);
      ctx->saved_data["local_keys_shape"] = local_keys->sizes().vec();
    } else {
      const WindowInputs in =
          window_inputs(query, keys, visible, real, segment_start, segment_end);
      WindowForward f = window_forward(query, w_q, keys, in);
      phi = f.phi;
      multiplier_total = given(multiplier) ? f.mask * *multiplier : f.mask;
      saved = window_saved(f, w_q, in);
      saved.insert(saved.end(), {given(multiplier) ? *multiplier : at::Tensor(), f.mask});
    }
    DenseForward d = dense_forward(q, k, v, bias_total, multiplier_total, attn_mask,
                                   key_padding_mask, dropout_keep, scale, dropout_p);
    save_attention(ctx, std::move(saved), d, given(bias), scale, dropout_p);
    keep_window(ctx, phi, query, keys);
    ctx->saved_data["additive"] = additive;
    ctx->saved_data["biased"] = given(local_b);
    ctx->saved_data["local_scale"] = local_scale;
    return {d.out, phi};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kArgs);
    if (!grads[0].defined()) return result;
    const variable_list saved = ctx->get_saved_variables();
    const bool additive = ctx->saved_data["additive"].toBool();
    const DenseGrads d = attention_gradients(
        ctx, saved, additive ? kAdditiveSaved : kMultiplicativeSaved, grads[0], kBias, result);
    WindowGrads window;
    if (additive) {  // AW's term is among the additive terms, weight 1
      AdditiveGrads a = additive_window_backward(saved, ctx->saved_data["biased"].toBool(),
                                                 ctx->saved_data["local_scale"].toDouble(),
                                                 d.logits);
      window = a.window;
      result[kLocalW] = a.local_w;
      result[kLocalB] = a.local_b;
      result[kLocalKeys] =
          a.local_keys.view(ctx->saved_data["local_keys_shape"].toIntVector());
      result[kMultiplier] = d.multiplier;
    } else {  // the multipliers' product: M times the given one
      const at::Tensor &other = saved[kWindowSaved], &mask = saved[kWindowSaved + 1];
      window = window_backward(saved, other.defined() ? d.multiplier * other : d.multiplier);
      if (other.defined()) result[kMultiplier] = d.multiplier * mask;
    }
    window_gradients(ctx, window, kQuery, result);
    return refuse_second_derivatives(result, grads, info());
  }
};

}  // namespace

// The operators, each with its `<name>_backward` companion (operator_autograd.h).
const char* const kMechanismSchemas[] = {
    "gaussian_localness(Tensor query, Tensor w_p, Tensor u_p, Tensor? u_d, Tensor span, "
          "Tensor length, Tensor positions, Tensor? window, Tensor? logits, float window_offset, "
          "float min_window) -> (Tensor, Tensor, Tensor)",
    "dynamic_window_mask(Tensor query, Tensor w_q, Tensor keys, Tensor? visible, "
          "Tensor? real, Tensor? segment_start, Tensor? segment_end) -> (Tensor, Tensor)",
    "additive_window_term(Tensor query, Tensor w_q, Tensor keys, Tensor? visible, "
          "Tensor? real, Tensor? segment_start, Tensor? segment_end, Tensor local_w, "
          "Tensor? local_b, Tensor local_keys, float scale) -> (Tensor, Tensor)",
    "dense_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? multiplier, "
          "Tensor? attn_mask, Tensor? key_padding_mask, Tensor? dropout_keep, float scale, "
          "float dropout_p) -> Tensor",
    "gaussian_attention(Tensor q, Tensor k, Tensor v, Tensor query, Tensor w_p, Tensor u_p, "
          "Tensor? u_d, Tensor span, Tensor length, Tensor positions, Tensor? window, "
          "float window_offset, float min_window, Tensor? bias, Tensor? multiplier, "
          "Tensor? attn_mask, Tensor? key_padding_mask, Tensor? dropout_keep, float scale, "
          "float dropout_p) -> (Tensor, Tensor, Tensor)",
    "window_attention(Tensor q, Tensor k, Tensor v, Tensor query, Tensor w_q, Tensor keys, "
          "Tensor? visible, Tensor? real, Tensor? segment_start, Tensor? segment_end, "
          "Tensor? local_w, Tensor? local_b, Tensor? local_keys, float local_scale, Tensor? bias, "
          "Tensor? multiplier, Tensor? attn_mask, Tensor? key_padding_mask, Tensor? dropout_keep, "
          "float scale, float dropout_p) -> (Tensor, Tensor)",
};

TORCH_LIBRARY_FRAGMENT(local_attn, m) {
  m.set_python_module("local_attn_fairseq.ops.mechanisms");  // their fake kernels
  for (const char* schema : kMechanismSchemas) {
    m.def(schema);
    m.def(backward_schema(schema).c_str());
  }
}

// An operator's CPU kernel and its `<name>_backward` companion's.
template <class EagerFunction, size_t Outputs>
struct CpuKernels {
  static void impl(torch::Library& m, const std::string& name) {
    m.impl(name.c_str(), &OperatorKernels<EagerFunction, Outputs>::cpu);
    m.impl((name + "_backward").c_str(), &OperatorKernels<EagerFunction, Outputs>::backward);
  }
};

// An operator's Autograd kernel.
template <class EagerFunction, size_t Outputs>
struct AutogradKernel {
  static void impl(torch::Library& m, const std::string& name) {
    m.impl(name.c_str(), &OperatorKernels<EagerFunction, Outputs>::autograd);
  }
};

// Every operator of this file (its Function and number of outputs), with `Kernels`' kernels.
template <template <class, size_t> class Kernels>
void impl_operators(torch::Library& m) {
  Kernels<GaussianLocalnessFunction, 3>::impl(m, "gaussian_localness");
  Kernels<DynamicWindowFunction, 2>::impl(m, "dynamic_window_mask");
  Kernels<AdditiveWindowFunction, 2>::impl(m, "additive_window_term");
  Kernels<DenseAttentionFunction, 1>::impl(m, "dense_attention");
  Kernels<GaussianAttentionFunction, 3>::impl(m, "gaussian_attention");
  Kernels<WindowAttentionFunction, 2>::impl(m, "window_attention");
}

TORCH_LIBRARY_IMPL(local_attn, CPU, m) { impl_operators<CpuKernels>(m); }

TORCH_LIBRARY_IMPL(local_attn, Autograd, m) { impl_operators<AutogradKernel>(m); }

}  // namespace local_attn
