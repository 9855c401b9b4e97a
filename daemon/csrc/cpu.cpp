// The CPU kernel set libtorch dispatches to (DEFAULT, AVX2, AVX512 on x86-64), as libtorch resolved
// it: from ATEN_CPU_CAPABILITY when set, else from the CPU. It is resolved once per process, at
// the first kernel; asking resolves it too.

#include <ATen/Version.h>

#include <cstring>
#include <string>

extern "C" {

// Writes libtorch's name of its CPU capability into `out` (NUL-terminated, at most `len` bytes);
// 0 on success, -1 when libtorch threw.
int trainerd_cpu_capability(char *out, int len) {
  try {
    std::string name = at::get_cpu_capability();
    std::strncpy(out, name.c_str(), static_cast<size_t>(len) - 1);
    out[len - 1] = '\0';
    return 0;
  } catch (...) {
    return -1;
  }
}

} // extern "C"
