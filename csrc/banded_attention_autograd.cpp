// Autograd of the banded forward operators, registered for the Autograd key next to their
// CPU and CUDA kernels: a differentiable call is one dispatcher hop into C++, with no Python
// between the caller and the kernels, forward or backward.
#include "banded_attention.h"
#include "operator_autograd.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace local_attn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSchema = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef, at::IntArrayRef,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, double);
using BackwardSchema = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, at::IntArrayRef, at::IntArrayRef, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, double, double);

// The two operator pairs with this schema: the CPU/CUDA-core kernels and the tensor-core ones.
enum class Pair { kernels, tensor_core };

const char* forward_name(Pair pair) {
  return pair == Pair::kernels ? "local_attn::banded_forward"
                               : "local_attn::banded_forward_tensor_core";
}

const char* backward_name(Pair pair) {
  return pair == Pair::kernels ? "local_attn::banded_backward"
                               : "local_attn::banded_backward_tensor_core";
}

// Operator handles are looked up once, on the first call, not on every call.
template <Pair pair>
const c10::TypedOperatorHandle<ForwardSchema>& forward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow(forward_name(pair), "")
                                 .typed<ForwardSchema>();
  return handle;
}

template <Pair pair>
const c10::TypedOperatorHandle<BackwardSchema>& backward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow(backward_name(pair), "")
                                 .typed<BackwardSchema>();
  return handle;
}

c10::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

template <Pair pair>
class BandedAttentionFunction : public torch::autograd::Function<BandedAttentionFunction<pair>> {
 public:
  static const OperatorInfo& info() {
    static const OperatorInfo info{forward_name(pair), backward_name(pair), {0, 1, 2},
                                   "LOCAL_ATTN_BANDED_IMPL=torch"};
    return info;
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, at::IntArrayRef left, at::IntArrayRef right,
                               const c10::optional<at::Tensor>& key_padding_mask,
                               const c10::optional<at::Tensor>& dropout_keep, double scale,
                               double dropout_p) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = forward_op<pair>().call(q, k, v, left, right, key_padding_mask,
                                              dropout_keep, scale, dropout_p);
    // Only q, k, v, out and the O(T) log-sum-exp (plus the masks given): the band is
    // recomputed in the backward.
    ctx->save_for_backward({q, k, v, out, lse, key_padding_mask.value_or(at::Tensor()),
                            dropout_keep.value_or(at::Tensor())});
    ctx->saved_data["left"] = left.vec();
    ctx->saved_data["right"] = right.vec();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    // Only the (non-differentiable) lse of the forward was used: its output's gradient is 0.
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const std::vector<int64_t> left = ctx->saved_data["left"].toIntVector();
    const std::vector<int64_t> right = ctx->saved_data["right"].toIntVector();
    auto [dq, dk, dv] = backward_op<pair>().call(
        grad_out, q, k, v, out, saved[4], left, right, optional_of(saved[5]),
        optional_of(saved[6]), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["dropout_p"].toDouble());
    return refuse_second_derivatives(
        {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
         at::Tensor()},
        grads, info());
  }
};

template <Pair pair>
std::tuple<at::Tensor, at::Tensor> banded_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef left,
    at::IntArrayRef right, const c10::optional<at::Tensor>& key_padding_mask,
    const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
  const OperatorInfo& info = BandedAttentionFunction<pair>::info();
  refuse_torch_func(info.name, info.torch_route);
  variable_list outputs = BandedAttentionFunction<pair>::apply(
      q, k, v, left, right, key_padding_mask, dropout_keep, scale, dropout_p);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(local_attn, Autograd, m) {
  m.impl("banded_forward", &banded_forward_autograd<Pair::kernels>);
  m.impl("banded_forward_tensor_core", &banded_forward_autograd<Pair::tensor_core>);
}

}  // namespace local_attn
