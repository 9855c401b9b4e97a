//! The CNN of TensorFlow's multi-worker tutorials, as a trainerd plugin:
//! Conv2D 32 filters 3x3 ReLU -> MaxPool 2x2 -> Flatten -> Dense 64 ReLU -> Dense 10,
//! trained on MNIST-format 28x28 images (MNIST, Fashion-MNIST).

use std::path::Path;
use std::sync::Arc;

use trainerd_sdk::mnist::{expect_images, Mnist};
use trainerd_sdk::tch::{nn, nn::Module, Tensor};
use trainerd_sdk::{
    export_plugin, Batch, Columns, InputContext, Model, Pipeline, PluginArgs, PluginError, PluginInfo, Split,
};

/// The model.
pub struct MnistCnn {
    conv: nn::Conv2D,
    dense: nn::Linear,
    logits: nn::Linear,
}

impl Model for MnistCnn {
    type Data = Mnist;

    fn info(_: &PluginArgs) -> Result<PluginInfo, PluginError> {
        Ok(PluginInfo::classifier(
            "mnist-cnn",
            env!("CARGO_PKG_VERSION"),
            "Conv2D(32, 3x3) ReLU, MaxPool 2x2, Dense 64 ReLU, Dense 10 on 28x28 MNIST-format images",
        )
        .with_columns(Columns::image_classification(1, 28, 28)))
    }

    fn new(root: &nn::Path, _: &PluginArgs) -> Result<Self, PluginError> {
        Ok(MnistCnn {
            conv: nn::conv2d(root / "conv", 1, 32, 3, Default::default()),
            dense: nn::linear(root / "dense", 32 * 13 * 13, 64, Default::default()),
            logits: nn::linear(root / "logits", 64, 10, Default::default()),
        })
    }

    fn forward(&self, batch: &Batch, _train: bool) -> Result<Tensor, PluginError> {
        let xs = expect_images("mnist-cnn", batch)?;
        Ok(self
            .conv
            .forward(xs)
            .relu()
            .max_pool2d_default(2)
            .flatten(1, -1)
            .apply(&self.dense)
            .relu()
            .apply(&self.logits))
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        data.pipeline(ctx)
    }
}

export_plugin!(MnistCnn);
