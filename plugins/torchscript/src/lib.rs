//! A trainerd plugin for any TorchScript module file: a model written in PyTorch, scripted with
//! `torch.jit.script(model).save(PATH)`, trained by trainerd without a line of Rust.
//!
//! `--plugin-arg module=PATH` names the file; further keys say what the model needs (the shape and
//! dtype of one example, the loss and the metrics). The module's parameters become the model's
//! trainable variables and its buffers (BatchNorm's running statistics) its state, both sharing the
//! module's storage, so that trainerd's optimizer, checkpoints, transfers and `params_sha256`
//! cover them as they cover a Rust plugin's. The file's sha256 is the model's identity: workers
//! with different files are refused, and so is a checkpoint of another file.
//!
//! The data are MNIST-format images (idx files, or a Parquet `image` column in Hugging Face's
//! layout) with integer labels, as float tensors in [0, 1] reshaped to the module's input.

mod module;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use module::ScriptModule;
use sha2::{Digest, Sha256};
use trainerd_sdk::mnist::Mnist;
use trainerd_sdk::tch::{nn, Device, Kind, Tensor};
use trainerd_sdk::{
    export_plugin, ArgSpec, Batch, Columns, InputContext, Model, Pipeline, PluginArgs, PluginError, PluginInfo, Split,
};

/// The loss a module trains with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loss {
    /// Softmax cross-entropy of class logits `[batch, classes]` against integer labels.
    CrossEntropy,
    /// Mean squared error of one output per example against the label as a number.
    Mse,
}

/// A metric it reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Metric {
    Accuracy,
    MeanAbsoluteError,
}

impl Metric {
    fn name(self) -> &'static str {
        match self {
            Metric::Accuracy => "accuracy",
            Metric::MeanAbsoluteError => "mean_absolute_error",
        }
    }
}

/// What the arguments say.
#[derive(Clone, Debug)]
struct Settings {
    module: PathBuf,
    image: [i64; 3],
    input: Vec<i64>,
    dtype: Kind,
    loss: Loss,
    metrics: Vec<Metric>,
}

/// `AxBxC` as dimensions, each at least 1.
fn shape(key: &str, text: &str) -> Result<Vec<i64>, PluginError> {
    let dims: Option<Vec<i64>> = text.split('x').map(|d| d.trim().parse::<i64>().ok().filter(|&d| d > 0)).collect();
    dims.filter(|d| !d.is_empty()).ok_or_else(|| {
        PluginError::Other(format!("--plugin-arg {key}={text}: expected dimensions joined by x, such as 1x28x28"))
    })
}

impl Settings {
    fn from_args(args: &PluginArgs) -> Result<Settings, PluginError> {
        let module = args.get("module").map(PathBuf::from).ok_or_else(|| {
            PluginError::Other(
                "--plugin-arg module=PATH is required: the TorchScript file to train, as \
                 torch.jit.script(model).save(PATH) writes it"
                    .into(),
            )
        })?;
        let image = shape("image_shape", args.get("image_shape").unwrap_or("1x28x28"))?;
        let [c, h, w] = image[..] else {
            return Err(PluginError::Other(format!(
                "--plugin-arg image_shape={}: expected channels x height x width, such as 1x28x28",
                args.get("image_shape").unwrap_or_default()
            )));
        };
        let input = match args.get("input_shape") {
            Some(text) => shape("input_shape", text)?,
            None => image.clone(),
        };
        let (values, image_values) = (input.iter().product::<i64>(), c * h * w);
        if values != image_values {
            return Err(PluginError::Other(format!(
                "--plugin-arg input_shape={}: {values} values per example, but an image of {c}x{h}x{w} has \
                 {image_values} (the input is the image reshaped)",
                join(&input)
            )));
        }
        let dtype = match args.get("input_dtype").unwrap_or("float32") {
            "float32" => Kind::Float,
            "float64" => Kind::Double,
            other => {
                return Err(PluginError::Other(format!(
                    "--plugin-arg input_dtype={other}: expected float32 or float64"
                )))
            }
        };
        let loss = match args.get("loss").unwrap_or("cross_entropy") {
            "cross_entropy" => Loss::CrossEntropy,
            "mse" => Loss::Mse,
            other => {
                return Err(PluginError::Other(format!("--plugin-arg loss={other}: expected cross_entropy or mse")))
            }
        };
        let metrics = match args.get("metrics") {
            None if loss == Loss::CrossEntropy => vec![Metric::Accuracy],
            None => vec![Metric::MeanAbsoluteError],
            Some("none") => Vec::new(),
            Some(list) => list
                .split(',')
                .map(|m| match m.trim() {
                    "accuracy" if loss == Loss::CrossEntropy => Ok(Metric::Accuracy),
                    "accuracy" => Err(PluginError::Other(
                        "--plugin-arg metrics=accuracy: accuracy needs loss=cross_entropy (class logits)".into(),
                    )),
                    "mean_absolute_error" => Ok(Metric::MeanAbsoluteError),
                    other => Err(PluginError::Other(format!(
                        "--plugin-arg metrics={list}: {other:?} is not a metric; expected a comma-separated list \
                         of accuracy and mean_absolute_error, or none"
                    ))),
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(Settings { module, image: [c, h, w], input, dtype, loss, metrics })
    }

    /// The module, loaded onto `device`; an error names the file and what is wrong with it.
    fn load(&self, device: Device) -> Result<ScriptModule, PluginError> {
        ScriptModule::load(&self.module, device).map_err(|why| {
            let first = essential(&why);
            if !self.module.exists() {
                PluginError::Other(format!("module {}: no such file", self.module.display()))
            } else {
                PluginError::Other(format!(
                    "module {} is not a TorchScript file that this libtorch can load (torch.jit.script(model)\
                     .save(PATH) writes one): {first}",
                    self.module.display()
                ))
            }
        })
    }

    /// A batch of inputs as the module takes them.
    fn input(&self, xs: &Tensor) -> Result<Tensor, PluginError> {
        let mut dims = vec![xs.size().first().copied().unwrap_or(0)];
        dims.extend(&self.input);
        Ok(xs.f_reshape(dims)?.f_to_kind(self.dtype)?)
    }

    /// "[batch, 1, 28, 28] float32".
    fn input_text(&self) -> String {
        let dtype = if self.dtype == Kind::Double { "float64" } else { "float32" };
        format!("[batch, {}] {dtype}", self.input.iter().map(i64::to_string).collect::<Vec<_>>().join(", "))
    }
}

/// The line of a libtorch message that says what went wrong: the last of an interpreter's
/// traceback (`RuntimeError: mat1 and mat2 shapes cannot be multiplied ...`), else the first.
fn essential(why: &str) -> &str {
    let mut lines = why.lines().map(str::trim).filter(|l| !l.is_empty());
    if why.contains("TorchScript interpreter") {
        lines.next_back().unwrap_or_default()
    } else {
        lines.next().unwrap_or_default()
    }
}

fn join(dims: &[i64]) -> String {
    dims.iter().map(i64::to_string).collect::<Vec<_>>().join("x")
}

fn sha256_of(path: &Path) -> Result<String, PluginError> {
    let mut file = std::fs::File::open(path)
        .map_err(|e| PluginError::Other(format!("module {}: cannot be read: {e}", path.display())))?;
    let (mut hasher, mut buf) = (Sha256::new(), vec![0u8; 1 << 20]);
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| PluginError::Other(format!("module {}: cannot be read: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Runs a sample batch of two zero examples through `module` (evaluation mode, no gradient), and
/// says what it returned; an error names the file and what the loss needs.
fn sample(settings: &Settings, module: &ScriptModule) -> Result<Vec<i64>, PluginError> {
    let file = settings.module.display();
    let _no_grad = trainerd_sdk::tch::no_grad_guard();
    module.train(false).map_err(PluginError::Other)?;
    let mut dims = vec![2];
    dims.extend(&settings.input);
    let xs = Tensor::f_zeros(&dims, (settings.dtype, Device::Cpu))?;
    let out = module.forward(&xs).map_err(|why| {
        let first = essential(&why);
        PluginError::Other(format!(
            "module {file} fails on a sample batch {}: {first} (give the input's shape and dtype with \
             --plugin-arg input_shape= and input_dtype=)",
            settings.input_text().replace("batch", "2")
        ))
    })?;
    let size = out.size();
    let fits = match settings.loss {
        Loss::CrossEntropy => size.len() == 2 && size[0] == 2 && size[1] >= 2,
        Loss::Mse => size.first() == Some(&2) && size.iter().skip(1).all(|&d| d == 1),
    };
    if !fits {
        let needs = match settings.loss {
            Loss::CrossEntropy => "loss=cross_entropy needs class logits [2, classes]",
            Loss::Mse => "loss=mse needs one output per example, [2] or [2, 1]",
        };
        return Err(PluginError::Other(format!(
            "module {file} returned {size:?} for a sample batch {}: {needs}",
            settings.input_text().replace("batch", "2")
        )));
    }
    Ok(size)
}

/// The model: a module and how to feed it.
pub struct TorchScript {
    settings: Settings,
    module: ScriptModule,
    /// The mode the module is in (`None` until the first forward pass sets it).
    training: Cell<Option<bool>>,
}

impl Model for TorchScript {
    type Data = Mnist;

    fn arguments() -> Vec<ArgSpec> {
        vec![
            ArgSpec::new(
                "module",
                "the TorchScript file to train, as torch.jit.script(model).save(PATH) writes it (required; its \
                 sha256 is the model's identity, so the path may differ between workers)",
                None,
            )
            .local(),
            ArgSpec::new(
                "image_shape",
                "CxHxW of the dataset's images (idx files, or a Parquet image column)",
                Some("1x28x28"),
            ),
            ArgSpec::new(
                "input_shape",
                "one example's shape as the module takes it, the image reshaped (28x28: 28 rows as a sequence; \
                 default: the image_shape)",
                None,
            ),
            ArgSpec::new("input_dtype", "float32 or float64", Some("float32")),
            ArgSpec::new(
                "loss",
                "cross_entropy (the module returns class logits) or mse (one output per example, the label as a \
                 number)",
                Some("cross_entropy"),
            ),
            ArgSpec::new(
                "metrics",
                "comma-separated: accuracy, mean_absolute_error; or none (default: accuracy with cross_entropy, \
                 mean_absolute_error with mse)",
                None,
            ),
        ]
    }

    fn info(args: &PluginArgs) -> Result<PluginInfo, PluginError> {
        let settings = Settings::from_args(args)?;
        let sha256 = sha256_of(&settings.module)?;
        let module = settings.load(Device::Cpu)?;
        let file = settings.module.display();
        let (params, buffers) =
            (module.parameters().map_err(PluginError::Other)?, module.buffers().map_err(PluginError::Other)?);
        if params.iter().all(|(_, t)| !t.requires_grad()) {
            return Err(PluginError::Other(format!("module {file} has no trainable parameters: nothing to train")));
        }
        let out = sample(&settings, &module)?;
        let [c, h, w] = settings.image;
        let mut info = PluginInfo::classifier(
            "torchscript",
            env!("CARGO_PKG_VERSION"),
            &format!(
                "TorchScript module {file}: input {} -> [batch, {}], loss {}; {} parameter(s), {} buffer(s)",
                settings.input_text(),
                out.iter().skip(1).map(i64::to_string).collect::<Vec<_>>().join(", "),
                match settings.loss {
                    Loss::CrossEntropy => "cross_entropy",
                    Loss::Mse => "mse",
                },
                params.len(),
                buffers.len(),
            ),
        )
        .with_columns(Columns::image_classification(c as u32, h as u32, w as u32));
        info.metrics = settings.metrics.iter().map(|m| m.name().to_string()).collect();
        info.identity = BTreeMap::from([("module_sha256".to_string(), sha256)]);
        Ok(info)
    }

    fn new(root: &nn::Path, args: &PluginArgs) -> Result<Self, PluginError> {
        let settings = Settings::from_args(args)?;
        let module = settings.load(root.device())?;
        let params = module.parameters().map_err(PluginError::Other)?;
        let buffers = module.buffers().map_err(PluginError::Other)?;
        // Each tensor under its dotted name, sharing the module's storage: a parameter that
        // requires a gradient is trainable, anything else (buffers, frozen parameters) is state.
        for (name, tensor) in params.into_iter().chain(buffers) {
            let mut parts: Vec<&str> = name.split('.').collect();
            let last = parts.pop().unwrap_or_default();
            let path = parts.iter().fold(root.clone(), |p, s| p.sub(*s));
            let trainable = tensor.requires_grad();
            let _ = path.add(last, tensor, trainable);
        }
        Ok(TorchScript { settings, module, training: Cell::new(None) })
    }

    fn forward(&self, batch: &Batch, train: bool) -> Result<Tensor, PluginError> {
        if self.training.get() != Some(train) {
            self.module.train(train).map_err(PluginError::Other)?;
            self.training.set(Some(train));
        }
        let xs = self.settings.input(batch.input()?)?;
        self.module.forward(&xs).map_err(|why| {
            PluginError::Other(format!("module {}: {}", self.settings.module.display(), essential(&why)))
        })
    }

    fn loss(&self, out: &Tensor, batch: &Batch) -> Result<Tensor, PluginError> {
        let labels = batch.label()?;
        match self.settings.loss {
            Loss::CrossEntropy => Ok(out.f_log_softmax(-1, Kind::Float)?.f_nll_loss::<Tensor>(
                labels,
                None,
                trainerd_sdk::tch::Reduction::Mean,
                -100,
            )?),
            Loss::Mse => {
                // In float32 at least, under autocast too.
                let kind = if matches!(out.kind(), Kind::Half | Kind::BFloat16) { Kind::Float } else { out.kind() };
                let out = out.f_reshape([-1])?.f_to_kind(kind)?;
                Ok(out.f_sub(&labels.f_to_kind(kind)?)?.f_square()?.f_mean(None)?)
            }
        }
    }

    fn metrics(&self, out: &Tensor, batch: &Batch) -> Result<Tensor, PluginError> {
        let labels = batch.label()?;
        let sums = self
            .settings
            .metrics
            .iter()
            .map(|m| match m {
                Metric::Accuracy => Ok(out.f_argmax(-1, false)?.f_eq_tensor(labels)?.f_sum(Kind::Double)?),
                Metric::MeanAbsoluteError => Ok(out
                    .f_reshape([-1])?
                    .f_to_kind(Kind::Double)?
                    .f_sub(&labels.f_to_kind(Kind::Double)?)?
                    .f_abs()?
                    .f_sum(Kind::Double)?),
            })
            .collect::<Result<Vec<Tensor>, PluginError>>()?;
        if sums.is_empty() {
            return Ok(Tensor::f_zeros([0], (Kind::Double, out.device()))?);
        }
        Ok(Tensor::f_stack(&sums, 0)?)
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        data.pipeline(ctx)
    }
}

export_plugin!(TorchScript);
