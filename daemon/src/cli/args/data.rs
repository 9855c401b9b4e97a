//! The flags of `trainerd data` and the data flags every command that reads a dataset shares.

use std::path::PathBuf;

use clap::Subcommand;

use super::{PluginArgFlags, S3Args};

/// `trainerd data ...`.
#[derive(Subcommand)]
pub(crate) enum DataCommand {
    /// Show a dataset's files, rows, row groups, schema, split sizes and fingerprint.
    Inspect {
        /// The dataset: a directory or s3://bucket/prefix of Parquet files.
        url: String,
        /// Raw text: how it is tokenized and packed.
        #[command(flatten)]
        text: InspectText,
        /// S3 settings.
        #[command(flatten)]
        s3: S3Args,
    },
    /// Write an MNIST-format directory (idx files) as Parquet in Hugging Face's layout: an
    /// `image` struct of PNG bytes and an int64 `label`, rows in the idx files' order.
    Convert {
        /// The MNIST-format directory.
        from: PathBuf,
        /// Where the Parquet files go: a directory or s3://bucket/prefix.
        to: String,
        /// Rows per file (files are named train-00000-of-0000N.parquet).
        #[arg(long, default_value_t = 20_000)]
        rows_per_file: usize,
        /// Rows per row group (Hugging Face writes image datasets in row groups of 100 rows).
        #[arg(long, default_value_t = 100)]
        rows_per_group: usize,
        /// S3 settings.
        #[command(flatten)]
        s3: S3Args,
    },
    /// Read the training split for a plugin's columns through the input pipeline alone, as one
    /// worker reads it in training (the model excluded), and print its throughput.
    Read(Box<ReadArgs>),
}

/// `trainerd data inspect`'s flags for raw text: with a string column and a tokenizer (beside the
/// data or named), it shows the tokenizer, the documents, the tokens and the blocks.
#[derive(clap::Args)]
pub(crate) struct InspectText {
    /// The tokenizer, column and end-of-text token.
    #[command(flatten)]
    pub(crate) text: TextArgs,
    /// The block lengths to count blocks at.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024,2048")]
    pub(crate) length: Vec<u32>,
}

/// `trainerd data read`'s flags.
#[derive(clap::Args)]
pub(crate) struct ReadArgs {
    /// The plugin whose columns are read.
    #[arg(long)]
    pub(crate) plugin: PathBuf,
    /// The plugin's arguments.
    #[command(flatten)]
    pub(crate) plugin_args: PluginArgFlags,
    /// The data.
    #[command(flatten)]
    pub(crate) data: DataArgs,
    /// Epochs to read.
    #[arg(long, default_value_t = 1)]
    pub(crate) epochs: u32,
    /// Per-worker batch size (default: the plugin's).
    #[arg(long)]
    pub(crate) batch_size: Option<u32>,
    /// Workers the global batch is shared by.
    #[arg(long, default_value_t = 1)]
    pub(crate) workers: u64,
    /// This worker's rank.
    #[arg(long, default_value_t = 0)]
    pub(crate) rank: u64,
    /// Rows shuffled together (as `trainerd run`'s).
    #[arg(long, default_value_t = 65536)]
    pub(crate) shuffle_window: u64,
    /// The run's seed.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    pub(crate) summary: Option<PathBuf>,
    /// S3 settings.
    #[command(flatten)]
    pub(crate) s3: S3Args,
}

/// The data flags `run` and `evaluate` share.
#[derive(clap::Args)]
pub(crate) struct DataArgs {
    /// The dataset: a directory in the plugin's own format (MNIST's idx files), or Parquet files
    /// in Hugging Face's layout (train-*.parquet, test-*.parquet) in a directory or under
    /// s3://bucket/prefix (with the --s3-* settings).
    #[arg(long)]
    pub(crate) data: String,
    /// Threads that read and decode a Parquet dataset ahead of the step (default: a quarter of
    /// the cores, at least 1: on a machine whose cores all train, each decoding thread slows
    /// the steps).
    #[arg(long)]
    pub(crate) loader_threads: Option<usize>,
    /// Where remote (S3) data and raw text's token streams are cached; default: systemd's
    /// CACHE_DIRECTORY, else ~/.cache/trainerd/data. Workers on one host may share it.
    #[arg(long, env = "TRAINERD_DATA_CACHE")]
    pub(crate) data_cache: Option<PathBuf>,
    /// The cache's bound (K, M, G, T: powers of 1024), remote data and token streams together;
    /// least recently used goes first, never a token stream a run is reading.
    #[arg(long, default_value = "10G", value_parser = parse_bytes)]
    pub(crate) data_cache_size: u64,
    /// Seconds a read of the data waits for a failing source (retried, logged, shown in STATUS=)
    /// before the run fails naming the file; less than --collective-timeout, so that peers
    /// waiting in a collective do not give up first [default: 60; at most half the collective
    /// timeout].
    #[arg(long)]
    pub(crate) data_timeout: Option<f64>,
    /// Raw text: its tokenizer, column and end-of-text token.
    #[command(flatten)]
    pub(crate) text: TextArgs,
}

/// How raw text (a model's `text` column) is tokenized.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct TextArgs {
    /// For a model that trains on raw text: its tokenizer.json, a file or s3://bucket/key (with
    /// the --s3-* settings; cached in the data cache) (default: the tokenizer.json beside the
    /// dataset's Parquet files, on S3 as well). Its sha256 is part of the run.
    #[arg(long)]
    pub(crate) tokenizer: Option<trainerd_data::text::TokenizerLocation>,
    /// The documents' column of a raw-text dataset.
    #[arg(long, default_value = "text")]
    pub(crate) text_column: String,
    /// The token that ends each document of raw text (default: the tokenizer's own:
    /// <|endoftext|>, <|end_of_text|>, </s>, <eos> or <|im_end|>, the first it has).
    #[arg(long)]
    pub(crate) eos_token: Option<String>,
}

impl Default for TextArgs {
    fn default() -> TextArgs {
        TextArgs { tokenizer: None, text_column: "text".into(), eos_token: None }
    }
}

impl DataArgs {
    /// Loader threads: the flag, or a quarter of the cores (at least 1).
    pub(crate) fn loader_threads(&self) -> usize {
        self.loader_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() / 4).max(1))
    }

    /// The defaults, for a tool that reads `data` once (`trainerd data inspect`).
    pub(crate) fn for_tools(data: &str) -> DataArgs {
        DataArgs {
            data: data.into(),
            loader_threads: Some(4),
            data_cache: None,
            data_cache_size: 10 << 30,
            data_timeout: None,
            text: TextArgs::default(),
        }
    }

    /// How raw text is found and read: the flags (its token streams are kept in the data cache,
    /// within its bound).
    pub(crate) fn text_options(&self) -> trainerd_data::text::TextOptions {
        trainerd_data::text::TextOptions {
            tokenizer: self.text.tokenizer.clone(),
            column: self.text.text_column.clone(),
            eos: self.text.eos_token.clone(),
        }
    }

    /// The cache directory: the flag, systemd's `CacheDirectory=`, or the user's cache.
    pub(crate) fn cache_dir(&self) -> PathBuf {
        if let Some(dir) = &self.data_cache {
            return dir.clone();
        }
        let base = std::env::var_os("CACHE_DIRECTORY")
            .map(|d| PathBuf::from(d.to_string_lossy().split(':').next().unwrap_or_default()))
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("trainerd")))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/trainerd")))
            .unwrap_or_else(|| PathBuf::from(".cache/trainerd"));
        base.join("data")
    }
}

/// A size in bytes: digits with an optional K, M, G or T (powers of 1024; a trailing `B` or
/// `iB` allowed).
pub(super) fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (digits, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = digits.trim().parse().map_err(|_| format!("{text:?}: expected a size such as 512M or 10G"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("{text:?}: too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_bytes("512"), Ok(512));
        assert_eq!(parse_bytes("8M"), Ok(8 << 20));
        assert_eq!(parse_bytes("10G"), Ok(10 << 30));
        assert_eq!(parse_bytes("10GiB"), Ok(10 << 30));
        assert_eq!(parse_bytes("1k"), Ok(1024));
        assert_eq!(parse_bytes("2T"), Ok(2 << 40));
        assert_eq!(parse_bytes("lots"), Err("\"lots\": expected a size such as 512M or 10G".into()));
        assert!(parse_bytes("99999999999T").is_err());
    }
}
