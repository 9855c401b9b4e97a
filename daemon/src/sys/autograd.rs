//! What autograd owns: a parameter's `.grad`.

use tch::{Kind, Tensor};

/// Gives `p` a gradient of zeros where it has none. Autograd owns `.grad`, so it is made through
/// a backward of zero rather than set. Used where a gradient arrives from elsewhere (the
/// reduction, a replayed step) for a parameter this process's backward did not reach.
pub(crate) fn ensure_grad(p: &Tensor) {
    if !p.grad().defined() {
        tch::with_grad(|| (p.sum(Kind::Float) * 0.0).backward());
    }
}
