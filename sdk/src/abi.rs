//! The C ABI between the daemon and a plugin: the header that the plugin's one entry symbol
//! returns, the build facts in it, and the vtable of `extern "C"` functions.
//!
//! Rules both sides keep:
//! - The first three header fields (`magic`, `abi_version`, `header_size`) never change layout, so
//!   a daemon can read them from a plugin of any version and refuse it with a clear message.
//! - Tensors cross only as raw libtorch handles (`*mut C_tensor`) that the receiver *borrows*: an
//!   input handle stays owned by the daemon, an output handle stays owned by the plugin and is
//!   valid until the next call on the same object. The receiver takes a shallow clone (a new
//!   reference to the same storage) when it keeps one. Each side frees only what it allocated.
//! - Every fallible function returns a [`Status`]: null for success, else an error message owned
//!   by the plugin that the daemon copies and hands back through `free_string`.
//! - No panic crosses the boundary: the plugin side catches it and returns it as an error.

use std::ffi::{c_char, c_void};

pub use torch_sys::C_tensor;

/// The first eight bytes of every plugin header.
pub const MAGIC: [u8; 8] = *b"TRAINERD";

/// Version of the layout behind `header_size`: bumped on any change to the header, the vtable or
/// what crosses it. 2: the input context's `first_step`, and the plugin info's `columns`. 3: plugin
/// arguments (`arguments`; `info` and `create` take them), and the info's `identity`. 4: batches of
/// named columns ([`RawBatch`]); `step` (loss and metrics in one call) and `predict` in place of
/// `forward`, `loss` and `metrics`. 5: the `text` column kind (raw text packed into blocks), and
/// the info's `vocab_size`.
pub const ABI_VERSION: u32 = 5;

/// Name of the one symbol a plugin exports (a `extern "C" fn() -> *const PluginHeader`).
pub const ENTRY_SYMBOL: &str = "trainerd_plugin_entry";

/// Version of the sdk crate a plugin or daemon was built with.
pub const SDK_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Version of the `tch` crate this sdk pins (kept equal to the workspace's exact pin; a unit test
/// checks it against Cargo.lock).
pub const TCH_VERSION: &str = "0.26.0";

/// Version of the libtorch this build links (from the PyTorch wheel or libtorch archive).
pub const LIBTORCH_VERSION: &str = env!("TRAINERD_LIBTORCH_VERSION");

/// Target triple of this build.
pub const TARGET: &str = env!("TRAINERD_BUILD_TARGET");

/// A borrowed UTF-8 string: pointer and length, no terminator.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StrRef {
    /// First byte.
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl StrRef {
    /// A reference to a string that lives for the whole program.
    pub const fn from_static(s: &'static str) -> Self {
        StrRef { ptr: s.as_ptr(), len: s.len() }
    }

    /// A reference to `s`, valid while `s` is.
    pub fn new(s: &str) -> Self {
        StrRef { ptr: s.as_ptr(), len: s.len() }
    }

    /// The string, lossily decoded: a plugin that sends invalid UTF-8 gets replacement characters
    /// in its messages rather than undefined behaviour.
    ///
    /// # Safety
    /// `ptr` must point at `len` readable bytes that stay valid for `'a`.
    pub unsafe fn to_string_lossy(&self) -> String {
        if self.ptr.is_null() {
            return String::new();
        }
        // SAFETY: the caller guarantees `ptr..ptr+len` is readable.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        String::from_utf8_lossy(bytes).into_owned()
    }
}

/// What a plugin's entry symbol returns. Lives in the plugin's static memory.
#[repr(C)]
#[derive(Debug)]
pub struct PluginHeader {
    /// Always [`MAGIC`].
    pub magic: [u8; 8],
    /// [`ABI_VERSION`] of the sdk the plugin was built with.
    pub abi_version: u32,
    /// `size_of::<PluginHeader>()` in the plugin.
    pub header_size: u32,
    /// [`SDK_VERSION`] of the plugin's build.
    pub sdk_version: StrRef,
    /// [`TCH_VERSION`] of the plugin's build.
    pub tch_version: StrRef,
    /// [`LIBTORCH_VERSION`] of the plugin's build.
    pub libtorch_version: StrRef,
    /// [`TARGET`] of the plugin's build.
    pub target: StrRef,
    /// `"unwind"` or `"abort"`: a plugin built with `panic = "abort"` cannot turn a panic into an
    /// error, so the daemon refuses it.
    pub panic_strategy: StrRef,
    /// The functions.
    pub vtable: *const PluginVTable,
}

// SAFETY: a header is immutable static data; its pointers point at other immutable statics.
unsafe impl Sync for PluginHeader {}
// SAFETY: as above.
unsafe impl Sync for StrRef {}

/// Null on success, else an error message (NUL-terminated, owned by the plugin; release it with
/// `free_string`).
pub type Status = *mut c_char;

/// A NUL-terminated string the plugin allocated and hands over (release it with `free_string`).
pub type OwnedString = *mut c_char;

/// An opaque object owned by the plugin (a model instance, a loaded dataset, an input pipeline).
pub type Handle = *mut c_void;

/// Device encoding across the boundary: `-1` is the CPU, `n >= 0` is CUDA device `n`.
pub type RawDevice = i32;

/// Which split of a dataset to load.
pub type RawSplit = u32;
/// [`RawSplit`] of the training split.
pub const SPLIT_TRAIN: RawSplit = 0;
/// [`RawSplit`] of the test split.
pub const SPLIT_TEST: RawSplit = 1;

/// A batch crossing the boundary: `len` names and as many tensor handles, borrowed by the receiver
/// (see the module's rules).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawBatch {
    /// Number of columns.
    pub len: usize,
    /// The columns' names.
    pub names: *const StrRef,
    /// The columns' tensors, in the same order.
    pub tensors: *const *mut C_tensor,
}

impl RawBatch {
    /// A batch of no columns.
    pub const EMPTY: RawBatch = RawBatch { len: 0, names: std::ptr::null(), tensors: std::ptr::null() };

    /// The batch, each tensor a new reference to the sender's (so the sender's handles stay its own).
    ///
    /// # Safety
    /// `names` and `tensors` must point at `len` valid entries each, live for the call.
    pub unsafe fn to_batch(&self) -> crate::Batch {
        if self.len == 0 {
            return crate::Batch::new();
        }
        // SAFETY: per the function contract.
        let (names, tensors) = unsafe {
            (std::slice::from_raw_parts(self.names, self.len), std::slice::from_raw_parts(self.tensors, self.len))
        };
        names
            .iter()
            .zip(tensors)
            // SAFETY: live handles and names, per the function contract; `clone_from_ptr` takes a
            // new reference and leaves the sender's.
            .map(|(n, &t)| unsafe { (n.to_string_lossy(), tch::Tensor::clone_from_ptr(t)) })
            .collect()
    }
}

/// The parts of a [`RawBatch`] over a [`crate::Batch`]: valid while both live.
#[derive(Debug, Default)]
pub struct RawParts {
    names: Vec<StrRef>,
    tensors: Vec<*mut C_tensor>,
}

impl RawParts {
    /// The handles of `batch`'s columns.
    pub fn of(batch: &crate::Batch) -> RawParts {
        let (names, tensors) = batch.iter().map(|(n, t)| (StrRef::new(n), t.as_ptr() as *mut C_tensor)).unzip();
        RawParts { names, tensors }
    }

    /// The batch as it crosses: valid while these parts and their batch live.
    pub fn raw(&self) -> RawBatch {
        RawBatch { len: self.names.len(), names: self.names.as_ptr(), tensors: self.tensors.as_ptr() }
    }
}

/// Where one input pipeline stands in the cluster, as TensorFlow's `tf.distribute.InputContext`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputContext {
    /// Number of input pipelines (one per worker).
    pub num_input_pipelines: u32,
    /// This pipeline's index, `0..num_input_pipelines`.
    pub input_pipeline_id: u32,
    /// Examples per batch on this replica; the global batch is this times `num_input_pipelines`.
    pub per_replica_batch_size: u32,
    /// True for training (shuffled per epoch, remainder dropped), false for evaluation (in order,
    /// every example once).
    pub training: bool,
    /// Epoch number, from 0: with `seed`, it fixes the data order.
    pub epoch: u64,
    /// Run seed.
    pub seed: u64,
    /// The step (from 0) of the pipeline's first batch: a resumed or recovered run opens the
    /// epoch there, without making the batches before it.
    pub first_step: u64,
}

impl InputContext {
    /// Examples per step over all pipelines.
    pub fn global_batch_size(&self) -> u64 {
        u64::from(self.per_replica_batch_size) * u64::from(self.num_input_pipelines)
    }
}

/// The plugin's functions. Every `Handle` argument is one the same plugin returned.
#[repr(C)]
pub struct PluginVTable {
    /// Writes the keys the plugin accepts, a JSON list of [`crate::ArgSpec`].
    pub arguments: unsafe extern "C" fn(out_json: *mut OwnedString) -> Status,
    /// Writes the plugin's [`crate::PluginInfo`] as JSON for the arguments `args_json` (a JSON
    /// object of strings, [`crate::PluginArgs`]).
    pub info: unsafe extern "C" fn(args_json: StrRef, out_json: *mut OwnedString) -> Status,
    /// Releases a string returned by any function: an error message or an [`OwnedString`].
    pub free_string: unsafe extern "C" fn(*mut c_char),
    /// Builds a model for the arguments `args_json`, its parameters under VarStore path `prefix`
    /// on `device`.
    pub create: unsafe extern "C" fn(args_json: StrRef, prefix: StrRef, device: RawDevice, out: *mut Handle) -> Status,
    /// Drops a model.
    pub destroy: unsafe extern "C" fn(model: Handle),
    /// Number of parameters.
    pub parameter_count: unsafe extern "C" fn(model: Handle) -> usize,
    /// Parameter `index` (in name order): its full name and a borrowed handle, valid until
    /// `destroy`.
    pub parameter: unsafe extern "C" fn(
        model: Handle,
        index: usize,
        out_name: *mut StrRef,
        out_tensor: *mut *mut C_tensor,
    ) -> Status,
    /// One batch's mean loss (a scalar that backward runs from, with the autograd graph to the
    /// parameters when `train`) and per-batch *sums* of each metric named in the plugin info (a
    /// 1-D float64 tensor), in one call: the forward pass, the loss and the metrics.
    pub step: unsafe extern "C" fn(
        model: Handle,
        batch: *const RawBatch,
        train: bool,
        out_loss: *mut *mut C_tensor,
        out_metrics: *mut *mut C_tensor,
    ) -> Status,
    /// What `trainerd predict` writes for each example of a batch (first dimension: examples),
    /// in evaluation mode and without gradients.
    pub predict: unsafe extern "C" fn(model: Handle, batch: *const RawBatch, out: *mut *mut C_tensor) -> Status,
    /// Loads a split of the dataset in directory `dir`.
    pub data_load: unsafe extern "C" fn(model: Handle, dir: StrRef, split: RawSplit, out: *mut Handle) -> Status,
    /// Drops a loaded dataset (after every pipeline over it is freed).
    pub data_free: unsafe extern "C" fn(data: Handle),
    /// Opens an input pipeline over a loaded dataset at `ctx.first_step`; writes how many batches
    /// the whole epoch has (it yields those from `first_step` on).
    pub pipeline_open: unsafe extern "C" fn(
        model: Handle,
        data: Handle,
        ctx: *const InputContext,
        out: *mut Handle,
        out_steps: *mut u64,
    ) -> Status,
    /// Next batch, its names and tensors borrowed until the next call on this pipeline;
    /// `out_done` is set when the pipeline is exhausted.
    pub pipeline_next: unsafe extern "C" fn(pipeline: Handle, out: *mut RawBatch, out_done: *mut bool) -> Status,
    /// Drops a pipeline.
    pub pipeline_free: unsafe extern "C" fn(pipeline: Handle),
}

/// Type of the entry symbol.
pub type EntryFn = unsafe extern "C" fn() -> *const PluginHeader;

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's stable prefix is what an old or new daemon reads first; its offsets must not
    /// move.
    #[test]
    fn header_prefix_layout_is_fixed() {
        assert_eq!(std::mem::offset_of!(PluginHeader, magic), 0);
        assert_eq!(std::mem::offset_of!(PluginHeader, abi_version), 8);
        assert_eq!(std::mem::offset_of!(PluginHeader, header_size), 12);
    }

    /// TCH_VERSION must be the tch that Cargo.lock resolved, or every plugin check lies.
    #[test]
    fn tch_version_matches_lockfile() {
        let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"))
            .expect("workspace Cargo.lock");
        let needle = "name = \"tch\"\nversion = \"";
        let at = lock.find(needle).expect("tch in Cargo.lock") + needle.len();
        let version = &lock[at..at + lock[at..].find('"').unwrap()];
        assert_eq!(version, TCH_VERSION);
    }

    #[test]
    fn libtorch_version_was_found_at_build_time() {
        assert!(LIBTORCH_VERSION.starts_with("2.13.0"), "{LIBTORCH_VERSION}");
    }
}
