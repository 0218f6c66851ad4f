// Several linear projections of one input split into heads, under one autograd node (CPU).
//
// An attention layer projects the same rows into its queries, keys and values, and a dynamic
// window layer also into its pointer keys and the additive window's local keys: five nn.Linear
// calls, each with its view, its permute and four or five autograd nodes. At translation
// lengths that bookkeeping costs more than the products (docs/banded_attention.md, "Cost per
// call"). Here each projection is the product F.linear computes (the same addmm on the same
// rows, so the same numbers), and its backward is AddmmBackward's products without the nodes.
//
// ops/mechanisms.py says when it is used; LocalMultiheadAttention projects with nn.Linear
// everywhere else, and the tests hold this operator to it, outputs and gradients.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "operator_autograd.h"

#include <vector>

namespace local_attn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x (len, bsz, dim); weights[i] (n_i * head_dim, dim) of x's dtype and device, biases[i] the
// same rows or undefined.
void check_projections(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                       const std::vector<at::Tensor>& biases, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 3, "project_heads: x must be (len, bsz, dim), got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "project_heads: x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "project_heads: x must be float32 or float64, got ", x.scalar_type());
  TORCH_CHECK(head_dim > 0, "project_heads: head_dim must be positive, got ", head_dim);
  TORCH_CHECK(!weights.empty() && weights.size() == biases.size(),
              "project_heads: one bias (or None) per weight, got ", weights.size(), " weights and ",
              biases.size(), " biases");
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(2) && w.size(0) % head_dim == 0,
                "project_heads: weight ", i, " must be (heads * ", head_dim, ", ", x.size(2),
                "), got ", w.sizes());
    TORCH_CHECK(w.device() == x.device() && w.scalar_type() == x.scalar_type(),
                "project_heads: weight ", i, " must be a ", x.scalar_type(), " CPU tensor like x");
    const at::Tensor& b = biases[i];
    if (!b.defined()) continue;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == w.size(0), "project_heads: bias ", i,
                " must be (", w.size(0), ",), got ", b.sizes());
    TORCH_CHECK(b.device() == x.device() && b.scalar_type() == x.scalar_type(),
                "project_heads: bias ", i, " must be a ", x.scalar_type(), " CPU tensor like x");
  }
}

// Each projection of x as (bsz, heads, len, head_dim), a view of its (len, bsz, heads,
// head_dim) product.
std::vector<at::Tensor> project_forward(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                        const std::vector<at::Tensor>& biases, int64_t head_dim) {
  check_projections(x, weights, biases, head_dim);
  const int64_t length = x.size(0), bsz = x.size(1);
  const at::Tensor rows = x.reshape({length * bsz, x.size(2)});
  std::vector<at::Tensor> outputs;
  outputs.reserve(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    at::Tensor y = biases[i].defined() ? at::addmm(biases[i], rows, w.t()) : at::mm(rows, w.t());
    outputs.push_back(y.view({length, bsz, w.size(0) / head_dim, head_dim}).permute({1, 2, 0, 3}));
  }
  return outputs;
}

// The biases that are there, in order, and which projection has one.
struct Biases {
  std::vector<at::Tensor> present;
  c10::List<bool> has_bias;
};

Biases split_biases(const c10::List<c10::optional<at::Tensor>>& biases) {
  Biases result;
  for (size_t i = 0; i < biases.size(); ++i) {
    const c10::optional<at::Tensor> bias = biases.get(i);
    result.has_bias.push_back(bias.has_value() && bias->defined());
    if (result.has_bias.get(i)) result.present.push_back(*bias);
  }
  return result;
}

std::vector<at::Tensor> all_biases(at::TensorList present, const c10::List<bool>& has_bias) {
  std::vector<at::Tensor> result;
  size_t next = 0;
  for (size_t i = 0; i < has_bias.size(); ++i)
    result.push_back(has_bias.get(i) ? present[next++] : at::Tensor());
  return result;
}

class ProjectHeadsFunction : public torch::autograd::Function<ProjectHeadsFunction> {
 public:
  // arguments: x, the weights, the biases that are there (autograd's inputs must be defined),
  // head_dim and which projection has a bias
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList weights,
                               at::TensorList biases, int64_t head_dim,
                               const c10::List<bool>& has_bias) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const std::vector<at::Tensor> w(weights.begin(), weights.end());
    std::vector<at::Tensor> outputs = project_forward(x, w, all_biases(biases, has_bias), head_dim);
    std::vector<at::Tensor> saved{x};
    saved.insert(saved.end(), w.begin(), w.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["has_bias"] = has_bias;
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const c10::List<bool> has_bias = ctx->saved_data["has_bias"].toBoolList();
    const size_t count = has_bias.size();
    const int64_t length = x.size(0), bsz = x.size(1);
    const at::Tensor rows = x.reshape({length * bsz, x.size(2)});
    variable_list weight_grads(count), bias_grads;
    at::Tensor grad_x;
    for (size_t i = 0; i < count; ++i) {
      const at::Tensor& w = saved[1 + i];
      // an output outside the loss: zero gradients for its weight and bias
      const at::Tensor grad =
          grads[i].defined() ? grads[i].permute({2, 0, 1, 3}).reshape({length * bsz, w.size(0)})
                             : at::zeros({length * bsz, w.size(0)}, x.options());
      // addmm, not addmm_: torch's FLOP counter (benchmarks/training_throughput.py) counts it
      grad_x = grad_x.defined() ? at::addmm(grad_x, grad, w) : at::mm(grad, w);
      weight_grads[i] = at::mm(grad.t(), rows);
      if (has_bias.get(i)) bias_grads.push_back(grad.sum(0));
    }
    variable_list result{grad_x.view(x.sizes())};
    result.insert(result.end(), weight_grads.begin(), weight_grads.end());
    result.insert(result.end(), bias_grads.begin(), bias_grads.end());
    result.resize(result.size() + 2);  // head_dim, has_bias
    return result;
  }
};

std::vector<at::Tensor> project_heads_cpu(const at::Tensor& x, at::TensorList weights,
                                          const c10::List<c10::optional<at::Tensor>>& biases,
                                          int64_t head_dim) {
  std::vector<at::Tensor> each_bias;  // an undefined tensor for a projection without one
  each_bias.reserve(biases.size());
  for (size_t i = 0; i < biases.size(); ++i) {
    each_bias.push_back(biases.get(i).value_or(at::Tensor()));
  }
  return project_forward(x, std::vector<at::Tensor>(weights.begin(), weights.end()), each_bias,
                         head_dim);
}

std::vector<at::Tensor> project_heads_autograd(const at::Tensor& x, at::TensorList weights,
                                               const c10::List<c10::optional<at::Tensor>>& biases,
                                               int64_t head_dim) {
  refuse_torch_func("local_attn::project_heads", "LOCAL_ATTN_MECHANISM_IMPL=torch");
  if (!at::GradMode::is_enabled()) {  // inference: no node to record
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return project_heads_cpu(x, weights, biases, head_dim);
  }
  const Biases b = split_biases(biases);
  return ProjectHeadsFunction::apply(x, weights, at::TensorList(b.present), head_dim, b.has_bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(local_attn, m) {
  m.def("project_heads(Tensor x, Tensor[] weights, Tensor?[] biases, int head_dim) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(local_attn, CPU, m) { m.impl("project_heads", &project_heads_cpu); }

TORCH_LIBRARY_IMPL(local_attn, Autograd, m) { m.impl("project_heads", &project_heads_autograd); }

}  // namespace local_attn
