//! The C++ shims' boundary (`sdk/csrc/trainerd_shim.h`): a call returns null, or a libtorch
//! error's message malloc'd on the C++ side, which becomes a `TchError` here.

use std::ffi::{c_char, CStr};

unsafe extern "C" {
    fn trainerd_autocast_free(s: *mut c_char);
}

/// A shim call's `status` as a result.
pub(crate) fn status(status: *mut c_char) -> Result<(), tch::TchError> {
    if status.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status is a NUL-terminated string malloc'd by the shim.
    let text = unsafe { CStr::from_ptr(status) }.to_string_lossy().into_owned();
    // SAFETY: released once, by the shim's allocator (std::free).
    unsafe { trainerd_autocast_free(status) };
    Err(tch::TchError::Torch(text))
}
