//! Raw text for a model that declares a `text` column: the dataset's documents tokenized by the
//! run's tokenizer and packed into blocks ([`trainerd_data::text`]) before the cluster forms, so
//! that the steps of an epoch (and the schedule's length) are known before step 0. The
//! tokenizer's sha256, the column, the end-of-text id and the block length are part of what every
//! worker must agree on, and of every commit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use trainerd_data::text::{Blocks, TextOptions, Tokenizer};
use trainerd_data::{DataLocation, Dataset, Options};
use trainerd_sdk::{PluginInfo, Split};

use super::InputError;
use crate::ops::progress::thousands;

/// A packed text dataset: its tokenizer and each split's blocks.
pub(crate) struct Text {
    /// The dataset.
    pub(crate) dataset: Dataset,
    /// The tokenizer.
    pub(crate) tokenizer: Tokenizer,
    /// The documents' column.
    pub(crate) column: String,
    /// The training split's blocks.
    pub(crate) train: Arc<Blocks>,
    /// The test split's (the validation split's where there is no test split); none when the run
    /// does not evaluate.
    pub(crate) test: Option<Arc<Blocks>>,
}

impl Text {
    /// Opens the dataset at `location` for `info`'s text column `(name, length)`: its tokenizer
    /// checked against the model's embedding, each split needed tokenized (or its earlier pass
    /// read again), `say` told how it went.
    pub(crate) fn open(
        location: &DataLocation,
        info: &PluginInfo,
        (name, length): (&str, u32),
        (options, text, evaluate): (Options, &TextOptions, bool),
        say: &mut dyn FnMut(&str),
    ) -> Result<Text, InputError> {
        let dataset = Dataset::open(location, options)?;
        let tokenizer = dataset.tokenizer(text)?;
        if let Some(rows) = info.vocab_size.filter(|&rows| tokenizer.vocab > rows) {
            return Err(InputError::VocabularyTooLarge {
                tokenizer: tokenizer.location.clone(),
                ids: tokenizer.vocab,
                plugin: info.name.clone(),
                rows,
            });
        }
        let mut pack = |split: Split| -> Result<Arc<Blocks>, InputError> {
            let index = dataset.split(split).expect("asked only for a split the dataset has");
            let (started, mut shown) = (Instant::now(), Instant::now());
            let mut progress = |done: usize, groups: usize, tokens: u64| {
                if shown.elapsed() >= Duration::from_secs(5) {
                    shown = Instant::now();
                    say(&format!(
                        "trainerd: tokenizing the {} split: {done}/{groups} row group(s), {} tokens",
                        index.name,
                        thousands(tokens as f64)
                    ));
                }
            };
            let tokens = dataset.tokenize(split, text, &tokenizer, &mut progress)?;
            let location = dataset.location().to_string();
            let blocks = Blocks::new(tokens, length, name, (index.name, &location))?;
            say(&packed(index.name, &blocks, started.elapsed()));
            Ok(Arc::new(blocks))
        };
        let train = pack(Split::Train)?;
        let test = match (evaluate, dataset.split(Split::Test).is_some()) {
            (false, _) => None,
            (true, false) => return Err(InputError::NoTestSplit { location: location.to_string() }),
            (true, true) => Some(pack(Split::Test)?),
        };
        Ok(Text { dataset, tokenizer, column: text.column.clone(), train, test })
    }

    /// What every worker must agree on: the dataset, the column, the tokenizer, its end-of-text
    /// id, and the blocks' length.
    pub(crate) fn agreement(&self) -> serde_json::Value {
        serde_json::json!({
            "format": "parquet",
            "fingerprint": self.dataset.fingerprint(),
            "text": {
                "column": self.column,
                "tokenizer_sha256": self.tokenizer.sha256,
                "eos_id": self.tokenizer.eos.1,
                "length": self.train.length,
            },
        })
    }

    /// The run's line on its data.
    pub(crate) fn describe(&self) -> String {
        let t = &self.tokenizer;
        let test =
            self.test.as_ref().map_or("no evaluation".into(), |b| format!("{} test", thousands(b.count() as f64)));
        format!(
            "data: raw text of column `{}` at {} (fingerprint {}), tokenized by {} (sha256 {}, {} ids, {:?} = {} ends \
             each document), packed into blocks of {} tokens: {} train, {test}; every epoch a uniform shuffle of the \
             blocks",
            self.column,
            self.dataset.location(),
            &self.dataset.fingerprint()[..16],
            t.location,
            &t.sha256[..16],
            t.vocab,
            t.eos.0,
            t.eos.1,
            self.train.length,
            thousands(self.train.count() as f64),
        )
    }
}

/// What a split's pass gave, in one line.
fn packed(split: &str, blocks: &Blocks, took: Duration) -> String {
    let c = blocks.counts;
    let how = if blocks.made {
        format!(
            "tokenized in {:.1}s, {} tokens/s",
            took.as_secs_f64(),
            thousands(c.tokens as f64 / took.as_secs_f64().max(1e-9))
        )
    } else {
        "as an earlier run tokenized them".into()
    };
    format!(
        "trainerd: {split} split: {} document(s) ({} empty, skipped), {} tokens, {} block(s) of {} ({} token(s) \
         left over); {how}",
        thousands(c.documents as f64),
        thousands(c.empty as f64),
        thousands(c.tokens as f64),
        thousands(blocks.count() as f64),
        blocks.length,
        c.tokens - blocks.count() * u64::from(blocks.length),
    )
}
