//! Softmax regression on MNIST-format images, as a trainerd plugin: one Dense layer from the
//! flattened pixels to the classes. Small and fast, for tests and examples.

use std::path::Path;
use std::sync::Arc;

use trainerd_sdk::mnist::Mnist;
use trainerd_sdk::tch::{nn, Tensor};
use trainerd_sdk::{
    export_plugin, Batch, Columns, InputContext, LrSchedule, Model, OptimizerConfig, Pipeline, PluginArgs, PluginError,
    PluginInfo, Split, TrainDefaults,
};

/// The model.
pub struct Linear {
    dense: nn::Linear,
}

impl Model for Linear {
    type Data = Mnist;

    fn info(_: &PluginArgs) -> Result<PluginInfo, PluginError> {
        Ok(PluginInfo {
            name: "linear".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: "softmax regression (one Dense layer) on 28x28 MNIST-format images".into(),
            metrics: vec!["accuracy".into()],
            defaults: TrainDefaults {
                epochs: 1,
                batch_size: 64,
                optimizer: OptimizerConfig::sgd(0.1),
                schedule: LrSchedule::Constant,
            },
            columns: Some(Columns::image_classification(1, 28, 28)),
            identity: Default::default(),
            language_model: false,
            export_names: Vec::new(),
            no_decay: Vec::new(),
            vocab_size: None,
        })
    }

    fn new(root: &nn::Path, _: &PluginArgs) -> Result<Self, PluginError> {
        Ok(Linear { dense: nn::linear(root / "dense", 28 * 28, 10, Default::default()) })
    }

    fn forward(&self, batch: &Batch, _train: bool) -> Result<Tensor, PluginError> {
        let xs = batch.input()?;
        Ok(xs.f_flatten(1, -1)?.apply(&self.dense))
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        data.pipeline(ctx)
    }
}

export_plugin!(Linear);
