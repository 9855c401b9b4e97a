// libtorch's autocast switches, which tch 0.26 binds only for CUDA and without a dtype: mixed
// precision for the forward pass on the CPU (bfloat16) and on CUDA (bfloat16 or float16). The
// state is thread-local in libtorch; a region is entered and left on the thread that computes.
// Leaving the outermost region clears autocast's cache of cast weights, which would otherwise
// outlive the optimizer's in-place update of the weights they were cast from.

#include <ATen/autocast_mode.h>

#include "trainerd_shim.h"

#include <cstdlib>
#include <string>

namespace {

using trainerd_shim::guarded;

at::DeviceType device_type(int cuda) { return cuda ? at::kCUDA : at::kCPU; }

} // namespace

extern "C" {

// Enters an autocast region on `cuda ? CUDA : CPU` casting to `half ? float16 : bfloat16`; writes
// the settings it replaced, for `trainerd_autocast_exit` to put back (as torch.autocast's exit).
char *trainerd_autocast_enter(int cuda, int half, int *was_enabled, int *was_dtype) {
  return guarded([&] {
    auto device = device_type(cuda);
    *was_enabled = at::autocast::is_autocast_enabled(device) ? 1 : 0;
    *was_dtype = static_cast<int>(at::autocast::get_autocast_dtype(device));
    at::autocast::set_autocast_dtype(device, half ? at::kHalf : at::kBFloat16);
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::increment_nesting();
  });
}

// Leaves the region `trainerd_autocast_enter` entered, putting back what it replaced.
char *trainerd_autocast_exit(int cuda, int was_enabled, int was_dtype) {
  return guarded([&] {
    auto device = device_type(cuda);
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(device, was_enabled != 0);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(was_dtype));
  });
}

// Whether autocast is on for the device on this thread (for tests).
int trainerd_autocast_enabled(int cuda) { return at::autocast::is_autocast_enabled(device_type(cuda)) ? 1 : 0; }

void trainerd_autocast_free(char *s) { std::free(s); }

} // extern "C"
