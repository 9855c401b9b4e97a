//! TensorBoard event files, as Keras's `TensorBoard` callback lays them out: one writer under
//! `DIR/train` and one under `DIR/validation`, scalars tagged `epoch_loss`, `epoch_accuracy`...
//! at step = epoch (from 0), and `batch_loss` at step = global step.
//!
//! The format is TensorFlow's record file of `Event` protocol buffers (`tensorflow/core/util/
//! event.proto`, `summary.proto`): each record is its length (u64, little-endian), the masked
//! CRC-32C of the length, the bytes, and the masked CRC-32C of the bytes. The three messages
//! needed are declared here with prost (already in the workspace for the control plane);
//! tensorboard-rs, the one crate that writes them, has been unmaintained since 2022 and would pull
//! in protobuf 2 and an old image crate for nothing we use.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

/// `tensorflow.Event`, the fields a scalar needs.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

/// `tensorflow.Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    /// The first event of every file: `brain.Event:2`.
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `tensorflow.Summary.Value` with a `simple_value` (which TensorBoard reads as a scalar).
#[derive(Clone, PartialEq, prost::Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// CRC-32C as TensorFlow's record files mask it.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// One event file.
pub(crate) struct EventWriter {
    #[cfg_attr(not(test), allow(dead_code, reason = "read by the tests, which open the file"))]
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` (and its parents) and a new event file in it, named as TensorFlow names
    /// them (`events.out.tfevents.TIME.HOST.PID.N.v2`), so that a restarted process adds a file
    /// beside the old ones.
    pub(crate) fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let host = hostname();
        let (time, pid) = (now() as u64, std::process::id());
        let mut n = 0;
        let (path, file) = loop {
            let path = dir.join(format!("events.out.tfevents.{time}.{host}.{pid}.{n}.v2"));
            match File::options().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => n += 1,
                Err(e) => return Err(e),
            }
        };
        let mut writer = EventWriter { path, out: BufWriter::new(file) };
        writer.record(&Event { wall_time: now(), step: 0, what: Some(What::FileVersion("brain.Event:2".into())) })?;
        writer.out.flush()?;
        Ok(writer)
    }

    /// The file's path.
    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, event: &Event) -> std::io::Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(&data)?;
        self.out.write_all(&masked_crc(&data).to_le_bytes())
    }

    /// Writes scalars (tag, value) at `step`, and flushes them to the file.
    pub(crate) fn scalars(&mut self, step: u64, scalars: &[(String, f64)]) -> std::io::Result<()> {
        let value = scalars.iter().map(|(tag, v)| Value { tag: tag.clone(), simple_value: Some(*v as f32) }).collect();
        self.record(&Event { wall_time: now(), step: step as i64, what: Some(What::Summary(Summary { value })) })?;
        self.out.flush()
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into our buffer.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let name = if ok {
        String::from_utf8_lossy(buf.split(|&b| b == 0).next().unwrap_or(&[])).into_owned()
    } else {
        String::new()
    };
    // The name goes into a file name: keep it to characters that are safe there.
    let name: String = name.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')).collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// The chief's TensorBoard output: Keras's `train` and `validation` writers.
pub(crate) struct TensorBoard {
    dir: PathBuf,
    train: EventWriter,
    validation: EventWriter,
    /// Write the step loss every this many global steps (0: only per epoch).
    pub(crate) every: u64,
}

impl TensorBoard {
    /// Opens new event files under `dir/train` and `dir/validation`.
    pub(crate) fn create(dir: &Path, every: u64) -> std::io::Result<TensorBoard> {
        Ok(TensorBoard {
            dir: dir.to_path_buf(),
            train: EventWriter::create(&dir.join("train"))?,
            validation: EventWriter::create(&dir.join("validation"))?,
            every,
        })
    }

    /// The log directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// After global step `global_step`: `batch_loss` (and the step's metrics) every `every` steps.
    pub(crate) fn step(&mut self, global_step: u64, values: &[(String, f64)]) -> std::io::Result<()> {
        if self.every == 0 || !global_step.is_multiple_of(self.every) {
            return Ok(());
        }
        let scalars: Vec<(String, f64)> = values.iter().map(|(n, v)| (format!("batch_{n}"), *v)).collect();
        self.train.scalars(global_step, &scalars)
    }

    /// At the end of epoch `epoch` (from 0), after `global_step` steps: the epoch's training
    /// values (`epoch_loss`, `epoch_accuracy`..., with the learning rate and examples/s) under
    /// `train`; the evaluation's under `validation`, by epoch and, as Keras's
    /// `evaluation_loss_vs_iterations`, by global step.
    pub(crate) fn epoch(
        &mut self,
        (epoch, global_step): (u32, u64),
        train: &[(String, f64)],
        validation: &[(String, f64)],
    ) -> std::io::Result<()> {
        let tagged = |values: &[(String, f64)], f: &dyn Fn(&str) -> String| -> Vec<(String, f64)> {
            values.iter().map(|(n, v)| (f(n), *v)).collect()
        };
        self.train.scalars(u64::from(epoch), &tagged(train, &|n| format!("epoch_{n}")))?;
        if validation.is_empty() {
            return Ok(()); // a run that does not evaluate
        }
        self.validation.scalars(u64::from(epoch), &tagged(validation, &|n| format!("epoch_{n}")))?;
        self.validation.scalars(global_step, &tagged(validation, &|n| format!("evaluation_{n}_vs_iterations")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits a record file back into its records, checking every CRC.
    fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()), masked_crc(len_bytes));
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap()), masked_crc(data));
            out.push(data.to_vec());
            at += 16 + len;
        }
        out
    }

    #[test]
    fn masked_crc_matches_tensorflow() {
        // TensorFlow's crc32c tests: the CRC-32C of 32 zero bytes is 0x8a9136aa.
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        // Masked: rotated right by 15 bits, plus 0xa282ead8.
        assert_eq!(masked_crc(&[0u8; 32]), 0x0fd7_fffa);
    }

    #[test]
    fn a_file_holds_the_version_then_each_scalar() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoard::create(dir.path(), 10).unwrap();
        tb.step(5, &[("loss".into(), 1.0)]).unwrap();
        tb.step(10, &[("loss".into(), 0.5)]).unwrap();
        tb.epoch((0, 10), &[("loss".into(), 0.75)], &[("loss".into(), 0.8)]).unwrap();
        let events: Vec<Event> = records(&std::fs::read(tb.train.path()).unwrap())
            .iter()
            .map(|r| Event::decode(r.as_slice()).unwrap())
            .collect();
        assert_eq!(events[0].what, Some(What::FileVersion("brain.Event:2".into())));
        let scalars: Vec<(i64, String, Option<f32>)> = events[1..]
            .iter()
            .flat_map(|e| match &e.what {
                Some(What::Summary(s)) => s.value.iter().map(|v| (e.step, v.tag.clone(), v.simple_value)).collect(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(scalars, [(10, "batch_loss".into(), Some(0.5)), (0, "epoch_loss".into(), Some(0.75))]);
        assert!(tb.validation.path().starts_with(dir.path().join("validation")));
    }
}
