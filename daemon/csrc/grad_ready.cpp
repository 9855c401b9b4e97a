// A parameter's gradient, final: libtorch's post-accumulate-grad hook (what Python's
// `Tensor.register_post_accumulate_grad_hook` installs), which tch 0.26 does not bind. The
// autograd engine calls it once per backward pass for a leaf, after the gradient of every use has
// been accumulated into `.grad`: the moment a bucket's reduction may start (as DDP's hooks do). A
// hook already on the tensor (a Python one) is kept and called first, and put back on removal.

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "trainerd_shim.h"

#include <cstddef>
#include <memory>

namespace {

using trainerd_shim::guarded;
using ReadyFn = void (*)(void *ctx, std::size_t index);

struct Ready : torch::autograd::PostAccumulateGradHook {
  Ready(ReadyFn fn, void *ctx, std::size_t index, std::unique_ptr<PostAccumulateGradHook> previous)
      : fn(fn), ctx(ctx), index(index), previous(std::move(previous)) {}

  void operator()(const torch::autograd::Variable &tensor) override {
    if (previous) {
      (*previous)(tensor);
    }
    fn(ctx, index);
  }

  ReadyFn fn;
  void *ctx;
  std::size_t index;
  std::unique_ptr<PostAccumulateGradHook> previous;
};

} // namespace

extern "C" {

// Calls `fn(ctx, index)` each time the gradient of `tensor` is final in a backward pass, until
// `trainerd_grad_ready_unhook`. A tensor that is not a leaf requiring grad (a frozen parameter)
// never gets one: it is left as it is.
char *trainerd_grad_ready_hook(const at::Tensor *tensor, ReadyFn fn, void *ctx, std::size_t index) {
  return guarded([&] {
    if (!tensor->is_leaf() || !tensor->requires_grad()) {
      return;
    }
    auto previous = std::move(torch::autograd::impl::post_acc_grad_hooks(*tensor));
    torch::autograd::impl::set_post_acc_grad_hooks(*tensor,
                                                   std::make_unique<Ready>(fn, ctx, index, std::move(previous)));
  });
}

// Makes `grad` (of `tensor`'s shape, dtype and device: a view of a bucket) `tensor`'s gradient, so
// that the next backward pass accumulates into it in place (DDP's gradient_as_bucket_view).
char *trainerd_set_grad(const at::Tensor *tensor, const at::Tensor *grad) {
  return guarded([&] {
    TORCH_CHECK(grad->sizes() == tensor->sizes() && grad->dtype() == tensor->dtype() &&
                    grad->device() == tensor->device(),
                "a gradient unlike its parameter");
    const_cast<at::Tensor *>(tensor)->mutable_grad() = *grad;
  });
}

// Lets `tensor`'s gradient go (Python's `p.grad = None`): its memory is freed once nothing else
// holds it, and the next backward pass makes a new one. Allowed inside a post-accumulate-grad hook,
// as PyTorch's optimizer-in-backward does.
char *trainerd_release_grad(const at::Tensor *tensor) {
  return guarded([&] { const_cast<at::Tensor *>(tensor)->mutable_grad().reset(); });
}

// Removes the hook `trainerd_grad_ready_hook` put on `tensor`, putting back the one it found.
char *trainerd_grad_ready_unhook(const at::Tensor *tensor) {
  return guarded([&] {
    auto &hook = torch::autograd::impl::post_acc_grad_hooks(*tensor);
    if (auto *ready = dynamic_cast<Ready *>(hook.get())) {
      auto previous = std::move(ready->previous);
      torch::autograd::impl::set_post_acc_grad_hooks(*tensor, std::move(previous));
    }
  });
}

} // extern "C"
