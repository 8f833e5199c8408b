// Linear layers over oneDNN-prepacked weights, called from the compiled CPU decode step
// without Python: swaserve::prepacked_linear_native (see models/prepacked.py).
//
// The blocked copy of a weight is an opaque oneDNN tensor, which a traced graph cannot take as
// an input; the graph passes the weight's parameter (`source`) instead, and this op runs
// mkldnn::_linear_pointwise over the copy held for the parameter's address. Python holds the
// copies (`prepacked.pack`) and mirrors them here (`hold_prepacked` / `forget_prepacked`, the
// latter when the parameter is freed).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Held {
  at::Tensor packed;
  std::vector<int64_t> shape;  // the source's
  int64_t out_features;
};

std::shared_mutex held_mutex;

std::unordered_map<int64_t, Held>& held() {
  static std::unordered_map<int64_t, Held> copies;  // source address → its copy
  return copies;
}

int64_t address_of(const at::Tensor& t) {
  return reinterpret_cast<int64_t>(t.data_ptr());
}

void hold_prepacked(const at::Tensor& source, const at::Tensor& packed, int64_t out_features) {
  std::unique_lock<std::shared_mutex> lock(held_mutex);
  held()[address_of(source)] = Held{packed, source.sizes().vec(), out_features};
}

void forget_prepacked(int64_t address) {
  std::unique_lock<std::shared_mutex> lock(held_mutex);
  held().erase(address);
}

at::Tensor prepacked_linear_native(
    const at::Tensor& x,
    const at::Tensor& source,
    const std::optional<at::Tensor>& bias,
    int64_t out_features) {
  at::Tensor packed;
  {
    std::shared_lock<std::shared_mutex> lock(held_mutex);
    const auto it = held().find(address_of(source));
    TORCH_CHECK(
        it != held().end() && it->second.shape == source.sizes().vec(),
        "swaserve::prepacked_linear_native: no prepacked weight is held for the ",
        source.sizes(), " tensor it was given (prepacked.pack it first)");
    TORCH_CHECK(
        it->second.out_features == out_features,
        "swaserve::prepacked_linear_native: the copy held has ", it->second.out_features,
        " output features, the call asks for ", out_features);
    packed = it->second.packed;
  }
  if (x.numel() == 0) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    return at::empty(shape, x.options());
  }
  static const c10::OperatorHandle linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x.contiguous());
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back("none");
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  linear.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(swaserve, m) {
  m.def("hold_prepacked(Tensor source, Tensor packed, int out_features) -> ()", &hold_prepacked);
  m.def("forget_prepacked(int address) -> ()", &forget_prepacked);
  m.def(
      "prepacked_linear_native(Tensor x, Tensor source, Tensor? bias, int out_features) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(swaserve, CPU, m) {
  m.impl("prepacked_linear_native", &prepacked_linear_native);
}
