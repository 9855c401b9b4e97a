//! The tutorials' CNN with the layers that carry state besides their weights, as a trainerd
//! plugin: Conv2D 32 3x3 -> BatchNorm -> ReLU -> MaxPool 2x2 -> Flatten -> Dense 64 ReLU ->
//! Dropout 0.2 -> Dense 10, on 28x28 MNIST-format images.
//!
//! BatchNorm's running mean and variance are non-trainable variables: the daemon keeps them as
//! state (averaged over the workers after every step, as TensorFlow's MirroredStrategy
//! aggregates them, checkpointed and restored exactly). Dropout draws from libtorch's generator,
//! which the daemon seeds from (seed, step, rank) before every step.

use std::path::Path;
use std::sync::Arc;

use trainerd_sdk::mnist::{expect_images, Mnist};
use trainerd_sdk::tch::{nn, nn::Module, Tensor};
use trainerd_sdk::{
    export_plugin, Batch, Columns, InputContext, Model, Pipeline, PluginArgs, PluginError, PluginInfo, Split,
};

/// Dropout rate.
const DROPOUT: f64 = 0.2;

/// The model.
pub struct MnistBn {
    conv: nn::Conv2D,
    bn: nn::BatchNorm,
    dense: nn::Linear,
    logits: nn::Linear,
}

impl Model for MnistBn {
    type Data = Mnist;

    fn info(_: &PluginArgs) -> Result<PluginInfo, PluginError> {
        Ok(PluginInfo::classifier(
            "mnist-bn",
            env!("CARGO_PKG_VERSION"),
            "Conv2D(32, 3x3) BatchNorm ReLU, MaxPool 2x2, Dense 64 ReLU, Dropout, Dense 10 on 28x28 \
                          MNIST-format images",
        )
        .with_columns(Columns::image_classification(1, 28, 28)))
    }

    fn new(root: &nn::Path, _: &PluginArgs) -> Result<Self, PluginError> {
        // A convolution followed by BatchNorm needs no bias (BatchNorm's shift replaces it).
        let no_bias = nn::ConvConfig { bias: false, ..Default::default() };
        Ok(MnistBn {
            conv: nn::conv2d(root / "conv", 1, 32, 3, no_bias),
            bn: nn::batch_norm2d(root / "bn", 32, Default::default()),
            dense: nn::linear(root / "dense", 32 * 13 * 13, 64, Default::default()),
            logits: nn::linear(root / "logits", 64, 10, Default::default()),
        })
    }

    fn forward(&self, batch: &Batch, train: bool) -> Result<Tensor, PluginError> {
        let xs = expect_images("mnist-bn", batch)?;
        Ok(self
            .conv
            .forward(xs)
            .apply_t(&self.bn, train)
            .relu()
            .max_pool2d_default(2)
            .flatten(1, -1)
            .apply(&self.dense)
            .relu()
            .dropout(DROPOUT, train)
            .apply(&self.logits))
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        data.pipeline(ctx)
    }
}

export_plugin!(MnistBn);
