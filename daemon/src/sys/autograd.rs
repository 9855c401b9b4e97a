//! What autograd owns: a parameter's `.grad`, and the moment it is final in a backward pass.

use std::cell::RefCell;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::{Kind, Tensor};

use super::shim::status as check;

unsafe extern "C" {
    fn trainerd_grad_ready_hook(
        tensor: *const c_void,
        f: extern "C" fn(*mut c_void, usize),
        ctx: *mut c_void,
        index: usize,
    ) -> *mut c_char;
    fn trainerd_grad_ready_unhook(tensor: *const c_void) -> *mut c_char;
    fn trainerd_set_grad(tensor: *const c_void, grad: *const c_void) -> *mut c_char;
    fn trainerd_release_grad(tensor: *const c_void) -> *mut c_char;
}

/// Gives `p` a gradient of zeros where it has none. Autograd owns `.grad`, so it is made through
/// a backward of zero rather than set. Used where a gradient arrives from elsewhere (the
/// reduction, a replayed step) for a parameter this process's backward did not reach.
pub(crate) fn ensure_grad(p: &Tensor) {
    if !p.grad().defined() {
        tch::with_grad(|| (p.sum(Kind::Float) * 0.0).backward());
    }
}

/// Makes `grad` (a tensor of `p`'s shape, kind and device) `p`'s gradient, so that the next
/// backward pass accumulates into its memory in place: the gradient is a view of a reduction's
/// bucket, as DDP's `gradient_as_bucket_view`.
pub(crate) fn set_grad(p: &Tensor, grad: &Tensor) -> Result<(), tch::TchError> {
    // SAFETY: two live tensors; libtorch checks the gradient's shape, kind and device.
    check(unsafe { trainerd_set_grad(p.as_ptr().cast(), grad.as_ptr().cast()) })
}

/// Lets `p`'s gradient go (Python's `p.grad = None`): its memory is freed once nothing else holds
/// it, and the next backward pass makes a new one (`--shard gradients`, once a bucket holds it).
pub(crate) fn release_grad(p: &Tensor) {
    // SAFETY: a live tensor; resetting its gradient cannot fail.
    let _ = check(unsafe { trainerd_release_grad(p.as_ptr().cast()) });
}

/// Zeroes every gradient `params` have in place, keeping its memory (`Tensor::zero_grad`
/// detaches it in place first, which a gradient that is a view of a bucket refuses).
pub(crate) fn zero_grads(params: &[(String, Tensor)]) {
    let _no_grad = tch::no_grad_guard();
    for (_, p) in params {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// What a hook calls, and a panic it caught (re-raised when the hooks are removed: a panic must
/// not unwind through libtorch's C++ frames).
struct Callback<'f> {
    on_ready: RefCell<&'f mut dyn FnMut(usize)>,
    panicked: RefCell<Option<Box<dyn std::any::Any + Send>>>,
}

extern "C" fn ready(ctx: *mut c_void, index: usize) {
    // SAFETY: `ctx` is the `Callback` of the `GradReady` that installed this hook, which removes
    // it before the callback is freed; a CPU backward pass runs its hooks on the calling thread,
    // the one that holds the `GradReady`, so nothing else touches it meanwhile.
    let callback = unsafe { &*(ctx as *const Callback<'_>) };
    if callback.panicked.borrow().is_some() {
        return;
    }
    let called = catch_unwind(AssertUnwindSafe(|| (callback.on_ready.borrow_mut())(index)));
    if let Err(payload) = called {
        *callback.panicked.borrow_mut() = Some(payload);
    }
}

/// libtorch's post-accumulate-grad hooks on a list of parameters (as Python's
/// `register_post_accumulate_grad_hook`): while it lives, `on_ready(i)` is called the moment
/// parameter `i`'s gradient is final in a backward pass, every use of it accumulated. A
/// parameter that gets no gradient (or never can: a frozen one) is never called for. CPU parameters only: there the autograd
/// engine runs the hooks on the thread that called backward.
pub(crate) struct GradReady<'f> {
    /// Handles on the hooked parameters.
    params: Vec<Tensor>,
    /// Boxed, so that its address (the hooks' context) stays put.
    callback: Box<Callback<'f>>,
}

impl<'f> GradReady<'f> {
    /// Hooks every parameter of `params` (leaves that require grad).
    pub(crate) fn install(params: Vec<Tensor>, on_ready: &'f mut dyn FnMut(usize)) -> Result<Self, tch::TchError> {
        let callback = Box::new(Callback { on_ready: RefCell::new(on_ready), panicked: RefCell::new(None) });
        let mut hooks = GradReady { params: Vec::with_capacity(params.len()), callback };
        let ctx = std::ptr::from_ref(&*hooks.callback).cast_mut().cast::<c_void>();
        for (i, p) in params.into_iter().enumerate() {
            // SAFETY: `p` is a live tensor; the hook is removed (in `drop`) before `ctx` is freed.
            check(unsafe { trainerd_grad_ready_hook(p.as_ptr().cast(), ready, ctx, i) })?;
            hooks.params.push(p);
        }
        Ok(hooks)
    }

    /// Removes the hooks; a panic of `on_ready` is raised again here.
    pub(crate) fn remove(mut self) {
        self.unhook();
        if let Some(payload) = self.callback.panicked.borrow_mut().take() {
            std::panic::resume_unwind(payload);
        }
    }

    fn unhook(&mut self) {
        for p in self.params.drain(..) {
            // SAFETY: a live tensor this value hooked. Removing a hook cannot fail but for a
            // tensor without autograd metadata, which a hooked one has.
            let _ = check(unsafe { trainerd_grad_ready_unhook(p.as_ptr().cast()) });
        }
    }
}

impl Drop for GradReady<'_> {
    fn drop(&mut self) {
        self.unhook();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn param(n: i64) -> Tensor {
        Tensor::ones([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)
    }

    #[test]
    fn each_gradient_is_said_final_once_after_every_use_is_accumulated() {
        let (a, b, unused) = (param(2), param(3), param(1));
        let mut said = Vec::new();
        let mut on_ready = |i: usize| said.push(i);
        let hooks =
            GradReady::install(vec![a.shallow_clone(), b.shallow_clone(), unused.shallow_clone()], &mut on_ready)
                .unwrap();
        // `a` is used twice, at both ends of the graph: said once, after both uses.
        let loss = (&a * 2.0).sum(Kind::Float) + ((&b * &a.sum(Kind::Float)).sum(Kind::Float));
        loss.backward();
        hooks.remove();
        assert_eq!(said.iter().filter(|&&i| i == 0).count(), 1, "{said:?}");
        assert_eq!(said.iter().filter(|&&i| i == 1).count(), 1, "{said:?}");
        assert!(!said.contains(&2), "a parameter with no gradient is never said: {said:?}");
        assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), vec![5.0, 5.0], "2 + the sum of b");
    }

    #[test]
    fn a_gradient_set_to_a_view_is_accumulated_into_in_place() {
        let p = param(3);
        let bucket = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        set_grad(&p, &bucket.narrow(0, 1, 3)).unwrap();
        (&p * 2.0).sum(Kind::Float).backward();
        zero_grads(&[("p".into(), p.shallow_clone())]);
        (&p * 3.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&bucket).unwrap(), vec![0.0, 3.0, 3.0, 3.0, 0.0]);
        let wrong = set_grad(&p, &bucket.narrow(0, 0, 2)).unwrap_err().to_string();
        assert!(wrong.contains("a gradient unlike its parameter"), "{wrong}");
    }

    #[test]
    fn removed_hooks_are_not_called_again() {
        let p = param(2);
        let mut count = 0;
        let mut on_ready = |_: usize| count += 1;
        GradReady::install(vec![p.shallow_clone()], &mut on_ready).unwrap().remove();
        p.sum(Kind::Float).backward();
        assert_eq!(count, 0);
    }

    #[test]
    fn a_panic_in_the_callback_is_raised_when_the_hooks_are_removed() {
        let p = param(2);
        let mut on_ready = |_: usize| panic!("said");
        let hooks = GradReady::install(vec![p.shallow_clone()], &mut on_ready).unwrap();
        p.sum(Kind::Float).backward();
        let raised = catch_unwind(AssertUnwindSafe(|| hooks.remove())).unwrap_err();
        assert_eq!(raised.downcast_ref::<&str>(), Some(&"said"));
    }
}
