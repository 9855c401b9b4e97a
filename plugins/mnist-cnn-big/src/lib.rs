//! Seed 000's CNN (TensorFlow's multi-worker Keras tutorial, as the shared benchmarks' `CNN=big`
//! builds it), as a trainerd plugin: Conv2D 32 filters 3x3 ReLU -> Flatten -> Dense 128 ReLU ->
//! Dense 10, on 28x28 MNIST-format images. 2,770,634 parameters, nearly all in the first dense
//! layer: the case where communication, not computation, dominates a step.

use std::path::Path;
use std::sync::Arc;

use trainerd_sdk::mnist::{expect_images, Mnist};
use trainerd_sdk::tch::{nn, nn::Module, Tensor};
use trainerd_sdk::{
    export_plugin, Batch, Columns, InputContext, Model, Pipeline, PluginArgs, PluginError, PluginInfo, Split,
};

/// The model.
pub struct MnistCnnBig {
    conv: nn::Conv2D,
    dense: nn::Linear,
    logits: nn::Linear,
}

impl Model for MnistCnnBig {
    type Data = Mnist;

    fn info(_: &PluginArgs) -> Result<PluginInfo, PluginError> {
        Ok(PluginInfo::classifier(
            "mnist-cnn-big",
            env!("CARGO_PKG_VERSION"),
            "Conv2D(32, 3x3) ReLU, Flatten, Dense 128 ReLU, Dense 10 on 28x28 MNIST-format images \
                          (2.77 M parameters)",
        )
        .with_columns(Columns::image_classification(1, 28, 28)))
    }

    fn new(root: &nn::Path, _: &PluginArgs) -> Result<Self, PluginError> {
        Ok(MnistCnnBig {
            conv: nn::conv2d(root / "conv", 1, 32, 3, Default::default()),
            dense: nn::linear(root / "dense", 32 * 26 * 26, 128, Default::default()),
            logits: nn::linear(root / "logits", 128, 10, Default::default()),
        })
    }

    fn forward(&self, batch: &Batch, _train: bool) -> Result<Tensor, PluginError> {
        let xs = expect_images("mnist-cnn-big", batch)?;
        Ok(self.conv.forward(xs).relu().flatten(1, -1).apply(&self.dense).relu().apply(&self.logits))
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        data.pipeline(ctx)
    }
}

export_plugin!(MnistCnnBig);
