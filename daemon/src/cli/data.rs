//! `trainerd data`: what a dataset holds (`inspect`), an MNIST-format directory written as
//! Parquet in Hugging Face's layout (`convert`), and a dataset read through the input pipeline
//! alone, as a worker reads it for a plugin, the model excluded (`read`: its throughput).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use trainerd_data::convert::{self, Sharding};
use trainerd_data::schema::describe;
use trainerd_data::{DataLocation, Dataset, Plan, Quiet, Shuffle, Slice};
use trainerd_sdk::Split;

use super::args::{DataCommand, InspectText, ReadArgs, S3Args};
use super::data_options;
use crate::ops::progress::{thousands, Progress};
use crate::plugin::Plugin;

/// Runs `trainerd data inspect|convert|read`; its exit status.
pub(crate) fn run(command: DataCommand) -> anyhow::Result<i32> {
    match command {
        DataCommand::Inspect { url, text, s3 } => inspect(&url, &text, &s3),
        DataCommand::Convert { from, to, rows_per_file, rows_per_group, s3 } => {
            anyhow::ensure!(
                rows_per_file > 0 && rows_per_group > 0,
                "--rows-per-file and --rows-per-group: expected at least 1"
            );
            convert(&from, &to, trainerd_data::convert::Sharding { rows_per_file, rows_per_group }, &s3)
        }
        DataCommand::Read(args) => read(&args),
    }
}

/// `trainerd data inspect URL`: files, rows, row groups, schema and split sizes; with a text
/// column and a tokenizer, the documents, tokens and blocks.
pub(crate) fn inspect(url: &str, text: &InspectText, s3: &S3Args) -> anyhow::Result<i32> {
    let location: DataLocation = url.parse()?;
    let data = super::args::DataArgs { text: text.text.clone(), ..super::args::DataArgs::for_tools(url) };
    let options = data_options(&data, s3, Arc::new(Quiet), super::data_timeout(&data)?)?;
    let dataset = Dataset::open(&location, options)?;
    println!("dataset: {location}");
    println!("fingerprint: {}", dataset.fingerprint());
    for split in [Split::Train, Split::Test] {
        let Some(index) = dataset.split(split) else {
            println!("test: none (no test or validation split: a run needs --no-evaluation)");
            continue;
        };
        let serves = if index.name == "validation" { " (evaluated as the test split)" } else { "" };
        println!(
            "{}{serves}: {} rows in {} file(s), {} row groups, {}",
            index.name,
            thousands(index.rows() as f64),
            index.files.len(),
            index.groups.len(),
            bytes(index.bytes())
        );
        for f in &index.files {
            let meta = f.meta.metadata();
            let rows: i64 = meta.row_groups().iter().map(|g| g.num_rows()).sum();
            let largest = meta.row_groups().iter().map(|g| g.num_rows()).max().unwrap_or(0);
            println!(
                "  {}: {} rows, {} row groups (largest {} rows), {}",
                f.file.name,
                thousands(rows as f64),
                meta.num_row_groups(),
                thousands(largest as f64),
                bytes(f.file.size)
            );
        }
    }
    let first = &dataset.split(Split::Train).expect("a dataset always has a training split").files[0];
    println!("schema (of {}):", first.file.name);
    for field in first.meta.schema().fields() {
        println!("  {}: {}", field.name(), describe(field.data_type()));
    }
    if first.meta.schema().field_with_name(&text.text.text_column).is_ok() {
        let options = data.text_options();
        // A tokenizer beside the data is optional here; one named by --tokenizer must load.
        match dataset.tokenizer(&options) {
            Ok(tokenizer) => inspect_text(&dataset, &options, &tokenizer, &text.length)?,
            Err(e) if text.text.tokenizer.is_some() => return Err(e.into()),
            Err(_) => {}
        }
    }
    Ok(0)
}

/// The raw text of `dataset`: its tokenizer, and each split's documents, tokens and blocks at
/// each of `lengths` (each split tokenized, or its earlier pass read again).
fn inspect_text(
    dataset: &Dataset,
    options: &trainerd_data::text::TextOptions,
    tokenizer: &trainerd_data::text::Tokenizer,
    lengths: &[u32],
) -> anyhow::Result<()> {
    println!(
        "text: column `{}`, tokenizer {} (sha256 {}, {} ids; {:?} = {} ends each document)",
        options.column, tokenizer.location, tokenizer.sha256, tokenizer.vocab, tokenizer.eos.0, tokenizer.eos.1
    );
    for split in [Split::Train, Split::Test] {
        let Some(index) = dataset.split(split) else { continue };
        let tokens = dataset.tokenize(split, options, tokenizer, &mut |_, _, _| {})?;
        let c = tokens.counts;
        let blocks: Vec<String> = lengths
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| format!("{} of {l}", thousands((c.tokens / u64::from(l)) as f64)))
            .collect();
        println!(
            "  {}: {} documents ({} empty, skipped), {} tokens (end-of-text tokens included); blocks: {}",
            index.name,
            thousands(c.documents as f64),
            thousands(c.empty as f64),
            thousands(c.tokens as f64),
            blocks.join(", ")
        );
    }
    Ok(())
}

/// `trainerd data convert FROM TO`: an MNIST-format directory as Parquet, with progress (a bar
/// on a terminal, a line per file otherwise).
pub(crate) fn convert(from: &Path, to: &str, sharding: Sharding, s3: &S3Args) -> anyhow::Result<i32> {
    let location: DataLocation = to.parse()?;
    let mut progress = Progress::stdout(crate::ops::log::LogFormat::Plain);
    let mut split_started = (None, Instant::now());
    let written = convert::mnist(from, &location, &s3.options(), sharding, &mut |split, done, total| {
        if split_started.0 != Some(split) {
            split_started = (Some(split), Instant::now());
            let name = trainerd_data::index::split_name(split);
            progress.line(&format!("{name}: writing {} rows as PNG images", thousands(total as f64)));
        }
        progress.step(done as u64, total as u64, split_started.1.elapsed(), &[]);
        if done == total {
            progress.finish_bar();
        }
    })?;
    for w in written {
        progress.line(&format!(
            "{}: {} rows in {} file(s) ({}) at {location}",
            trainerd_data::index::split_name(w.split),
            thousands(w.rows as f64),
            w.files.len(),
            bytes(w.bytes)
        ));
    }
    Ok(0)
}

/// `trainerd data read`: the training split read for a plugin's columns by worker `--rank` of
/// `--workers`, as training would read it, the model excluded; prints examples per second.
pub(crate) fn read(args: &ReadArgs) -> anyhow::Result<i32> {
    let plugin = Plugin::load(&args.plugin, &args.plugin_args.parse()?)?;
    let columns = plugin
        .info()
        .columns
        .clone()
        .ok_or_else(|| anyhow::anyhow!("plugin {} declares no columns", plugin.info().name))?;
    let location: DataLocation = args.data.data.parse()?;
    let options = data_options(&args.data, &args.s3, Arc::new(Quiet), super::data_timeout(&args.data)?)?;
    if let Some(packed) = columns.packed_text() {
        return read_text(args, plugin.info(), (&location, options), packed);
    }
    let opened = Instant::now();
    let dataset = Dataset::open(&location, options)?;
    let reader = dataset.reader(Split::Train, &columns)?;
    let batch = args.batch_size.unwrap_or(plugin.info().defaults.batch_size);
    let slice = Slice { rank: args.rank, workers: args.workers, batch: u64::from(batch), training: true };
    let steps_per_epoch = slice.steps(reader.rows());
    let shuffle = Some(Shuffle { seed: args.seed, window: args.shuffle_window });
    let opened = opened.elapsed();
    let started = Instant::now();
    let mut stream = reader.open(Plan { slice, shuffle, first: (0, 0), end_epoch: args.epochs, steps_per_epoch });
    let mut examples = 0u64;
    while let Some(b) = stream.next_batch()? {
        examples += b.columns.examples() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    let rate = examples as f64 / seconds.max(1e-9);
    let fetched: u64 = dataset.traffic().values().map(|t| t.fetched).sum();
    println!(
        "read {} examples ({} epoch(s), batch {batch}, worker {} of {}) in {seconds:.2} s: {} examples/s with {} \
         loader thread(s); {} fetched, at most {} of rows held; opening took {:.2} s",
        thousands(examples as f64),
        args.epochs,
        args.rank,
        args.workers,
        thousands(rate),
        args.data.loader_threads(),
        bytes(fetched),
        bytes(dataset.peak_held_bytes() as u64),
        opened.as_secs_f64()
    );
    if let Some(path) = &args.summary {
        let json = serde_json::json!({
            "examples": examples,
            "seconds": seconds,
            "examples_per_second": rate,
            "loader_threads": args.data.loader_threads(),
            "bytes_fetched": fetched,
            "peak_held_bytes": dataset.peak_held_bytes(),
        });
        crate::sys::atomic::write_file(path, &[format!("{json}\n").as_bytes()])?;
    }
    Ok(0)
}

/// `trainerd data read` of raw text: the training split tokenized and packed (unless an earlier
/// pass is kept) and its blocks read, as a worker does before and during training; prints tokens
/// per second over both.
fn read_text(
    args: &ReadArgs,
    info: &trainerd_sdk::PluginInfo,
    (location, options): (&DataLocation, trainerd_data::Options),
    (name, length): (&str, u32),
) -> anyhow::Result<i32> {
    let started = Instant::now();
    let say = &mut |line: &str| println!("{line}");
    let text = crate::input::text::Text::open(
        location,
        info,
        (name, length),
        (options, &args.data.text_options(), false),
        say,
    )?;
    let packed = started.elapsed().as_secs_f64();
    let batch = args.batch_size.unwrap_or(info.defaults.batch_size);
    let slice = Slice { rank: args.rank, workers: args.workers, batch: u64::from(batch), training: true };
    let steps_per_epoch = slice.steps(text.train.count());
    let shuffle = Some(Shuffle { seed: args.seed, window: u64::MAX });
    let mut stream = text.train.open(Plan { slice, shuffle, first: (0, 0), end_epoch: args.epochs, steps_per_epoch });
    let mut blocks = 0u64;
    while let Some(b) = stream.next_batch()? {
        blocks += b.blocks.len() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    let tokens = blocks * u64::from(length);
    let rate = tokens as f64 / seconds.max(1e-9);
    println!(
        "read {} blocks of {length} tokens ({} epoch(s), batch {batch}, worker {} of {}) from raw text in {seconds:.2} s: \
         {} tokens/s with {} loader thread(s), tokenizing and packing included ({packed:.2} s{})",
        thousands(blocks as f64),
        args.epochs,
        args.rank,
        args.workers,
        thousands(rate),
        args.data.loader_threads(),
        if text.train.made { "" } else { "; an earlier pass was read again" },
    );
    if let Some(path) = &args.summary {
        let json = serde_json::json!({
            "blocks": blocks,
            "tokens": tokens,
            "seconds": seconds,
            "pack_seconds": packed,
            "tokenized": text.train.made,
            "tokens_per_second": rate,
            "loader_threads": args.data.loader_threads(),
            "documents": text.train.counts.documents,
            "empty_documents": text.train.counts.empty,
            "stream_tokens": text.train.counts.tokens,
        });
        crate::sys::atomic::write_file(path, &[format!("{json}\n").as_bytes()])?;
    }
    Ok(0)
}

/// `1.2 MB`, `3.4 GB` (powers of 1000).
pub(crate) fn bytes(n: u64) -> String {
    let n = n as f64;
    match n {
        n if n >= 1e9 => format!("{:.1} GB", n / 1e9),
        n if n >= 1e6 => format!("{:.1} MB", n / 1e6),
        n if n >= 1e3 => format!("{:.1} kB", n / 1e3),
        n => format!("{n:.0} B"),
    }
}
