// The C boundary of trainerd's C++ shims (the daemon's autocast switch, the torchscript plugin's
// module): a libtorch exception becomes a malloc'd message that the Rust side copies and frees,
// null meaning success. A plugin with a shim of its own may include it too.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace trainerd_shim {

// `text` as a malloc'd C string (freed with std::free).
inline char *message(const std::string &text) {
  char *out = static_cast<char *>(std::malloc(text.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, text.c_str(), text.size() + 1);
  }
  return out;
}

// Runs `f`: null, or what it threw (libtorch's message without its C++ backtrace).
template <typename F> char *guarded(F f) {
  try {
    f();
    return nullptr;
  } catch (const c10::Error &e) {
    return message(e.what_without_backtrace());
  } catch (const std::exception &e) {
    return message(e.what());
  } catch (...) {
    return message("unknown C++ exception");
  }
}

} // namespace trainerd_shim
