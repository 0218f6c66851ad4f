// What every operator of the library promises autograd, torch.func and PyTorch's custom-operator
// contract (torch.library.opcheck), beyond its own kernels:
//
// * Second derivatives. A backward computed by the kernels is not itself differentiable: under
//   create_graph its gradients would carry no history, and a gradient of them would come out
//   silently zero or wrong. `refuse_second_derivatives` makes such gradients the outputs of a
//   node that refuses to be differentiated (torch's `Error` node), with one error naming the
//   operator and the route that computes second derivatives (PyTorch's). The node's edges are
//   those of the backward's own node (the operator's inputs) and of the incoming gradients:
//   graph edges, not tensors, so nothing the backward does not read stays allocated from the
//   forward to the backward. First derivatives under create_graph (a gradient penalty's first
//   step) still work.
// * torch.func. Its transforms (grad, vjp, vmap, ...) cannot enter an eager C++ Function: a call
//   under one is refused by `refuse_torch_func` in one line naming the route, in PyTorch's
//   operations, where torch.func.grad and torch.func.vjp work.
// * Tracing. Fake tensors (torch.compile, torch.export, opcheck) have no data for the kernels to
//   read. An Autograd kernel given such tensors redispatches the operator below autograd (to its
//   fake kernel while tracing), saves the arguments, and differentiates through the operator's
//   `<name>_backward` companion, whose CPU kernel `recomputed_gradients` runs the forward again
//   and the eager backward. Real CPU tensors keep the eager path, whose forward saves what its
//   backward reads; the traced path trades that memory for a second forward in the backward.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/FuncTorchTLS.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace local_attn {

// One operator of the library as its Autograd kernel sees it (an eager Function's static
// info()): its name, its backward companion's, which argument positions take gradients, and
// the setting that computes it in PyTorch's operations (its second derivatives, torch.func).
struct OperatorInfo {
  std::string name;           // "local_attn::<name>"
  std::string backward_name;  // its `<name>_backward` companion
  std::vector<int64_t> differentiable;
  std::string torch_route;

  bool takes_gradient(int64_t position) const {
    return std::find(differentiable.begin(), differentiable.end(), position) !=
           differentiable.end();
  }
};

namespace operator_autograd_detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

inline bool is_traced(const at::Tensor& t) {
  return t.defined() && (!t.device().is_cpu() || t.key_set().has(c10::DispatchKey::Python));
}
inline bool is_traced(const c10::optional<at::Tensor>& t) {
  return t.has_value() && is_traced(*t);
}
inline bool is_traced(at::TensorList list) {
  return std::any_of(list.begin(), list.end(), [](const at::Tensor& t) { return is_traced(t); });
}
template <typename T>
bool is_traced(const T&) {
  return false;
}

inline variable_list as_list(const at::Tensor& t) { return {t}; }
inline variable_list as_list(variable_list list) { return list; }

inline c10::OperatorHandle find_operator(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
}

// The traced path: the operator redispatched below autograd, its backward companion after it.
class TracedOperatorFunction : public torch::autograd::Function<TracedOperatorFunction> {
 public:
  // tensors: the defined tensor arguments (autograd's edges), at `positions` among `args`.
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors,
                               const OperatorInfo& info, const std::vector<c10::IValue>& args,
                               const std::vector<int64_t>& positions) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::Stack stack(args.begin(), args.end());
    find_operator(info.name).callBoxed(&stack);
    variable_list outputs;
    for (const c10::IValue& value : stack) outputs.push_back(value.toTensor());
    ctx->save_for_backward({outputs[0]});
    c10::impl::GenericList saved_args(c10::AnyType::get());
    for (const c10::IValue& value : args) saved_args.push_back(value);
    ctx->saved_data["args"] = saved_args;
    ctx->saved_data["positions"] = positions;
    ctx->saved_data["info"] = reinterpret_cast<int64_t>(&info);  // a static of the library
    for (size_t i = 1; i < outputs.size(); ++i) ctx->mark_non_differentiable({outputs[i]});
    ctx->set_materialize_grads(false);  // only the first output has a gradient
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

}  // namespace operator_autograd_detail

// A call under a torch.func transform, refused in one line: its wrapped tensors cannot enter the
// kernels, and an eager C++ Function cannot take part in the transform (torch's own check, which
// the Function would otherwise fail with a message that names neither the operator nor a way out).
inline void refuse_torch_func(const std::string& name, const std::string& torch_route) {
  const std::unique_ptr<at::functorch::FuncTorchTLSBase>& functorch =
      at::functorch::functorchTLSAccessor();
  if (!functorch) return;  // torch.func has not run on this thread
  try {
    functorch->checkSupportsCppAutogradFunction();
  } catch (const c10::Error&) {
    TORCH_CHECK(false, name, ": torch.func transforms cannot enter the compiled kernels; set ",
                torch_route,
                " (PyTorch's operations, where torch.func.grad and torch.func.vjp work)");
  }
}

// The gradients a backward computed, unchanged outside create_graph; under it, outputs of a node
// that refuses `info`'s second derivatives, with edges to whatever the gradients depend on: the
// inputs of the running backward's node and the incoming gradients `grad_outputs`.
inline torch::autograd::variable_list refuse_second_derivatives(
    torch::autograd::variable_list gradients, const torch::autograd::variable_list& grad_outputs,
    const OperatorInfo& info) {
  if (!at::GradMode::is_enabled()) return gradients;
  torch::autograd::edge_list edges;
  if (const std::shared_ptr<torch::autograd::Node> running = torch::autograd::get_current_node()) {
    for (const torch::autograd::Edge& edge : running->next_edges()) {
      if (edge.is_valid()) edges.push_back(edge);
    }
  }
  for (const at::Tensor& g : grad_outputs) {
    if (g.defined() && g.requires_grad()) edges.push_back(torch::autograd::impl::gradient_edge(g));
  }
  if (edges.empty()) return gradients;
  const auto refusal = std::make_shared<torch::autograd::Error>(
      c10::str(info.name, ": second derivatives (a gradient of this operator's gradient) are not "
               "computed by its compiled kernels; set ", info.torch_route,
               " to compute them with PyTorch's operations"),
      std::move(edges));
  for (at::Tensor& g : gradients) {
    if (!g.defined()) continue;
    g = g.detach();
    torch::autograd::set_history(g, refusal);
  }
  return gradients;
}

inline torch::autograd::variable_list operator_autograd_detail::TracedOperatorFunction::backward(
    AutogradContext* ctx, variable_list grads) {
  const OperatorInfo& info =
      *reinterpret_cast<const OperatorInfo*>(ctx->saved_data["info"].toInt());
  const std::vector<int64_t> positions = ctx->saved_data["positions"].toIntVector();
  variable_list result(positions.size() + 3);  // the tensors, then info, args and positions
  if (!grads[0].defined()) return result;
  c10::Stack stack{grads[0]};
  for (const c10::IValue& value : ctx->saved_data["args"].toList()) stack.push_back(value);
  find_operator(info.backward_name).callBoxed(&stack);
  const std::vector<at::Tensor> per_argument = stack[0].toTensorVector();
  for (size_t i = 0; i < positions.size(); ++i) {
    if (info.takes_gradient(positions[i])) result[i] = per_argument[positions[i]];
  }
  return refuse_second_derivatives(result, grads, info);
}

// The Autograd kernel's call: the eager Function on real CPU tensors, else the traced path.
template <class EagerFunction, typename... Args>
torch::autograd::variable_list operator_autograd(const Args&... args) {
  using namespace operator_autograd_detail;
  const OperatorInfo& info = EagerFunction::info();
  refuse_torch_func(info.name, info.torch_route);
  if (!(is_traced(args) || ...)) return as_list(EagerFunction::apply(args...));
  const std::vector<c10::IValue> boxed{c10::IValue(args)...};
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> positions;
  for (size_t i = 0; i < boxed.size(); ++i) {
    if (boxed[i].isTensor()) {
      tensors.push_back(boxed[i].toTensor());
      positions.push_back(static_cast<int64_t>(i));
    }
  }
  return TracedOperatorFunction::apply(at::TensorList(tensors), info, boxed, positions);
}

namespace operator_autograd_detail {

// An argument of the recomputation: a differentiable tensor as a fresh leaf (collected), the
// rest as given.
struct Leaves {
  const OperatorInfo& info;
  int64_t position = 0;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> positions;

  at::Tensor operator()(const at::Tensor& t) {
    const int64_t here = position++;
    if (!t.defined() || !info.takes_gradient(here)) return t;
    tensors.push_back(t.detach().requires_grad_(true));
    positions.push_back(here);
    return tensors.back();
  }
  c10::optional<at::Tensor> operator()(const c10::optional<at::Tensor>& t) {
    if (!t.has_value()) {
      ++position;
      return t;
    }
    return (*this)(*t);
  }
  template <typename T>
  T operator()(const T& value) {
    ++position;
    return value;
  }
};

}  // namespace operator_autograd_detail

// The CPU kernel of an operator's `<name>_backward` companion: one gradient per argument of the
// forward (an empty tensor where an argument takes none), from the gradient of its first
// output, by running the eager Function's forward and backward again.
template <class EagerFunction, typename... Args>
std::vector<at::Tensor> recomputed_gradients(const at::Tensor& grad, const Args&... args) {
  using namespace operator_autograd_detail;
  Leaves leaves{EagerFunction::info()};
  torch::autograd::variable_list outputs;
  {
    at::AutoGradMode grad_mode(true);
    // braced initialisation evaluates left to right: positions count in argument order
    std::tuple<decltype(leaves(args))...> prepared{leaves(args)...};
    outputs = as_list(std::apply(
        [](const auto&... prepared_args) { return EagerFunction::apply(prepared_args...); },
        prepared));
  }
  std::vector<at::Tensor> result(sizeof...(Args));
  for (at::Tensor& none : result) none = at::empty({0}, grad.options());  // no aliases
  if (leaves.tensors.empty()) return result;
  const torch::autograd::variable_list gradients = torch::autograd::grad(
      {outputs[0]}, leaves.tensors, {grad}, /*retain_graph=*/false, /*create_graph=*/false,
      /*allow_unused=*/true);
  for (size_t i = 0; i < gradients.size(); ++i) {
    const at::Tensor& g = gradients[i];
    at::Tensor& slot = result[leaves.positions[i]];
    if (!g.defined()) {
      slot = at::zeros_like(leaves.tensors[i], at::MemoryFormat::Contiguous);
    } else if (g.is_alias_of(grad)) {  // an argument added to the output: its gradient is grad
      slot = g.clone(at::MemoryFormat::Contiguous);
    } else {
      slot = g.contiguous();
    }
  }
  return result;
}


namespace operator_autograd_detail {

// The first N of a Function's outputs as an operator returns them: a tensor, or a tuple of N.
template <size_t... I>
auto tensor_tuple(const variable_list& outputs, std::index_sequence<I...>) {
  return std::make_tuple(outputs[I]...);
}
template <size_t N>
auto as_returned(const variable_list& outputs) {
  if constexpr (N == 1) {
    return outputs[0];
  } else {
    return tensor_tuple(outputs, std::make_index_sequence<N>());
  }
}

}  // namespace operator_autograd_detail

// The kernels of an operator with N outputs whose eager Function is `EagerFunction`, with the
// signature of its forward (after the context), for m.impl: the CPU kernel (the forward,
// recording nothing), the Autograd kernel (`operator_autograd`) and the CPU kernel of its
// `<name>_backward` companion (`recomputed_gradients`).
template <class EagerFunction, size_t N, typename Forward = decltype(&EagerFunction::forward)>
struct OperatorKernels;
template <class EagerFunction, size_t N, typename... Args>
struct OperatorKernels<EagerFunction, N,
                       torch::autograd::variable_list (*)(torch::autograd::AutogradContext*,
                                                          Args...)> {
  static auto cpu(Args... args) {
    torch::autograd::AutogradContext unrecorded;  // what the forward saves goes nowhere
    return operator_autograd_detail::as_returned<N>(EagerFunction::forward(&unrecorded, args...));
  }
  static auto autograd(Args... args) {
    return operator_autograd_detail::as_returned<N>(operator_autograd<EagerFunction>(args...));
  }
  static std::vector<at::Tensor> backward(const at::Tensor& grad, Args... args) {
    return recomputed_gradients<EagerFunction>(grad, args...);
  }
};

// The schema of `<name>_backward` from the operator's: the gradient of its first output, then
// its arguments; one gradient per argument.
inline std::string backward_schema(const std::string& forward) {
  const size_t open = forward.find('('), close = forward.rfind(") ->");
  return forward.substr(0, open) + "_backward(Tensor grad, " +
         forward.substr(open + 1, close - open - 1) + ") -> Tensor[]";
}

}  // namespace local_attn

