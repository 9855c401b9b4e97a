//! A plugin that misbehaves on request, so the daemon's tests can check each failure it must
//! survive and name. `TRAINERD_FIXTURE_FAULT` picks the fault:
//!
//! - `abi-version`, `magic`, `tch-version`, `libtorch-version`, `panic-abort`: a header with
//!   that field wrong (as a plugin built against other versions would have);
//! - `segfault-on-load`: the entry symbol crashes;
//! - `panic-forward`, `panic-pipeline` (at step 2 of an epoch), `panic-load`: plugin code panics in
//!   that call;
//! - `uneven-shards`: input pipeline `i` yields `i` fewer training batches (shards that differ);
//! - `unused-param`: the model has a parameter (`model.unused`, ones) its forward never uses;
//! - `typed-buffers`: the model has non-trainable variables of other dtypes that each training
//!   forward pass updates: `model.steps` (int64, from 2^40) counts passes, `model.mean` (float64)
//!   keeps a running mean of the input's mean.
//!
//! `TRAINERD_FIXTURE_VERSION` overrides the version it reports; `TRAINERD_FIXTURE_COLUMNS` (JSON)
//! the columns it declares for a columnar dataset (by default an image `[1, 28, 28]` and a label,
//! in Hugging Face's layout; `none` for none), so that a test can train on a dataset of its own
//! making: the input, whatever its shape, is flattened into the Dense layer's 784 inputs. Unset, it is a working softmax
//! regression like the `linear` plugin.

use std::path::Path;
use std::sync::Arc;

use trainerd_sdk::abi::{PluginHeader, PluginVTable, StrRef};
use trainerd_sdk::export::{header, vtable};
use trainerd_sdk::mnist::Mnist;
use trainerd_sdk::tch::{nn, Tensor};
use trainerd_sdk::{
    Batch, Columns, InputContext, LrSchedule, Model, OptimizerConfig, Pipeline, PluginArgs, PluginError, PluginInfo,
    Split, TrainDefaults,
};

fn fault() -> String {
    std::env::var("TRAINERD_FIXTURE_FAULT").unwrap_or_default()
}

/// The columns it declares: Hugging Face's image layout, the JSON in `TRAINERD_FIXTURE_COLUMNS`
/// (a test's own dataset), or none when that is `none` (a plugin that reads only its own format).
fn columns() -> Option<Columns> {
    match std::env::var("TRAINERD_FIXTURE_COLUMNS").as_deref() {
        Ok("none") => None,
        Ok(json) => Some(serde_json::from_str(json).expect("TRAINERD_FIXTURE_COLUMNS is a Columns JSON")),
        Err(_) => Some(Columns::image_classification(1, 28, 28)),
    }
}

/// The model.
pub struct Fixture {
    dense: nn::Linear,
    /// `typed-buffers`: (steps, mean).
    buffers: Option<(Tensor, Tensor)>,
}

impl Model for Fixture {
    type Data = Mnist;

    fn info(_: &PluginArgs) -> Result<PluginInfo, PluginError> {
        Ok(PluginInfo {
            name: "test-fixture".into(),
            // Overridable, so tests can start two workers whose plugin versions differ.
            version: std::env::var("TRAINERD_FIXTURE_VERSION").unwrap_or_else(|_| env!("CARGO_PKG_VERSION").into()),
            description: "softmax regression that fails on request".into(),
            metrics: vec!["accuracy".into()],
            defaults: TrainDefaults {
                epochs: 1,
                batch_size: 32,
                optimizer: OptimizerConfig::sgd(0.1),
                schedule: LrSchedule::Constant,
            },
            columns: columns(),
            identity: Default::default(),
            language_model: false,
            export_names: Vec::new(),
            no_decay: Vec::new(),
            vocab_size: None,
        })
    }

    fn new(root: &nn::Path, _: &PluginArgs) -> Result<Self, PluginError> {
        if fault() == "unused-param" {
            let _ = root.var("unused", &[4], nn::Init::Const(1.0));
        }
        let buffers = (fault() == "typed-buffers").then(|| {
            let steps = root.add("steps", Tensor::from_slice(&[1i64 << 40]), false);
            let mean = root.add("mean", Tensor::from_slice(&[0.0f64]), false);
            (steps, mean)
        });
        Ok(Fixture { dense: nn::linear(root / "dense", 28 * 28, 10, Default::default()), buffers })
    }

    fn forward(&self, batch: &Batch, train: bool) -> Result<Tensor, PluginError> {
        let xs = batch.input()?;
        if fault() == "panic-forward" {
            panic!("fixture: forward pass failed on purpose");
        }
        if let (Some((steps, mean)), true) = (&self.buffers, train) {
            let _no_grad = trainerd_sdk::tch::no_grad_guard();
            let _ = steps.shallow_clone().f_add_scalar_(1)?;
            let batch_mean = xs.f_mean(trainerd_sdk::tch::Kind::Double)?;
            let _ = mean.shallow_clone().f_mul_scalar_(0.9)?.f_add_(&(batch_mean * 0.1))?;
        }
        Ok(xs.f_flatten(1, -1)?.apply(&self.dense))
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        if fault() == "panic-load" {
            panic!("fixture: data loading failed on purpose");
        }
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        let mut pipeline = data.pipeline(ctx)?;
        if fault() == "uneven-shards" && ctx.training {
            pipeline.steps = pipeline.steps.saturating_sub(u64::from(ctx.input_pipeline_id));
            let batches = pipeline.batches;
            pipeline.batches = Box::new(batches.take(pipeline.steps as usize));
        }
        if fault() == "panic-pipeline" {
            let (batches, first) = (pipeline.batches, pipeline.first_step as usize);
            pipeline.batches = Box::new(batches.enumerate().map(move |(i, b)| {
                if first + i == 2 {
                    panic!("fixture: input pipeline failed on purpose at batch {}", first + i);
                }
                b
            }));
        }
        Ok(pipeline)
    }
}

static VTABLE: PluginVTable = vtable::<Fixture>();
static GOOD: PluginHeader = header(&VTABLE, "unwind");
static BAD_ABI: PluginHeader = PluginHeader { abi_version: 999, ..header(&VTABLE, "unwind") };
static BAD_MAGIC: PluginHeader = PluginHeader { magic: *b"NOTAPLUG", ..header(&VTABLE, "unwind") };
static BAD_TCH: PluginHeader = PluginHeader { tch_version: StrRef::from_static("0.25.0"), ..header(&VTABLE, "unwind") };
static BAD_LIBTORCH: PluginHeader =
    PluginHeader { libtorch_version: StrRef::from_static("2.12.0+cpu"), ..header(&VTABLE, "unwind") };
static PANIC_ABORT: PluginHeader = header(&VTABLE, "abort");

/// The entry point: the header the fault asks for.
#[unsafe(no_mangle)]
pub extern "C" fn trainerd_plugin_entry() -> *const PluginHeader {
    match fault().as_str() {
        "abi-version" => &BAD_ABI,
        "magic" => &BAD_MAGIC,
        "tch-version" => &BAD_TCH,
        "libtorch-version" => &BAD_LIBTORCH,
        "panic-abort" => &PANIC_ABORT,
        "segfault-on-load" => {
            // SAFETY: not safe at all, on purpose: the checker must survive a plugin that
            // crashes while loading.
            unsafe { std::ptr::null_mut::<u64>().write_volatile(1) };
            &GOOD
        }
        _ => &GOOD,
    }
}
