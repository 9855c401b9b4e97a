//! A trainerd plugin for models as PyTorch users write them: an eager `torch.nn.Module` from a
//! Python file (`--plugin-arg module=PATH`), run by CPython embedded in the worker process.
//!
//! The interpreter is the PyTorch virtualenv's that the plugin was built with, and its `torch` is
//! the libtorch that trainerd links: Python tensors and trainerd's are the same objects, and pass
//! across without copies (PyTorch's own conversions, through `shim.cpp`). The module's
//! parameters become the model's trainable variables and its persistent buffers its state, both
//! sharing the module's storage, so trainerd's optimizer, all-reduce, checkpoints and
//! `params_sha256` cover them. The forward pass and the loss run under the GIL; trainerd's
//! backward pass, all-reduce, optimizer and input pipeline run without it.
//!
//! What the file may define, and how each part is checked, is in `runtime.py`, which does the
//! Python side of every call.

mod python;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use trainerd_sdk::mnist::Mnist;
use trainerd_sdk::tch::{nn, Device, Tensor};
use trainerd_sdk::{
    export_plugin, ArgSpec, Batch, Column, Columns, Decode, InputContext, Model, Pipeline, PluginArgs, PluginError,
    PluginInfo, Split,
};

/// The key naming the model file.
const MODULE: &str = "module";

/// A Python model: the runtime's `Runner` over the file's module.
pub struct PythonModel {
    runner: Py<PyAny>,
}

/// The model file's path, required.
fn module_path(args: &PluginArgs) -> Result<PathBuf, PluginError> {
    args.get(MODULE).map(PathBuf::from).ok_or_else(|| {
        PluginError::Other(
            "--plugin-arg module=PATH is required: the Python file that defines model(args) -> torch.nn.Module".into(),
        )
    })
}

/// The arguments for the file: every pair but `module`.
fn file_args<'py>(py: Python<'py>, args: &PluginArgs) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (k, v) in args.iter().filter(|(k, _)| *k != MODULE) {
        dict.set_item(k, v)?;
    }
    Ok(dict)
}

/// What the runtime's `info` says of a file.
#[derive(serde::Deserialize)]
struct FileInfo {
    description: String,
    columns: Option<Vec<(String, String)>>,
    metrics: Vec<String>,
    identity: BTreeMap<String, String>,
    language_model: bool,
    export_names: Vec<(String, String)>,
    no_decay: Vec<String>,
    #[serde(default)]
    vocab_size: Option<u64>,
    /// A compiled Keras model's optimizer, with Keras's rules.
    #[serde(default)]
    optimizer: Option<trainerd_sdk::OptimizerConfig>,
}

fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".into(),
    }
}

impl PythonModel {
    /// Calls the runner's `method` on `batch` (with `extra` arguments after it).
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        batch: &Batch,
        extra: Option<bool>,
    ) -> Result<Bound<'py, PyAny>, PluginError> {
        let dict = PyDict::new(py);
        for (name, tensor) in batch.iter() {
            dict.set_item(name, python::to_py(py, tensor).map_err(|e| python::error(py, e))?)
                .map_err(|e| python::error(py, e))?;
        }
        let runner = self.runner.bind(py);
        let out = match extra {
            Some(train) => runner.call_method1(method, (dict, train)),
            None => runner.call_method1(method, (dict,)),
        };
        out.map_err(|e| python::error(py, e))
    }
}

impl Model for PythonModel {
    type Data = Mnist;

    fn arguments() -> Vec<ArgSpec> {
        vec![
            ArgSpec::new(MODULE, "the Python file that defines model(args) (its sha256 is the model's identity)", None)
                .local(),
            ArgSpec::others("the keys the model file declares in its `arguments` dict"),
        ]
    }

    fn info(args: &PluginArgs) -> Result<PluginInfo, PluginError> {
        let path = module_path(args)?;
        let file: FileInfo = python::with_runtime(|py, runtime| {
            let given = file_args(py, args)?;
            let dict = runtime.call_method1("info", (path.to_string_lossy().as_ref(), given))?;
            let json = py.import("json")?.call_method1("dumps", (dict,))?;
            json.extract::<String>()
        })
        .and_then(|json| {
            serde_json::from_str(&json).map_err(|e| PluginError::Other(format!("the runtime's info: {e}: {json}")))
        })?;
        let mut info = PluginInfo::classifier("python-model", env!("CARGO_PKG_VERSION"), &file.description);
        info.metrics = file.metrics;
        info.identity = file.identity;
        info.language_model = file.language_model;
        info.export_names = file.export_names;
        info.no_decay = file.no_decay;
        info.vocab_size = file.vocab_size;
        if let Some(optimizer) = file.optimizer {
            info.defaults.optimizer = optimizer;
        }
        if let Some(columns) = file.columns {
            let parsed = columns
                .into_iter()
                .map(|(name, spec)| {
                    let decode: Decode = spec.parse().map_err(|e| {
                        PluginError::Other(format!("model file {}: column {name:?}: {e}", path.display()))
                    })?;
                    Ok(Column { name, decode })
                })
                .collect::<Result<Vec<_>, PluginError>>()?;
            info.columns = Some(Columns(parsed));
        }
        Ok(info)
    }

    fn new(root: &nn::Path, args: &PluginArgs) -> Result<Self, PluginError> {
        let path = module_path(args)?;
        python::with_runtime(|py, runtime| {
            let given = file_args(py, args)?;
            let device = device_name(root.device());
            let runner = runtime.getattr("Runner")?.call1((path.to_string_lossy().as_ref(), given, device))?;
            let tensors = runner.getattr("tensors")?;
            for item in tensors.downcast::<PyList>()?.iter() {
                let (name, tensor): (String, Bound<'_, PyAny>) = item.extract()?;
                let tensor = python::from_py(&tensor)?;
                let trainable = tensor.requires_grad();
                let mut parts: Vec<&str> = name.split('.').collect();
                let last = parts.pop().unwrap_or_default();
                let at = parts.iter().fold(root.clone(), |p, s| p.sub(*s));
                let _ = at.add(last, tensor, trainable);
            }
            Ok(PythonModel { runner: runner.unbind() })
        })
    }

    fn forward(&self, batch: &Batch, train: bool) -> Result<Tensor, PluginError> {
        if train {
            return Err(PluginError::Other("a Python model trains through step, not forward".into()));
        }
        self.predict(batch)
    }

    fn step(&self, batch: &Batch, train: bool) -> Result<(Tensor, Tensor), PluginError> {
        Python::with_gil(|py| {
            let out = self.call(py, "step", batch, Some(train))?;
            let (loss, metrics): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                out.extract().map_err(|e| python::error(py, e))?;
            let both = python::from_py(&loss).and_then(|l| Ok((l, python::from_py(&metrics)?)));
            both.map_err(|e| python::error(py, e))
        })
    }

    fn predict(&self, batch: &Batch) -> Result<Tensor, PluginError> {
        Python::with_gil(|py| {
            let out = self.call(py, "predict", batch, None)?;
            python::from_py(&out).map_err(|e| python::error(py, e))
        })
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        data.pipeline(ctx)
    }
}

export_plugin!(PythonModel);
