//! Softmax regression on MNIST-format images, as a trainerd plugin: one Dense layer from the
//! flattened pixels to the classes. Small and fast, for tests and examples. With
//! `--plugin-arg wide=ROWS`, a table of hashed (pixel, intensity) features is added to the logits
//! (Wide & Deep's wide part): a state as large as wanted (40 bytes a row) at little compute, for
//! the tests and benchmarks whose cost grows with the state.

use std::path::Path;
use std::sync::Arc;

use trainerd_sdk::mnist::Mnist;
use trainerd_sdk::tch::{nn, Kind, Tensor};
use trainerd_sdk::{
    export_plugin, ArgSpec, Batch, Columns, InputContext, LrSchedule, Model, OptimizerConfig, Pipeline, PluginArgs,
    PluginError, PluginInfo, Split, TrainDefaults,
};

/// Intensity levels a pixel's feature distinguishes.
const LEVELS: i64 = 16;

/// The model.
pub struct Linear {
    dense: nn::Linear,
    /// The wide table (rows x classes), if any, and each pixel's first feature index.
    wide: Option<(Tensor, Tensor)>,
}

impl Model for Linear {
    type Data = Mnist;

    fn arguments() -> Vec<ArgSpec> {
        vec![ArgSpec::new(
            "wide",
            "rows of a table of hashed (pixel, intensity) features whose rows are summed into the logits (Wide & \
             Deep's wide part; 40 bytes a row, zeros at the start); none when not given, so that the commits of the \
             model without it resume",
            None,
        )]
    }

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

    fn new(root: &nn::Path, args: &PluginArgs) -> Result<Self, PluginError> {
        let rows: i64 = args.parsed("wide", "a number of rows (0: none)")?.unwrap_or(0);
        if rows < 0 {
            return Err(PluginError::Other(format!("--plugin-arg wide={rows}: expected a number of rows (0: none)")));
        }
        let dense = nn::linear(root / "dense", 28 * 28, 10, Default::default());
        let wide = (rows > 0).then(|| {
            let table = root.zeros("wide", &[rows, 10]);
            let first = Tensor::arange(28 * 28, (Kind::Int64, root.device())) * LEVELS;
            (table, first)
        });
        Ok(Linear { dense, wide })
    }

    fn forward(&self, batch: &Batch, _train: bool) -> Result<Tensor, PluginError> {
        let xs = batch.input()?.f_flatten(1, -1)?;
        let logits = xs.apply(&self.dense);
        let Some((table, first)) = &self.wide else { return Ok(logits) };
        // Each pixel's feature: its index and its intensity level, hashed into the table's rows.
        let level = (&xs * (LEVELS - 1) as f64).f_round()?.f_clamp(0, LEVELS - 1)?.f_to_kind(Kind::Int64)?;
        let rows = table.size()[0];
        let features = ((level + first) * 2_654_435_761i64).f_remainder(rows)?;
        let wide = Tensor::f_embedding(table, &features, -1, false, false)?.f_sum_dim_intlist(1, false, Kind::Float)?;
        Ok(logits + wide)
    }

    fn load_data(&self, dir: &Path, split: Split) -> Result<Mnist, PluginError> {
        Ok(Mnist::load(dir, split)?)
    }

    fn input_pipeline(&self, data: &Arc<Mnist>, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        data.pipeline(ctx)
    }
}

export_plugin!(Linear);
