// The banded attention operators, declared once for every backend, and their CPU
// implementations. The module is imported from Python as local_attn_fairseq._banded_C only to
// run these registrations (autograd: banded_attention_autograd.cpp; fake kernels:
// local_attn_fairseq/ops/banded_attention.py).
#include <Python.h>

#include "banded_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>

namespace local_attn {

at::ScalarType lse_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor contiguous_mask(const c10::optional<at::Tensor>& mask) {
  if (!mask.has_value() || !mask->defined()) return at::Tensor();
  return mask->to(at::kBool).contiguous();
}

namespace {

std::string shape_of(const at::Tensor& t) { return c10::str(t.sizes()); }

void check_windows(at::IntArrayRef window, int64_t heads, const char* name) {
  TORCH_CHECK(static_cast<int64_t>(window.size()) == heads, "banded_attention: ", name,
              " must give one window per head (", heads, " heads), got ", window.size());
  for (int64_t w : window) {
    TORCH_CHECK(w >= 0, "banded_attention: ", name, " windows must be >= 0, got ", w);
  }
}

void check_mask(const at::Tensor& mask, at::IntArrayRef expected, const at::Tensor& q,
                const char* name) {
  if (!mask.defined()) return;
  TORCH_CHECK(mask.sizes() == expected, "banded_attention: ", name, " must have shape ",
              expected, ", got ", shape_of(mask));
  TORCH_CHECK(mask.device() == q.device(), "banded_attention: ", name, " is on ", mask.device(),
              " but q is on ", q.device());
}

}  // namespace

BandProblem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         at::IntArrayRef left, at::IntArrayRef right, const at::Tensor& padding,
                         const at::Tensor& keep, double scale, double dropout_p) {
  TORCH_CHECK(q.dim() == 4, "banded_attention: q must be (batch, heads, length, dim), got ",
              shape_of(q));
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "banded_attention: q, k and v must have the same shape, got ", shape_of(q), ", ",
              shape_of(k), " and ", shape_of(v));
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "banded_attention: q, k and v must have the same dtype");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "banded_attention: q, k and v must be on the same device");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()),
              "banded_attention: expected floating point inputs, got ", q.scalar_type());
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0,
              "banded_attention: dropout_p must be in [0, 1], got ", dropout_p);
  BandProblem pb;
  pb.batch = q.size(0);
  pb.heads = q.size(1);
  pb.length = q.size(2);
  pb.dim = q.size(3);
  check_windows(left, pb.heads, "left");
  check_windows(right, pb.heads, "right");
  pb.left.assign(left.begin(), left.end());
  pb.right.assign(right.begin(), right.end());
  for (int64_t h = 0; h < pb.heads; ++h) {
    pb.max_left = std::max(pb.max_left, pb.left[h]);
    pb.max_right = std::max(pb.max_right, pb.right[h]);
  }
  pb.scale = scale;
  pb.keep_scale = dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
  check_mask(padding, {pb.batch, pb.length}, q, "key_padding_mask");
  check_mask(keep, {pb.batch, pb.heads, pb.length, pb.width()}, q, "dropout_keep");
  pb.key_padding = padding.defined() ? padding.data_ptr<bool>() : nullptr;
  pb.keep = keep.defined() ? keep.data_ptr<bool>() : nullptr;
  return pb;
}

namespace {

std::tuple<at::Tensor, at::Tensor> banded_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef left,
    at::IntArrayRef right, const c10::optional<at::Tensor>& key_padding_mask,
    const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
  const at::Tensor padding = contiguous_mask(key_padding_mask);
  const at::Tensor keep = contiguous_mask(dropout_keep);
  const BandProblem pb = make_problem(q, k, v, left, right, padding, keep, scale, dropout_p);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  at::Tensor lse =
      at::empty({pb.batch, pb.heads, pb.length}, qc.options().dtype(lse_dtype(q.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "banded_forward_cpu",
                                  [&] {
                                    using acc_t = at::opmath_type<scalar_t>;
                                    forward_cpu<scalar_t, acc_t>(
                                        pb, qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(),
                                        vc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                        lse.data_ptr<acc_t>());
                                  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, at::IntArrayRef left, at::IntArrayRef right,
    const c10::optional<at::Tensor>& key_padding_mask,
    const c10::optional<at::Tensor>& dropout_keep, double scale, double dropout_p) {
  const at::Tensor padding = contiguous_mask(key_padding_mask);
  const at::Tensor keep = contiguous_mask(dropout_keep);
  const BandProblem pb = make_problem(q, k, v, left, right, padding, keep, scale, dropout_p);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "banded_backward: grad_out and out must have the shape of q");
  TORCH_CHECK(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "banded_backward: grad_out and out must have the dtype of q");
  TORCH_CHECK(lse.sizes() == at::IntArrayRef({pb.batch, pb.heads, pb.length}) &&
                  lse.scalar_type() == lse_dtype(q.scalar_type()),
              "banded_backward: lse must be the (batch, heads, length) ",
              lse_dtype(q.scalar_type()), " tensor returned by banded_forward");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor gc = grad_out.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  at::Tensor dq = at::empty(qc.sizes(), qc.options());
  const auto acc_options = qc.options().dtype(lse_dtype(q.scalar_type()));
  // zero-filled here, not by at::zeros: two operator calls fewer per backward
  at::Tensor dk_acc = at::empty(qc.sizes(), acc_options);
  at::Tensor dv_acc = at::empty(qc.sizes(), acc_options);
  std::memset(dk_acc.data_ptr(), 0, dk_acc.nbytes());
  std::memset(dv_acc.data_ptr(), 0, dv_acc.nbytes());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "banded_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        backward_cpu<scalar_t, acc_t>(pb, gc.data_ptr<scalar_t>(), qc.data_ptr<scalar_t>(),
                                      kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                                      oc.data_ptr<scalar_t>(), lc.data_ptr<acc_t>(),
                                      dq.data_ptr<scalar_t>(), dk_acc.data_ptr<acc_t>(),
                                      dv_acc.data_ptr<acc_t>());
      });
  return {dq, dk_acc.to(q.scalar_type()), dv_acc.to(q.scalar_type())};
}

}  // namespace

TORCH_LIBRARY(local_attn, m) {
  // Fake (meta) kernels are registered from Python, in this module:
  m.set_python_module("local_attn_fairseq.ops.banded_attention");
  m.def(
      "banded_forward(Tensor q, Tensor k, Tensor v, int[] left, int[] right, "
      "Tensor? key_padding_mask, Tensor? dropout_keep, float scale, float dropout_p) "
      "-> (Tensor, Tensor)");
  m.def(
      "banded_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "int[] left, int[] right, Tensor? key_padding_mask, Tensor? dropout_keep, float scale, "
      "float dropout_p) -> (Tensor, Tensor, Tensor)");
  // The tensor-core kernels (float16/bfloat16, head dims 32/64/128, sm_80+): same arguments.
  m.def(
      "banded_forward_tensor_core(Tensor q, Tensor k, Tensor v, int[] left, int[] right, "
      "Tensor? key_padding_mask, Tensor? dropout_keep, float scale, float dropout_p) "
      "-> (Tensor, Tensor)");
  m.def(
      "banded_backward_tensor_core(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, int[] left, int[] right, Tensor? key_padding_mask, Tensor? dropout_keep, "
      "float scale, float dropout_p) -> (Tensor, Tensor, Tensor)");
}

namespace {

// The tensor-core operators have CUDA kernels only; on CPU tensors they say so.
std::tuple<at::Tensor, at::Tensor> banded_forward_tensor_core_cpu(
    const at::Tensor& q, const at::Tensor&, const at::Tensor&, at::IntArrayRef, at::IntArrayRef,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, double) {
  TORCH_CHECK(false, "local_attn::banded_forward_tensor_core runs on CUDA tensors only, got ",
              q.device(), " tensors; use local_attn::banded_forward");
  return {};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_backward_tensor_core_cpu(
    const at::Tensor&, const at::Tensor& q, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, at::IntArrayRef, at::IntArrayRef,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, double) {
  TORCH_CHECK(false, "local_attn::banded_backward_tensor_core runs on CUDA tensors only, got ",
              q.device(), " tensors; use local_attn::banded_backward");
  return {};
}

}  // namespace

TORCH_LIBRARY_IMPL(local_attn, CPU, m) {
  m.impl("banded_forward", &banded_forward_cpu);
  m.impl("banded_backward", &banded_backward_cpu);
  m.impl("banded_forward_tensor_core", &banded_forward_tensor_core_cpu);
  m.impl("banded_backward_tensor_core", &banded_backward_tensor_core_cpu);
}

}  // namespace local_attn

// A Python module with introspection helpers and the CPU finiteness test of the operator's
// non-finite rule; importing it runs the registrations above.
namespace {

// Whether a CPU tensor holds only finite values, read in place: no operator call, no
// allocation, since banded_attention asks it on every call (for tiny tensors operator calls
// cost more than the reading). A value is NaN or +-inf exactly when its exponent bits are all
// ones: tested on the bits, as integers, so that the loop vectorises (a floating point test
// would not without -ffast-math, which would assume it away).
constexpr int64_t kFinitenessGrain = int64_t(1) << 16;  // elements a thread reads, at least

template <typename bits_t>
unsigned non_finite_in(const bits_t* bits, int64_t begin, int64_t end, bits_t exponent) {
  unsigned found = 0;
  for (int64_t i = begin; i < end; ++i) found |= (bits[i] & exponent) == exponent;
  return found;
}

template <typename bits_t>
bool exponents_finite(const at::Tensor& t, bits_t exponent) {
  const bits_t* bits = static_cast<const bits_t*>(t.const_data_ptr());
  const unsigned non_finite = at::parallel_reduce(
      int64_t(0), t.numel(), kFinitenessGrain, 0u,
      [bits, exponent](int64_t begin, int64_t end, unsigned found) {
        return found | non_finite_in(bits, begin, end, exponent);
      },
      [](unsigned a, unsigned b) { return a | b; });
  return non_finite == 0;
}

bool cpu_all_finite(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_floating_point(),
              "all_finite takes a floating point CPU tensor, got ", t.scalar_type(), " on ",
              t.device());
  // in place where the tensor holds its data (not a torch.func wrapper, which has no storage)
  if (t.is_contiguous() && t.has_storage()) {
    switch (t.scalar_type()) {
      case at::kFloat:
        return exponents_finite<uint32_t>(t, 0x7f800000u);
      case at::kDouble:
        return exponents_finite<uint64_t>(t, 0x7ff0000000000000ull);
      case at::kHalf:
        return exponents_finite<uint16_t>(t, 0x7c00u);
      case at::kBFloat16:
        return exponents_finite<uint16_t>(t, 0x7f80u);
      default:
        break;
    }
  }
  return at::isfinite(t).all().item<bool>();  // strided views, wrappers, other floating types
}

PyObject* all_finite(PyObject*, PyObject* arg) {
  if (!THPVariable_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "all_finite takes a tensor");
    return nullptr;
  }
  bool finite = false;
  try {
    finite = cpu_all_finite(THPVariable_Unpack(arg));
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
    return nullptr;
  }
  if (finite) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyObject* cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(local_attn::cpu_isa_name());
}

PyObject* built_with_cuda(PyObject*, PyObject*) {
#ifdef LOCAL_ATTN_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyObject* built_with_tensor_core(PyObject*, PyObject*) {
#ifdef LOCAL_ATTN_WITH_TENSOR_CORE
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef module_methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS, "Which copy of the CPU kernels runs: avx2 or baseline."},
    {"built_with_cuda", built_with_cuda, METH_NOARGS, "Whether the CUDA kernels were compiled."},
    {"all_finite", all_finite, METH_O,
     "Whether a floating point CPU tensor holds only finite values."},
    {"built_with_tensor_core", built_with_tensor_core, METH_NOARGS,
     "Whether the tensor-core CUDA kernels (banded_*_tensor_core) were compiled."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_banded_C",
                          "Banded attention kernels (registered as torch.ops.local_attn).", -1,
                          module_methods};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__banded_C(void) { return PyModule_Create(&module_def); }
