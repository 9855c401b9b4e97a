//! A TorchScript module through the C++ shim (`shim.cpp`): loaded on a device, its parameters and
//! buffers as tensors that share the module's storage (an in-place update reaches the module),
//! its training mode, and its forward pass with the graph executor's optimisations off.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;

use trainerd_sdk::abi::C_tensor;
use trainerd_sdk::tch::{Device, Tensor};

type TensorCallback = unsafe extern "C" fn(data: *mut c_void, name: *const c_char, tensor: *mut C_tensor);

unsafe extern "C" {
    fn tds_load(path: *const c_char, device: c_int, out: *mut *mut c_void) -> *mut c_char;
    fn tds_free(module: *mut c_void);
    fn tds_tensors(module: *mut c_void, buffers: c_int, data: *mut c_void, f: TensorCallback) -> *mut c_char;
    fn tds_train(module: *mut c_void, on: c_int) -> *mut c_char;
    fn tds_forward(module: *mut c_void, xs: *mut C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
    fn tds_free_string(s: *mut c_char);
}

/// A loaded TorchScript module (owned; freed on drop).
pub struct ScriptModule {
    raw: *mut c_void,
}

/// What libtorch said, from a shim call's result (null: success).
fn check(status: *mut c_char) -> Result<(), String> {
    if status.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status is a NUL-terminated string malloc'd by the shim.
    let text = unsafe { CStr::from_ptr(status) }.to_string_lossy().into_owned();
    // SAFETY: released once, by the shim's allocator.
    unsafe { tds_free_string(status) };
    Err(text.trim().to_string())
}

unsafe extern "C" fn collect(data: *mut c_void, name: *const c_char, tensor: *mut C_tensor) {
    // SAFETY: `data` is the Vec that `tensors` passes; `name` a NUL-terminated string; `tensor` a
    // new torch::Tensor that the Vec now owns.
    unsafe {
        let out = &mut *(data as *mut Vec<(String, Tensor)>);
        out.push((CStr::from_ptr(name).to_string_lossy().into_owned(), Tensor::from_ptr(tensor)));
    }
}

impl ScriptModule {
    /// Loads the module at `path` onto `device`; libtorch's message when it cannot.
    pub fn load(path: &Path, device: Device) -> Result<ScriptModule, String> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| "the path holds a NUL byte")?;
        let raw_device = match device {
            Device::Cuda(n) => n as c_int,
            _ => -1,
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: a valid C string and out pointer.
        check(unsafe { tds_load(c_path.as_ptr(), raw_device, &mut raw) })?;
        Ok(ScriptModule { raw })
    }

    fn tensors(&self, buffers: bool) -> Result<Vec<(String, Tensor)>, String> {
        let mut out: Vec<(String, Tensor)> = Vec::new();
        // SAFETY: a live module; `collect` appends to `out`, which outlives the call.
        check(unsafe { tds_tensors(self.raw, c_int::from(buffers), &mut out as *mut _ as *mut c_void, collect) })?;
        Ok(out)
    }

    /// Its parameters, recursively, by their dotted names (`conv.weight`).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>, String> {
        self.tensors(false)
    }

    /// Its buffers, recursively, by their dotted names (`bn.running_mean`).
    pub fn buffers(&self) -> Result<Vec<(String, Tensor)>, String> {
        self.tensors(true)
    }

    /// Training mode on or off (dropout, BatchNorm's batch statistics), recursively.
    pub fn train(&self, on: bool) -> Result<(), String> {
        // SAFETY: a live module.
        check(unsafe { tds_train(self.raw, c_int::from(on)) })
    }

    /// Its forward pass on `xs`, which must return one tensor.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor, String> {
        let mut out = std::ptr::null_mut();
        // SAFETY: a live module and tensor (borrowed for the call); `out` receives a new tensor.
        check(unsafe { tds_forward(self.raw, xs.as_ptr() as *mut C_tensor, &mut out) })?;
        // SAFETY: a new torch::Tensor from the shim, now owned here.
        Ok(unsafe { Tensor::from_ptr(out) })
    }
}

impl Drop for ScriptModule {
    fn drop(&mut self) {
        // SAFETY: loaded by `load`, freed once.
        unsafe { tds_free(self.raw) }
    }
}
