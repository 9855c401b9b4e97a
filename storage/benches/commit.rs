//! Checkpoint commit throughput to a local directory (fsync'd file and directory, as training
//! commits), in the format of `../shared/bench/torch_save.py` so the two print side by side
//! (bench/checkpoint.py runs both, and dd).
//!
//! Usage: cargo bench -p trainerd-storage --bench commit -- SIZE_MiB RUNS DIR
//! Like torch_save.py: tensors of 4 MiB, `sync` before each run, the previous run's files
//! removed outside the timing.

use std::time::Instant;

use bytes::Bytes;
use trainerd_storage::{Blob, Dtype, Location, NewCheckpoint, S3Options, TensorData};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let [size, runs, dir] = args.as_slice() else {
        eprintln!("usage: commit SIZE_MiB RUNS DIR");
        std::process::exit(2);
    };
    let (size, runs): (usize, usize) = (size.parse().expect("SIZE_MiB"), runs.parse().expect("RUNS"));
    let tensors: Vec<TensorData> = (0..(size / 4).max(1))
        .map(|i| TensorData {
            name: format!("layer{i}.weight"),
            dtype: Dtype::F32,
            shape: vec![1 << 20],
            data: Bytes::from((0..4u32 << 20).map(|b| (b.wrapping_mul(2654435761) >> 24) as u8).collect::<Vec<u8>>()),
        })
        .collect();
    let checkpoint = NewCheckpoint {
        generation: 1,
        writer: 1,
        global_step: 1,
        epoch: 0,
        meta: serde_json::json!({}),
        blobs: vec![Blob { name: "model.safetensors".into(), tensors }],
        score: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for _ in 0..runs {
        let _ = std::fs::remove_dir_all(dir);
        // SAFETY: sync(2) has no preconditions.
        unsafe { libc::sync() };
        let store = Location::Local(dir.into()).open(&S3Options::default()).unwrap();
        let start = Instant::now();
        let record = rt.block_on(store.commit(&checkpoint, 0)).unwrap();
        let seconds = start.elapsed().as_secs_f64();
        println!(
            "trainerd_commit bytes={} seconds={seconds:.3} MBps={:.0}",
            record.bytes,
            record.bytes as f64 / seconds / 1e6
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
