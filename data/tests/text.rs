//! Raw text packed into blocks, against a short Python reference of the packing rule that uses
//! Hugging Face's `tokenizers` (plugins/python-model/examples/pack.py): block for block, with
//! empty and null documents, several files and row groups; the pass kept and read again; and
//! every bad input named.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use trainerd_data::text::{Blocks, TextOptions};
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

fn open(dir: &Path, threads: usize) -> Dataset {
    let options = Options {
        s3: S3Options::default(),
        timeout: Duration::from_secs(5),
        cache: None,
        threads,
        observer: Arc::new(Quiet),
    };
    Dataset::open(&DataLocation::Local(dir.into()), options).unwrap()
}

fn text_options(cache: &Path) -> TextOptions {
    TextOptions { tokenizer: None, column: "text".into(), eos: None, cache: cache.into() }
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
    let cache = tmp.path().join("tokens");
    for (split, name, length) in [(Split::Train, "train", 16), (Split::Train, "train", 7), (Split::Test, "test", 5)] {
        let data = open(&dir, 1);
        let tokenizer = data.tokenizer(&text_options(&cache)).unwrap();
        assert_eq!(tokenizer.eos, ("<|endoftext|>".to_string(), 1));
        let tokens = data.tokenize(split, &text_options(&cache), &tokenizer, &mut |_, _, _| {}).unwrap();
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
    let cache = tmp.path().join("tokens");
    let pass = |threads, options: &TextOptions| {
        let data = open(&dir, threads);
        let tokenizer = data.tokenizer(options).unwrap();
        data.tokenize(Split::Train, options, &tokenizer, &mut |_, _, _| {}).unwrap()
    };
    let first = pass(1, &text_options(&cache));
    assert!(first.made);
    let again = pass(2, &text_options(&cache));
    assert!(!again.made);
    assert_eq!((again.path.clone(), again.counts), (first.path.clone(), first.counts));
    let other = TextOptions { eos: Some("<pad>".into()), ..text_options(&cache) };
    let third = pass(2, &other);
    assert!(third.made && third.path != first.path);
    assert_eq!(third.counts.tokens, first.counts.tokens);
}

#[test]
fn bad_text_input_is_one_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    dataset(&dir);
    let cache = tmp.path().join("tokens");
    let data = open(&dir, 1);
    let err = |options: &TextOptions| data.tokenizer(options).unwrap_err().to_string();
    let missing = tmp.path().join("nowhere/tokenizer.json");
    assert_eq!(
        err(&TextOptions { tokenizer: Some(missing.clone()), ..text_options(&cache) }),
        format!("tokenizer {}: No such file or directory (os error 2)", missing.display())
    );
    let junk = tmp.path().join("junk.json");
    std::fs::write(&junk, "{\"not\": \"a tokenizer\"}").unwrap();
    assert!(err(&TextOptions { tokenizer: Some(junk.clone()), ..text_options(&cache) })
        .starts_with(&format!("tokenizer {}: not a Hugging Face tokenizer.json: ", junk.display())));
    assert_eq!(
        err(&TextOptions { eos: Some("<|im_end|>".into()), ..text_options(&cache) }),
        format!("--eos-token \"<|im_end|>\": tokenizer {}/tokenizer.json has no such token", dir.display())
    );
    let tokenizer = data.tokenizer(&text_options(&cache)).unwrap();
    let tokenize = |column: &str| {
        let options = TextOptions { column: column.into(), ..text_options(&cache) };
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
    let tokens = data.tokenize(Split::Test, &text_options(&cache), &tokenizer, &mut |_, _, _| {}).unwrap();
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
    let data = open(&dir, 1);
    assert_eq!(
        data.tokenizer(&text_options(&cache)).unwrap_err().to_string(),
        format!(
            "the model trains on raw text, and data location {} has no tokenizer.json beside its Parquet files: give \
             --tokenizer PATH (the model's tokenizer.json) or put it there",
            dir.display()
        )
    );
}
