//! Plugin-side glue: the `extern "C"` functions behind the vtable, generic over a [`Model`], and
//! the [`export_plugin!`](crate::export_plugin) macro that exports them.
//!
//! Every function catches panics and turns them into an error [`Status`]; every output tensor is
//! kept in a slot owned by the plugin object, so the daemon only ever borrows it.

use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use tch::{nn, Device, Tensor};

use crate::abi::{
    C_tensor, Handle, InputContext, OwnedString, PluginHeader, PluginVTable, RawBatch, RawDevice, RawParts, RawSplit,
    Status, StrRef, ABI_VERSION, LIBTORCH_VERSION, MAGIC, SDK_VERSION, SPLIT_TEST, SPLIT_TRAIN, TARGET, TCH_VERSION,
};
use crate::args::PluginArgs;
use crate::batch::Batch;
use crate::model::{Model, Pipeline, PluginError, Split};

/// Exports `$model` (a type implementing [`Model`]) as this library's plugin. Call once, in a
/// crate built as a `cdylib`.
#[macro_export]
macro_rules! export_plugin {
    ($model:ty) => {
        /// The plugin's entry point, read by trainerd before it calls anything else.
        #[unsafe(no_mangle)]
        pub extern "C" fn trainerd_plugin_entry() -> *const $crate::abi::PluginHeader {
            static VTABLE: $crate::abi::PluginVTable = $crate::export::vtable::<$model>();
            static HEADER: $crate::abi::PluginHeader =
                $crate::export::header(&VTABLE, if cfg!(panic = "unwind") { "unwind" } else { "abort" });
            &HEADER
        }
    };
}

/// The header for `vtable`, stamped with this build's facts.
pub const fn header(vtable: &'static PluginVTable, panic_strategy: &'static str) -> PluginHeader {
    PluginHeader {
        magic: MAGIC,
        abi_version: ABI_VERSION,
        header_size: std::mem::size_of::<PluginHeader>() as u32,
        sdk_version: StrRef::from_static(SDK_VERSION),
        tch_version: StrRef::from_static(TCH_VERSION),
        libtorch_version: StrRef::from_static(LIBTORCH_VERSION),
        target: StrRef::from_static(TARGET),
        panic_strategy: StrRef::from_static(panic_strategy),
        vtable,
    }
}

/// The vtable of `M`.
pub const fn vtable<M: Model>() -> PluginVTable {
    PluginVTable {
        arguments: arguments::<M>,
        info: info::<M>,
        free_string,
        create: create::<M>,
        destroy: destroy::<M>,
        parameter_count: parameter_count::<M>,
        parameter: parameter::<M>,
        step: step::<M>,
        predict: predict::<M>,
        data_load: data_load::<M>,
        data_free: data_free::<M>,
        pipeline_open: pipeline_open::<M>,
        pipeline_next,
        pipeline_free,
    }
}

struct ModelBox<M> {
    model: M,
    params: Vec<(String, Tensor)>,
    /// The last outputs handed out (a loss, or predictions, and metrics); valid until the next
    /// call.
    out: (Tensor, Tensor),
    _vs: nn::VarStore,
}

struct PipelineBox {
    pipeline: Pipeline,
    /// The last batch handed out and its handles; valid until the next call.
    batch: (Batch, RawParts),
}

/// Runs `f`, turning an error or a panic into a [`Status`].
fn guard(f: impl FnOnce() -> Result<(), PluginError>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => owned(e.to_string()),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            owned(format!("panicked: {msg}"))
        }
    }
}

/// `text` as a NUL-terminated string handed over to the daemon (a NUL inside is written `\0`).
fn owned(text: String) -> OwnedString {
    CString::new(text.replace('\0', "\\0")).expect("no NUL left").into_raw()
}

/// Runs a function that cannot report an error; a panic is printed, never unwound.
fn guard_quiet(what: &str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        eprintln!("trainerd plugin: panic in {what} (ignored)");
    }
}

fn device(raw: RawDevice) -> Device {
    if raw < 0 {
        Device::Cpu
    } else {
        Device::Cuda(raw as usize)
    }
}

unsafe extern "C" fn arguments<M: Model>(out_json: *mut OwnedString) -> Status {
    guard(|| {
        let json = serde_json::to_string(&M::arguments()).expect("arguments serialize");
        // SAFETY: the daemon passes a valid out pointer and releases the string with free_string.
        unsafe { *out_json = owned(json) };
        Ok(())
    })
}

/// The arguments in `json`, checked against the keys `M` accepts.
///
/// # Safety
/// `json` must be a valid string reference.
unsafe fn plugin_args<M: Model>(json: StrRef) -> Result<PluginArgs, PluginError> {
    // SAFETY: per the function contract.
    let json = unsafe { json.to_string_lossy() };
    let args: PluginArgs = serde_json::from_str(&json)
        .map_err(|e| PluginError::Other(format!("the arguments are not a JSON object of strings: {e}: {json}")))?;
    args.check(&M::arguments()).map_err(|e| PluginError::Other(e.to_string()))?;
    Ok(args)
}

unsafe extern "C" fn info<M: Model>(args_json: StrRef, out_json: *mut OwnedString) -> Status {
    guard(|| {
        // SAFETY: a valid string from the daemon.
        let args = unsafe { plugin_args::<M>(args_json) }?;
        let json = serde_json::to_string(&M::info(&args)?).expect("info serializes");
        // SAFETY: the daemon passes a valid out pointer and releases the string with free_string.
        unsafe { *out_json = owned(json) };
        Ok(())
    })
}

unsafe extern "C" fn free_string(string: *mut c_char) {
    if !string.is_null() {
        // SAFETY: every string handed out comes from CString::into_raw in `owned`.
        drop(unsafe { CString::from_raw(string) });
    }
}

unsafe extern "C" fn create<M: Model>(
    args_json: StrRef,
    prefix: StrRef,
    raw_device: RawDevice,
    out: *mut Handle,
) -> Status {
    guard(|| {
        // SAFETY: the daemon passes valid strings.
        let (args, prefix) = unsafe { (plugin_args::<M>(args_json)?, prefix.to_string_lossy()) };
        let vs = nn::VarStore::new(device(raw_device));
        let root = prefix.split('.').filter(|s| !s.is_empty()).fold(vs.root(), |p, s| p.sub(s));
        let model = M::new(&root, &args)?;
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let boxed = Box::new(ModelBox { model, params, out: (Tensor::new(), Tensor::new()), _vs: vs });
        // SAFETY: valid out pointer from the daemon.
        unsafe { *out = Box::into_raw(boxed) as Handle };
        Ok(())
    })
}

/// # Safety
/// `model` must come from `create::<M>` and not be destroyed.
unsafe fn model_mut<'a, M>(model: Handle) -> &'a mut ModelBox<M> {
    // SAFETY: per the function contract.
    unsafe { &mut *(model as *mut ModelBox<M>) }
}

unsafe extern "C" fn destroy<M: Model>(model: Handle) {
    // SAFETY: `model` came from Box::into_raw in `create`.
    guard_quiet("destroy", || drop(unsafe { Box::from_raw(model as *mut ModelBox<M>) }));
}

unsafe extern "C" fn parameter_count<M: Model>(model: Handle) -> usize {
    // SAFETY: live model handle from the daemon.
    unsafe { model_mut::<M>(model) }.params.len()
}

unsafe extern "C" fn parameter<M: Model>(
    model: Handle,
    index: usize,
    out_name: *mut StrRef,
    out_tensor: *mut *mut C_tensor,
) -> Status {
    guard(|| {
        // SAFETY: live model handle from the daemon.
        let m = unsafe { model_mut::<M>(model) };
        let (name, tensor) =
            m.params.get_mut(index).ok_or_else(|| PluginError::Other(format!("no parameter {index}")))?;
        // SAFETY: valid out pointers; name and tensor live until `destroy`.
        unsafe {
            *out_name = StrRef::new(name);
            *out_tensor = tensor.as_mut_ptr();
        }
        Ok(())
    })
}

unsafe extern "C" fn step<M: Model>(
    model: Handle,
    batch: *const RawBatch,
    train: bool,
    out_loss: *mut *mut C_tensor,
    out_metrics: *mut *mut C_tensor,
) -> Status {
    guard(|| {
        // SAFETY: a live model handle and a valid batch from the daemon.
        let (m, batch) = unsafe { (model_mut::<M>(model), (*batch).to_batch()) };
        m.out = m.model.step(&batch, train)?;
        // SAFETY: valid out pointers; the tensors live in the model's slots until the next call.
        unsafe {
            *out_loss = m.out.0.as_mut_ptr();
            *out_metrics = m.out.1.as_mut_ptr();
        }
        Ok(())
    })
}

unsafe extern "C" fn predict<M: Model>(model: Handle, batch: *const RawBatch, out: *mut *mut C_tensor) -> Status {
    guard(|| {
        // SAFETY: a live model handle and a valid batch from the daemon.
        let (m, batch) = unsafe { (model_mut::<M>(model), (*batch).to_batch()) };
        let _no_grad = tch::no_grad_guard();
        m.out.0 = m.model.predict(&batch)?;
        // SAFETY: a valid out pointer; the tensor lives in the model's slot until the next call.
        unsafe { *out = m.out.0.as_mut_ptr() };
        Ok(())
    })
}

unsafe extern "C" fn data_load<M: Model>(model: Handle, dir: StrRef, split: RawSplit, out: *mut Handle) -> Status {
    guard(|| {
        // SAFETY: live handle and string from the daemon.
        let (m, dir) = unsafe { (model_mut::<M>(model), dir.to_string_lossy()) };
        let split = match split {
            SPLIT_TRAIN => Split::Train,
            SPLIT_TEST => Split::Test,
            other => return Err(PluginError::Other(format!("unknown split {other}"))),
        };
        let data: Arc<M::Data> = Arc::new(m.model.load_data(Path::new(&dir), split)?);
        // SAFETY: valid out pointer.
        unsafe { *out = Box::into_raw(Box::new(data)) as Handle };
        Ok(())
    })
}

unsafe extern "C" fn data_free<M: Model>(data: Handle) {
    // SAFETY: `data` came from Box::into_raw in `data_load`.
    guard_quiet("data_free", || drop(unsafe { Box::from_raw(data as *mut Arc<M::Data>) }));
}

unsafe extern "C" fn pipeline_open<M: Model>(
    model: Handle,
    data: Handle,
    ctx: *const InputContext,
    out: *mut Handle,
    out_steps: *mut u64,
) -> Status {
    guard(|| {
        // SAFETY: live handles and pointers from the daemon.
        let (m, data, ctx) = unsafe { (model_mut::<M>(model), &*(data as *const Arc<M::Data>), &*ctx) };
        let mut pipeline = m.model.input_pipeline(data, ctx)?;
        // A pipeline that always starts at the epoch's beginning is brought to the first step
        // here, by drawing the batches before it.
        while pipeline.first_step < ctx.first_step {
            match pipeline.batches.next() {
                Some(batch) => drop(batch?),
                None => break,
            }
            pipeline.first_step += 1;
        }
        let steps = pipeline.steps;
        let boxed = Box::new(PipelineBox { pipeline, batch: Default::default() });
        // SAFETY: valid out pointers.
        unsafe {
            *out = Box::into_raw(boxed) as Handle;
            *out_steps = steps;
        }
        Ok(())
    })
}

unsafe extern "C" fn pipeline_next(pipeline: Handle, out: *mut RawBatch, out_done: *mut bool) -> Status {
    guard(|| {
        // SAFETY: live pipeline handle from the daemon.
        let p = unsafe { &mut *(pipeline as *mut PipelineBox) };
        let done = match p.pipeline.batches.next() {
            None => true,
            Some(batch) => {
                let batch = batch?;
                let parts = RawParts::of(&batch);
                p.batch = (batch, parts);
                // SAFETY: a valid out pointer; the batch and its handles live in the pipeline's
                // slot until the next call.
                unsafe { *out = p.batch.1.raw() };
                false
            }
        };
        // SAFETY: valid out pointer.
        unsafe { *out_done = done };
        Ok(())
    })
}

unsafe extern "C" fn pipeline_free(pipeline: Handle) {
    // SAFETY: `pipeline` came from Box::into_raw in `pipeline_open`.
    guard_quiet("pipeline_free", || drop(unsafe { Box::from_raw(pipeline as *mut PipelineBox) }));
}
