//! The daemon's side of the plugin boundary: a checked [`Plugin`], and safe wrappers for the
//! objects it creates (a model, a loaded dataset, an input pipeline).
//!
//! Each wrapper owns one plugin handle and releases it on drop. Tensors that come back are
//! shallow clones of handles the plugin keeps (new references to the same storage): parameters
//! therefore *are* the plugin's parameters, and the daemon's in-place optimizer updates reach
//! the model.

pub(crate) mod describe;
mod load;

use std::ffi::CStr;
use std::path::{Path, PathBuf};

use tch::{Device, Tensor};
use trainerd_sdk::abi::{
    Handle, InputContext, PluginVTable, RawBatch, RawDevice, RawParts, Status, StrRef, SPLIT_TEST, SPLIT_TRAIN,
};
use trainerd_sdk::{ArgSpec, Batch, PluginArgs, PluginInfo, Split};

pub(crate) use load::{BuildFacts, LoadError};

/// The key, in a run configuration's `plugin` object, of the model's identity values
/// ([`PluginInfo::identity`]): a checkpoint is evaluated only by a model with the same.
pub(crate) const PLUGIN_IDENTITY_KEY: &str = "identity";

/// The VarStore path under which the daemon builds every model: its variables are named
/// `model.NAME`.
pub(crate) const MODEL_PATH: &str = "model";

/// The model's variables in the order the model registers them, where the plugin gives it (a
/// Python module's `state_dict()` keys, [`PluginInfo::export_names`]: a tied weight under each of
/// its keys), each as the daemon names it (`model.NAME`); empty where it gives none.
pub(crate) fn registered_names(info: &PluginInfo) -> Vec<String> {
    info.export_names.iter().map(|(_, variable)| format!("{MODEL_PATH}.{variable}")).collect()
}

/// An error returned (or a panic caught) inside a plugin call.
#[derive(Debug, thiserror::Error)]
#[error("plugin {plugin}: {call} failed: {message}")]
pub(crate) struct CallError {
    /// The plugin's name.
    pub(crate) plugin: String,
    /// Which call.
    pub(crate) call: &'static str,
    /// The plugin's message.
    pub(crate) message: String,
}

/// A loaded, checked plugin, configured by its arguments.
pub(crate) struct Plugin {
    path: PathBuf,
    vtable: &'static PluginVTable,
    facts: BuildFacts,
    arguments: Vec<ArgSpec>,
    args: PluginArgs,
    args_json: String,
    info: PluginInfo,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin").field("path", &self.path).field("args", &self.args).field("info", &self.info).finish()
    }
}

impl Plugin {
    /// Loads and checks the plugin at `path`, and has it take `args` (`--plugin-arg`).
    pub(crate) fn load(path: &Path, args: &PluginArgs) -> Result<Plugin, LoadError> {
        let (vtable, facts) = load::open(path)?;
        let refused = |message: String| LoadError::Refused { path: path.to_path_buf(), message };
        let arguments = arguments_of(vtable, path)?;
        args.check(&arguments).map_err(|source| LoadError::Arguments { path: path.to_path_buf(), source })?;
        let args_json = serde_json::to_string(args).expect("strings");
        let mut out = std::ptr::null_mut();
        // SAFETY: vtable checked by `open`; valid string and out pointer.
        let status = unsafe { (vtable.info)(StrRef::new(&args_json), &mut out) };
        // SAFETY: a status from this vtable.
        if let Some(message) = unsafe { take_string(vtable, status) } {
            return Err(refused(message));
        }
        // SAFETY: an owned string from this vtable's `info`.
        let json = unsafe { take_string(vtable, out) }.unwrap_or_default();
        let info: PluginInfo = serde_json::from_str(&json).map_err(|source| LoadError::BadJson {
            path: path.to_path_buf(),
            what: "info is",
            source,
            json: json.clone(),
        })?;
        if let Some(columns) = &info.columns {
            columns.validate().map_err(|(column, source)| LoadError::BadColumn {
                path: path.to_path_buf(),
                column,
                source,
            })?;
        }
        Ok(Plugin { path: path.to_path_buf(), vtable, facts, arguments, args: args.clone(), args_json, info })
    }

    /// The keys the plugin at `path` accepts, read without configuring it (for telling an
    /// operator whose arguments it refused what it takes).
    pub(crate) fn accepted(path: &Path) -> Result<Vec<ArgSpec>, LoadError> {
        arguments_of(load::open(path)?.0, path)
    }

    /// The keys it accepts.
    pub(crate) fn arguments(&self) -> &[ArgSpec] {
        &self.arguments
    }

    /// The arguments it was given.
    pub(crate) fn args(&self) -> &PluginArgs {
        &self.args
    }

    /// What every worker must have alike about this plugin's configuration, beyond its identity
    /// string: the model's identity values and the arguments marked agreed. `None` when there is
    /// neither, so that a run configuration stays what it was before plugins took arguments.
    pub(crate) fn agreement(&self) -> Option<serde_json::Value> {
        let args = self.args.agreed(&self.arguments);
        if self.info.identity.is_empty() && args.is_empty() {
            return None;
        }
        let mut agreement = serde_json::json!({});
        if !self.info.identity.is_empty() {
            agreement[PLUGIN_IDENTITY_KEY] = serde_json::to_value(&self.info.identity).expect("strings");
        }
        if !args.is_empty() {
            agreement["args"] = serde_json::to_value(&args).expect("strings");
        }
        Some(agreement)
    }

    /// Where it was loaded from.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Its identity and defaults.
    pub(crate) fn info(&self) -> &PluginInfo {
        &self.info
    }

    /// The build facts its header declared.
    pub(crate) fn facts(&self) -> &BuildFacts {
        &self.facts
    }

    fn check(&self, call: &'static str, status: Status) -> Result<(), CallError> {
        // SAFETY: `status` was just returned by this plugin's vtable.
        match unsafe { take_string(self.vtable, status) } {
            None => Ok(()),
            Some(message) => Err(CallError { plugin: self.info.name.clone(), call, message: with_hint(message) }),
        }
    }

    /// What must match on every worker about the plugin: its name, version and build facts.
    pub(crate) fn identity(&self) -> String {
        let (i, f) = (&self.info, &self.facts);
        format!(
            "{} {} (trainerd-sdk {}, tch {}, libtorch {}, {})",
            i.name, i.version, f.sdk_version, f.tch_version, f.libtorch_version, f.target
        )
    }

    /// Builds a model whose parameters live under VarStore path `prefix` on `device`.
    pub(crate) fn create_model(&self, prefix: &str, device: Device) -> Result<ModelInstance<'_>, CallError> {
        let raw_device: RawDevice = match device {
            Device::Cuda(n) => n as RawDevice,
            _ => -1,
        };
        let mut handle: Handle = std::ptr::null_mut();
        let args = StrRef::new(&self.args_json);
        // SAFETY: valid arguments and out pointer.
        self.check("create", unsafe { (self.vtable.create)(args, StrRef::new(prefix), raw_device, &mut handle) })?;
        let mut model = ModelInstance { plugin: self, handle, parameters: Vec::new() };
        // SAFETY: live model handle.
        let count = unsafe { (self.vtable.parameter_count)(handle) };
        for index in 0..count {
            let mut name = StrRef::new("");
            let mut tensor = std::ptr::null_mut();
            // SAFETY: live handle, index in range, valid out pointers.
            self.check("parameter", unsafe { (self.vtable.parameter)(handle, index, &mut name, &mut tensor) })?;
            // SAFETY: the name and tensor are owned by the model and valid until `destroy`; we
            // copy the name and take our own reference to the tensor.
            let param = unsafe { (name.to_string_lossy(), Tensor::clone_from_ptr(tensor)) };
            model.parameters.push(param);
        }
        Ok(model)
    }
}

/// The keys a plugin's `arguments` declares.
fn arguments_of(vtable: &'static PluginVTable, path: &Path) -> Result<Vec<ArgSpec>, LoadError> {
    let mut out = std::ptr::null_mut();
    // SAFETY: vtable checked by `load::open`; `out` is a valid out pointer.
    let status = unsafe { (vtable.arguments)(&mut out) };
    // SAFETY: a status from this vtable.
    if let Some(message) = unsafe { take_string(vtable, status) } {
        return Err(LoadError::NoArguments { path: path.to_path_buf(), message });
    }
    // SAFETY: an owned string from this vtable's `arguments`.
    let json = unsafe { take_string(vtable, out) }.unwrap_or_default();
    serde_json::from_str(&json).map_err(|source| LoadError::BadJson {
        path: path.to_path_buf(),
        what: "its arguments are",
        source,
        json,
    })
}

/// Copies and releases a string the plugin handed over (a status's message, an owned string).
///
/// # Safety
/// `string` must have been returned by `vtable` and not yet released.
unsafe fn take_string(vtable: &PluginVTable, string: *mut std::ffi::c_char) -> Option<String> {
    if string.is_null() {
        return None;
    }
    // SAFETY: a non-null string is NUL-terminated and owned by the plugin.
    let text = unsafe { CStr::from_ptr(string) }.to_string_lossy().into_owned();
    // SAFETY: released once, by the plugin that allocated it.
    unsafe { (vtable.free_string)(string) };
    Some(text)
}

/// Named tensors, in name order.
pub(crate) type Named = Vec<(String, Tensor)>;

/// A model instance inside a plugin.
pub(crate) struct ModelInstance<'p> {
    plugin: &'p Plugin,
    handle: Handle,
    parameters: Vec<(String, Tensor)>,
}

impl ModelInstance<'_> {
    /// The model's variables as (trainable parameters, buffers), each in name order, sharing the
    /// model's tensors: a variable that requires no gradient (BatchNorm's running statistics, a
    /// frozen layer) is state that the optimizer never touches.
    pub(crate) fn split_variables(&self) -> (Named, Named) {
        self.parameters.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).partition(|(_, t)| t.requires_grad())
    }

    /// One batch's mean loss and per-batch sums of each metric (one call: the forward pass, the
    /// loss and the metrics), in training mode when `train`.
    pub(crate) fn step(&self, batch: &Batch, train: bool) -> Result<(Tensor, Tensor), CallError> {
        let vt = self.plugin.vtable;
        let parts = RawParts::of(batch);
        let (mut loss, mut metrics) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: live handles; the batch stays ours (borrowed for the call); valid out pointers.
        let status = unsafe { (vt.step)(self.handle, &parts.raw(), train, &mut loss, &mut metrics) };
        self.plugin.check("step", status)?;
        // SAFETY: the plugin keeps both outputs until its next call; we take our own references now.
        Ok(unsafe { (Tensor::clone_from_ptr(loss), Tensor::clone_from_ptr(metrics)) })
    }

    /// What `trainerd predict` writes for each example of `batch` (a new reference to the tensor
    /// the plugin keeps until its next call).
    pub(crate) fn predict(&self, batch: &Batch) -> Result<Tensor, CallError> {
        let parts = RawParts::of(batch);
        let mut out = std::ptr::null_mut();
        // SAFETY: live handles; the batch stays ours (borrowed for the call); a valid out pointer.
        let status = unsafe { (self.plugin.vtable.predict)(self.handle, &parts.raw(), &mut out) };
        self.plugin.check("predict", status)?;
        // SAFETY: the plugin keeps the output until its next call; we take our own reference now.
        Ok(unsafe { Tensor::clone_from_ptr(out) })
    }

    /// Loads a split of the dataset in `dir`.
    pub(crate) fn load_data(&self, dir: &Path, split: Split) -> Result<Dataset<'_>, CallError> {
        let raw_split = match split {
            Split::Train => SPLIT_TRAIN,
            Split::Test => SPLIT_TEST,
        };
        let dir = dir.to_string_lossy();
        let mut handle = std::ptr::null_mut();
        // SAFETY: live model handle, valid string and out pointer.
        let status = unsafe { (self.plugin.vtable.data_load)(self.handle, StrRef::new(&dir), raw_split, &mut handle) };
        self.plugin.check("load_data", status)?;
        Ok(Dataset { model: self, handle })
    }
}

impl Drop for ModelInstance<'_> {
    fn drop(&mut self) {
        self.parameters.clear();
        // SAFETY: our handle, released once.
        unsafe { (self.plugin.vtable.destroy)(self.handle) };
    }
}

/// A loaded dataset split inside a plugin.
pub(crate) struct Dataset<'m> {
    model: &'m ModelInstance<'m>,
    handle: Handle,
}

impl Dataset<'_> {
    /// Opens an input pipeline over this split.
    pub(crate) fn pipeline(&self, ctx: &InputContext) -> Result<InputPipeline<'_>, CallError> {
        let plugin = self.model.plugin;
        let (mut handle, mut steps) = (std::ptr::null_mut(), 0u64);
        // SAFETY: live handles; valid pointers.
        let status =
            unsafe { (plugin.vtable.pipeline_open)(self.model.handle, self.handle, ctx, &mut handle, &mut steps) };
        plugin.check("input_pipeline", status)?;
        Ok(InputPipeline { plugin, handle, steps, _data: self })
    }
}

impl Drop for Dataset<'_> {
    fn drop(&mut self) {
        // SAFETY: our handle, released once, after every pipeline (they borrow us).
        unsafe { (self.model.plugin.vtable.data_free)(self.handle) };
    }
}

/// One epoch of batches from a plugin's input pipeline.
pub(crate) struct InputPipeline<'d> {
    plugin: &'d Plugin,
    handle: Handle,
    steps: u64,
    _data: &'d Dataset<'d>,
}

impl InputPipeline<'_> {
    /// How many batches it yields.
    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// The next batch, or `None` at the end.
    pub(crate) fn next_batch(&mut self) -> Result<Option<Batch>, CallError> {
        let (mut raw, mut done) = (RawBatch::EMPTY, false);
        // SAFETY: live handle; valid out pointers.
        let status = unsafe { (self.plugin.vtable.pipeline_next)(self.handle, &mut raw, &mut done) };
        self.plugin.check("input_pipeline", status)?;
        if done {
            return Ok(None);
        }
        // SAFETY: names and handles kept by the pipeline until its next call; we take our own
        // references.
        Ok(Some(unsafe { raw.to_batch() }))
    }
}

impl Drop for InputPipeline<'_> {
    fn drop(&mut self) {
        // SAFETY: our handle, released once.
        unsafe { (self.plugin.vtable.pipeline_free)(self.handle) };
    }
}

/// libtorch's refusal of an operation that has no deterministic algorithm (what trainerd asks for
/// on CUDA), with what trainerd offers instead of libtorch's own advice (`warn_only=True`).
fn with_hint(message: String) -> String {
    if !message.contains(" does not have a deterministic implementation, but you set ") {
        return message;
    }
    format!(
        "{message} (trainerd runs every operation's deterministic algorithm, for bit-for-bit results and exact \
         resumes: --allow-nondeterministic-ops lets such an operation run, without them)"
    )
}

#[cfg(test)]
mod tests {
    use super::with_hint;

    #[test]
    fn an_operation_without_a_deterministic_algorithm_is_told_with_the_flag_that_lets_it_run() {
        // libtorch 2.13's text (put_ on the CPU, or an adaptive pooling's backward pass on CUDA).
        let refused = "put_ does not have a deterministic implementation, but you set \
                       'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, \
                       or you can use the 'warn_only=True' option, if that's acceptable for your application.";
        let told = with_hint(refused.to_string());
        assert!(told.starts_with(refused), "{told}");
        assert!(told.ends_with("--allow-nondeterministic-ops lets such an operation run, without them)"), "{told}");
        assert_eq!(with_hint("loss raised ValueError".to_string()), "loss raised ValueError");
    }
}
