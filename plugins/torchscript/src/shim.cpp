// What tch 0.26 does not bind of a TorchScript module, for the torchscript plugin: its buffers
// (`named_buffers`: BatchNorm's running statistics must be state that the daemon averages,
// checkpoints and transfers, and tch lists only `named_parameters`), and a forward pass that
// runs with the graph executor's optimisations off on the calling thread (the setting is
// thread-local in libtorch, and profiling and fusion would change the numerics after a resume).
//
// Tensors go out as `torch::Tensor*` that the Rust side owns (tch's C_tensor). Every function
// catches what libtorch throws and returns it as a malloc'd message (null on success).

#include <torch/script.h>

#include "trainerd_shim.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace {

using trainerd_shim::guarded;

torch::Device device_of(int raw) { return raw < 0 ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, raw); }

} // namespace

extern "C" {

typedef void (*tds_tensor_callback)(void *data, const char *name, torch::Tensor *tensor);

char *tds_load(const char *path, int device, void **out) {
  return guarded([&] {
    torch::jit::setGraphExecutorOptimize(false);
    *out = new torch::jit::Module(torch::jit::load(path, device_of(device)));
  });
}

void tds_free(void *module) { delete static_cast<torch::jit::Module *>(module); }

char *tds_tensors(void *module, int buffers, void *data, tds_tensor_callback f) {
  return guarded([&] {
    auto *m = static_cast<torch::jit::Module *>(module);
    if (buffers) {
      for (const auto &b : m->named_buffers(true)) {
        f(data, b.name.c_str(), new torch::Tensor(b.value));
      }
    } else {
      for (const auto &p : m->named_parameters(true)) {
        f(data, p.name.c_str(), new torch::Tensor(p.value));
      }
    }
  });
}

char *tds_train(void *module, int on) {
  return guarded([&] { static_cast<torch::jit::Module *>(module)->train(on != 0); });
}

char *tds_forward(void *module, torch::Tensor *xs, torch::Tensor **out) {
  return guarded([&] {
    torch::jit::setGraphExecutorOptimize(false);
    auto result = static_cast<torch::jit::Module *>(module)->forward({*xs});
    if (!result.isTensor()) {
      throw std::runtime_error("its forward returned " + result.tagKind() +
                               ", not a tensor (trainerd trains a module whose forward returns one tensor of "
                               "outputs)");
    }
    *out = new torch::Tensor(result.toTensor());
  });
}

void tds_free_string(char *s) { std::free(s); }

} // extern "C"
