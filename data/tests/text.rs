//! Raw text packed into blocks, against a short Python reference of the packing rule that uses
//! Hugging Face's `tokenizers` (plugins/python-model/examples/pack.py): block for block, with
//! empty and null documents, several files and row groups; the pass kept and read again, and
//! evicted within the data cache's bound; a tokenizer on a real S3-compatible server; and every
//! bad input named.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use trainerd_testkit::s3::{S3Server, S3_KEY_ID, S3_SECRET};

use trainerd_data::text::{Blocks, TextOptions, TokenizerLocation};
use trainerd_data::{DataLocation, Dataset, Options, Quiet};
use trainerd_sdk::Split;
use trainerd_storage::S3Options;

fn python() -> PathBuf {
    std::env::var_os("VIRTUAL_ENV").map(|v| PathBuf::from(v).join("bin/python")).unwrap_or_else(|| "python3".into())
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/python-model/examples")
}

fn run_python(script: &str, args: &[&str]) -> String {
    let out = Command::new(python()).args(["-c", script]).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// A raw-text dataset as Hugging Face's text datasets are: train in 2 files of row groups of 3
/// documents, a test file; empty documents, a null, non-ASCII text, one long document; a
/// byte-level BPE of 300 ids trained on it, `<|endoftext|>` among its special tokens.
fn dataset(dir: &Path) {
    let script = r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out = sys.argv[1]
words = "the quick brown fox jumps over the lazy dog while packing tokens into blocks".split()
docs = [" ".join(words[i % 7:(i % 7) + 3 + i % 5]) * (1 + i % 3) for i in range(40)]
docs[3] = ""
docs[11] = None
docs[17] = "naïve café — «ünïcödé» 東京 " * 3
docs[25] = " ".join(words) * 40
docs[30] = ""
def write(name, rows):
    pq.write_table(pa.table({"text": pa.array(rows, type=pa.string()), "id": list(range(len(rows)))}),
                   f"{out}/{name}", row_group_size=3)
write("train-00000-of-00002.parquet", docs[:20])
write("train-00001-of-00002.parquet", docs[20:36])
write("test-00000-of-00001.parquet", docs[36:])
pq.write_table(pa.table({"text": pa.array([1, 2], type=pa.int64())}), f"{out}/../numbers.parquet")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator([d for d in docs if d], trainer=trainer)
tok.save(f"{out}/tokenizer.json")
"#;
    std::fs::create_dir_all(dir).unwrap();
    run_python(script, &[dir.to_str().unwrap()]);
}

/// The dataset in `dir`, its token streams in the cache `cache` (of 1 GiB).
fn open(dir: &Path, threads: usize, cache: &Path) -> Dataset {
    open_with(dir, threads, (cache, 1 << 30), S3Options::default())
}

fn open_with(dir: &Path, threads: usize, (cache, bytes): (&Path, u64), s3: S3Options) -> Dataset {
    let options = Options {
        s3,
        timeout: Duration::from_secs(5),
        cache: Some((cache.into(), bytes)),
        threads,
        observer: Arc::new(Quiet),
    };
    Dataset::open(&DataLocation::Local(dir.into()), options).unwrap()
}

fn text_options() -> TextOptions {
    TextOptions { tokenizer: None, column: "text".into(), eos: None }
}

/// The reference's blocks of `split` at `length`, and its counts.
fn reference(dir: &Path, split: &str, length: u32) -> (Vec<Vec<i64>>, serde_json::Value) {
    let out = dir.join(format!("../{split}-{length}.u32"));
    let counts = Command::new(python())
        .arg(examples().join("pack.py"))
        .args(["--data", dir.to_str().unwrap(), "--split", split, "--length", &length.to_string()])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(counts.status.success(), "{}", String::from_utf8_lossy(&counts.stderr));
    let bytes = std::fs::read(&out).unwrap();
    let ids: Vec<i64> = bytes.chunks_exact(4).map(|c| i64::from(u32::from_le_bytes(c.try_into().unwrap()))).collect();
    (ids.chunks(length as usize).map(<[i64]>::to_vec).collect(), serde_json::from_slice(&counts.stdout).unwrap())
}

#[test]
fn blocks_are_the_python_references_block_for_block() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    dataset(&dir);
    let cache = tmp.path().join("cache");
    for (split, name, length) in [(Split::Train, "train", 16), (Split::Train, "train", 7), (Split::Test, "test", 5)] {
        let data = open(&dir, 1, &cache);
        let tokenizer = data.tokenizer(&text_options()).unwrap();
        assert_eq!(tokenizer.eos, ("<|endoftext|>".to_string(), 1));
        let tokens = data.tokenize(split, &text_options(), &tokenizer, &mut |_, _, _| {}).unwrap();
        let blocks = Blocks::new(tokens, length, "input_ids", (name, "text")).unwrap();
        let (theirs, counts) = reference(&dir, name, length);
        assert_eq!(blocks.count(), theirs.len() as u64, "{name} at {length}");
        assert!(blocks.count() > 3);
        for (b, block) in theirs.iter().enumerate() {
            assert_eq!(&blocks.block(b as u64).unwrap(), block, "{name} at {length}: block {b}");
        }
        let c = blocks.counts;
        assert_eq!(
            serde_json::json!({"documents": c.documents, "empty": c.empty, "tokens": c.tokens, "blocks": blocks.count()}),
            counts
        );
        if split == Split::Train {
            // Two empty documents and a null, each counted and skipped.
            assert_eq!((c.documents, c.empty), (33, 3));
        }
    }
}

/// The pass is kept by what decides it: the same data and tokenizer read it again (whatever the
/// block length or the loader threads), another tokenizer makes its own.
#[test]
fn a_split_is_tokenized_once_per_data_and_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    dataset(&dir);
    let cache = tmp.path().join("cache");
    let pass = |threads, options: &TextOptions| {
        let data = open(&dir, threads, &cache);
        let tokenizer = data.tokenizer(options).unwrap();
        data.tokenize(Split::Train, options, &tokenizer, &mut |_, _, _| {}).unwrap()
    };
    let first = pass(1, &text_options());
    assert!(first.made);
    assert_eq!(first.path.parent().unwrap(), cache.join("tokens"), "in the data cache");
    let again = pass(2, &text_options());
    assert!(!again.made);
    assert_eq!((again.path.clone(), again.counts), (first.path.clone(), first.counts));
    let other = TextOptions { eos: Some("<pad>".into()), ..text_options() };
    let third = pass(2, &other);
    assert!(third.made && third.path != first.path);
    assert_eq!(third.counts.tokens, first.counts.tokens);
}

#[test]
fn bad_text_input_is_one_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    dataset(&dir);
    let cache = tmp.path().join("cache");
    let data = open(&dir, 1, &cache);
    let err = |options: &TextOptions| data.tokenizer(options).unwrap_err().to_string();
    let local = |path: &Path| Some(TokenizerLocation::Local(path.into()));
    let missing = tmp.path().join("nowhere/tokenizer.json");
    assert_eq!(
        err(&TextOptions { tokenizer: local(&missing), ..text_options() }),
        format!("tokenizer {}: No such file or directory (os error 2)", missing.display())
    );
    let junk = tmp.path().join("junk.json");
    std::fs::write(&junk, "{\"not\": \"a tokenizer\"}").unwrap();
    assert!(err(&TextOptions { tokenizer: local(&junk), ..text_options() })
        .starts_with(&format!("tokenizer {}: not a Hugging Face tokenizer.json: ", junk.display())));
    assert_eq!(
        err(&TextOptions { eos: Some("<|im_end|>".into()), ..text_options() }),
        format!("--eos-token \"<|im_end|>\": tokenizer {}/tokenizer.json has no such token", dir.display())
    );
    let tokenizer = data.tokenizer(&text_options()).unwrap();
    let tokenize = |column: &str| {
        let options = TextOptions { column: column.into(), ..text_options() };
        data.tokenize(Split::Train, &options, &tokenizer, &mut |_, _, _| {}).unwrap_err().to_string()
    };
    let first = dir.join("train-00000-of-00002.parquet");
    assert_eq!(
        tokenize("content"),
        format!(
            "data file {}: no column `content` (the plugin reads it as text (a string column of documents)); the file \
             has: text (string), id (int64)",
            first.display()
        )
    );
    assert_eq!(
        tokenize("id"),
        format!(
            "data file {}: column `id`: expected text (a string column of documents), found int64",
            first.display()
        )
    );
    // Fewer tokens than one block.
    let tokens = data.tokenize(Split::Test, &text_options(), &tokenizer, &mut |_, _, _| {}).unwrap();
    let count = tokens.counts.tokens;
    let err = Blocks::new(tokens, 100_000, "input_ids", ("test", "DATA")).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "the test split of DATA has {count} token(s) in 4 document(s) (with their end-of-text tokens): fewer than \
             one block of 100000; give the model a shorter length or the split more text"
        )
    );
    // No tokenizer beside the data.
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let data = open(&dir, 1, &cache);
    assert_eq!(
        data.tokenizer(&text_options()).unwrap_err().to_string(),
        format!(
            "the model trains on raw text, and data location {} has no tokenizer.json beside its Parquet files: give \
             --tokenizer PATH or s3://bucket/key (the model's tokenizer.json) or put it there",
            dir.display()
        )
    );
}

/// Token streams count against the data cache's bound (`--data-cache-size`): with room for one
/// of two streams, writing the second evicts the one used least recently; a stream held (a run
/// reading its blocks) is never removed, and goes once let go if it is then the oldest.
#[test]
fn token_streams_are_evicted_least_recently_used_within_the_cache_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    dataset(&dir);
    let (gpt, pad) = (text_options(), TextOptions { eos: Some("<pad>".into()), ..text_options() });
    let pass = |options: &TextOptions, cache: (&Path, u64)| {
        let data = open_with(&dir, 1, cache, S3Options::default());
        let tokenizer = data.tokenizer(options).unwrap();
        data.tokenize(Split::Train, options, &tokenizer, &mut |_, _, _| {}).unwrap()
    };
    let on_disk = |path: &Path| {
        std::fs::metadata(path).unwrap().len() + std::fs::metadata(path.with_extension("json")).unwrap().len()
    };
    // Two streams of the same tokens (another end-of-text id): the bound holds one, not both.
    let sizing = tmp.path().join("sizing");
    let bound = on_disk(&pass(&gpt, (&sizing, 1 << 30)).path) + on_disk(&pass(&pad, (&sizing, 1 << 30)).path) - 1;
    let cache = (tmp.path().join("cache"), bound);
    let cache = (cache.0.as_path(), cache.1);
    let first = pass(&gpt, cache);
    let gpt_path = first.path.clone();
    drop(first);
    let second = pass(&pad, cache);
    let pad_path = second.path.clone();
    drop(second);
    assert!(!gpt_path.exists() && !gpt_path.with_extension("json").exists(), "the least recently used goes");
    assert!(pad_path.exists());
    let reading = Blocks::new(pass(&pad, cache), 4, "input_ids", ("train", "text")).unwrap();
    assert!(!reading.made);
    let again = pass(&gpt, cache);
    assert!(again.made, "tokenized again, having been evicted");
    assert!(pad_path.exists() && gpt_path.exists(), "both held: nothing removed");
    assert_eq!(reading.block(3).unwrap().len(), 4);
    drop(reading);
    drop(again);
    drop(open_with(&dir, 1, cache, S3Options::default()));
    assert!(!pad_path.exists(), "let go first, so used least recently");
    assert!(gpt_path.exists());
}

/// The suite's S3-compatible server, its credentials in the AWS variables that the data
/// crate's S3 client reads (as the daemon's is given them).
fn s3() -> &'static S3Server {
    static S3: OnceLock<S3Server> = OnceLock::new();
    S3.get_or_init(|| {
        std::env::set_var("AWS_ACCESS_KEY_ID", S3_KEY_ID);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", S3_SECRET);
        S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"))
    })
}

fn s3_options(server: &S3Server) -> S3Options {
    S3Options { endpoint: Some(server.endpoint.clone()), region: Some("us-east-1".into()), ..S3Options::default() }
}

fn upload(server: &S3Server, key: &str, bytes: Vec<u8>) {
    use object_store::ObjectStoreExt;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let to = object_store::path::Path::from(key);
    runtime.block_on(server.store().unwrap().put(&to, bytes.into())).unwrap();
}

/// The range entries of the data cache in `dir`: (path, bytes).
fn cached(dir: &Path) -> Vec<(PathBuf, u64)> {
    let subs = std::fs::read_dir(dir).unwrap().flatten().filter(|d| d.file_name().len() == 2);
    let files = subs.flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten());
    files
        .filter(|f| f.path().extension().is_some_and(|e| e == "bin"))
        .map(|f| (f.path(), f.metadata().unwrap().len()))
        .collect()
}

/// `--tokenizer s3://bucket/key`: the tokenizer loads as the same file on local disk does, with
/// the same sha256 (the identity every worker must agree on); it is kept in the data cache under
/// its ETag, once however often it is loaded, and a replaced object is fetched anew.
#[test]
fn a_tokenizer_on_s3_loads_by_url_as_from_a_file() {
    let server = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    dataset(&dir);
    let bytes = std::fs::read(dir.join("tokenizer.json")).unwrap();
    upload(server, "models/gpt/tokenizer.json", bytes.clone());
    let url = format!("s3://{}/models/gpt/tokenizer.json", server.bucket);
    let cache = tmp.path().join("cache");
    let data = open_with(&dir, 1, (&cache, 1 << 30), s3_options(server));
    let remote = TextOptions { tokenizer: Some(url.parse().unwrap()), ..text_options() };
    let (theirs, ours) = (data.tokenizer(&remote).unwrap(), data.tokenizer(&text_options()).unwrap());
    assert_eq!(theirs.location, url);
    assert_eq!((&theirs.sha256, &theirs.eos, theirs.vocab), (&ours.sha256, &ours.eos, ours.vocab));
    let entries = cached(&cache);
    assert_eq!(entries.iter().map(|e| e.1).collect::<Vec<_>>(), [bytes.len() as u64 + 4]);
    // Served from the cache while the object is unchanged: an entry doctored (same length, its
    // checksum made again) is what loads.
    let doctored = String::from_utf8(bytes.clone()).unwrap().replace("\"<pad>\"", "\"<PAD>\"").into_bytes();
    let entry = [&doctored[..], &crc32c::crc32c(&doctored).to_le_bytes()].concat();
    std::fs::write(&entries[0].0, entry).unwrap();
    let again = data.tokenizer(&TextOptions { eos: Some("<PAD>".into()), ..remote.clone() }).unwrap();
    assert_ne!(again.sha256, ours.sha256);
    std::fs::remove_file(&entries[0].0).unwrap();
    // Blocks of the same tokenizer are the same, wherever it was read from.
    let tokens = data.tokenize(Split::Test, &remote, &theirs, &mut |_, _, _| {}).unwrap();
    let local = data.tokenize(Split::Test, &text_options(), &ours, &mut |_, _, _| {}).unwrap();
    assert_eq!((tokens.path.clone(), tokens.made), (local.path.clone(), true));
    upload(server, "models/gpt/tokenizer.json", b"{\"not\": \"a tokenizer\"}".to_vec());
    let err = data.tokenizer(&remote).unwrap_err().to_string();
    assert!(err.starts_with(&format!("tokenizer {url}: not a Hugging Face tokenizer.json: ")), "{err}");
}

/// A key or bucket that is not there is one error naming the URL and saying so.
#[test]
fn a_tokenizer_missing_on_s3_is_one_error_naming_it() {
    let server = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    dataset(&dir);
    let data = open_with(&dir, 1, (&tmp.path().join("cache"), 1 << 30), s3_options(server));
    for url in
        [format!("s3://{}/models/none/tokenizer.json", server.bucket), "s3://no-such-bucket/tokenizer.json".into()]
    {
        let options = TextOptions { tokenizer: Some(url.parse().unwrap()), ..text_options() };
        assert_eq!(
            data.tokenizer(&options).unwrap_err().to_string(),
            format!("tokenizer {url}: no such object (check the bucket and the key)")
        );
    }
}
