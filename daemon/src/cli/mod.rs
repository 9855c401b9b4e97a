//! The `trainerd` command line: [`args`] is what clap parses, and each command has its file, as
//! mini-redis's `src/cmd/`: [`run`] trains, [`local`] runs a loopback cluster under the
//! supervisor, [`evaluate`] evaluates a commit, [`ckpt`] inspects a checkpoint location,
//! [`plugin`] checks a plugin, [`data`] inspects, converts and reads datasets. The binary
//! (`main.rs`) only calls [`main`]; what the commands share (signals, threads, devices, the data
//! options) is here.

pub(crate) mod args;
pub(crate) mod ckpt;
pub(crate) mod data;
pub(crate) mod evaluate;
pub(crate) mod local;
pub(crate) mod plugin;
pub(crate) mod predict;
pub(crate) mod run;

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches};
use tch::Device;

use crate::ops::log::LogFormat;
use crate::sys::accel::{self, Facts};
use args::{Cli, Command, S3Args};

/// Parses the command line, runs the command, and says how it ended.
pub fn main() -> ExitCode {
    pin_malloc_thresholds();
    let argv: Vec<String> = std::env::args().collect();
    // Before anything asks libtorch about CUDA (it caches the answer).
    let cuda = accel::load_cuda(asks_for_cuda(&argv));
    let mut command = Cli::command();
    if argv.iter().skip(1).any(|a| a == "--version" || a == "-V") {
        let facts = accel::facts(cuda.clone());
        let nccl = match crate::collective::nccl::library() {
            Ok(n) => format!(
                "NCCL {} (--collective nccl and auto can use it)",
                crate::collective::nccl::version_text(n.version())
            ),
            Err(why) => format!("NCCL not usable: {why}"),
        };
        let version = format!("{}\n{}\n{nccl}", env!("CARGO_PKG_VERSION"), facts.line());
        // Once per process, and clap wants a 'static string.
        command = command.version(&*Box::leak(version.into_boxed_str()));
    }
    let cli = match Cli::from_arg_matches(&command.get_matches_from(&argv)) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    crate::ops::log::init(cli.log_format);
    let result = match cli.command {
        Command::Run(args) => run::run(*args, cuda, cli.log_format),
        Command::Local(args) => local::run(args),
        Command::Evaluate(args) => evaluate::evaluate(*args, cuda, cli.log_format),
        Command::Predict(args) => predict::predict(*args, cuda, cli.log_format),
        Command::Ckpt { command } => ckpt::run(command),
        Command::Data { command } => data::run(command),
        Command::Plugin { command } => plugin::run(command, cuda),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            let message = told(&e);
            match cli.log_format {
                LogFormat::Json => eprintln!("{}", serde_json::json!({"level": "error", "message": message})),
                LogFormat::Plain => eprintln!("error: {message}"),
            }
            ExitCode::from(status_of(&e) as u8)
        }
    }
}

/// The exit status of a command that failed with `e`: [`Exit::ModelFailed`] when the model failed
/// in a step (every worker fails the same way: a supervisor must not restart it), else
/// [`Exit::Failed`].
pub(crate) fn status_of(e: &anyhow::Error) -> i32 {
    let in_step = |c: &(dyn std::error::Error + 'static)| {
        let call = match c.downcast_ref::<crate::train::TrainError>() {
            Some(crate::train::TrainError::Plugin(call)) => Some(call),
            _ => c.downcast_ref::<crate::plugin::CallError>(),
        };
        call.is_some_and(|call| call.call == "step")
    };
    if e.chain().any(in_step) {
        return crate::exit::Exit::ModelFailed.code();
    }
    crate::exit::Exit::Failed.code()
}

/// An error and each cause it does not already tell, `: `-separated. trainerd's errors, as
/// object_store's, say their source's text in their own and also keep the source: a cause
/// already in the text is not told twice.
fn told(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

/// Pins glibc malloc's mmap and trim thresholds (unless the operator set them with
/// `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_`). Left dynamic, they move with the
/// process's allocations: batches made on the input pipeline's threads and freed on the training
/// thread moved them so that every step's activations were mapped and faulted in afresh (seen:
/// 22 ms steps instead of 15 for the tutorials' CNN). 32 MiB is glibc's own ceiling for the
/// dynamic mmap threshold; 128 MiB of free heap top is kept before it is returned.
fn pin_malloc_thresholds() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |var: &str| std::env::var_os(var).is_some();
        if !set("MALLOC_MMAP_THRESHOLD_") && !set("MALLOC_TRIM_THRESHOLD_") {
            // SAFETY: mallopt before any thread is started; a refused setting leaves glibc's own.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 20);
            }
        }
    }
}

/// Whether the command line asks for a CUDA device (`--device cuda`, `--device=cuda:1`).
fn asks_for_cuda(args: &[String]) -> bool {
    args.iter().enumerate().any(|(i, a)| {
        let value = a.strip_prefix("--device=").or_else(|| (i > 0 && args[i - 1] == "--device").then_some(a.as_str()));
        value.is_some_and(|v| v == "cuda" || v.starts_with("cuda:"))
    })
}

/// Every timeout of a job, from the flags given (the others derived from them, so that the
/// hierarchy holds), checked as one hierarchy.
fn timeouts(job: &args::JobArgs, cluster: &args::TimeoutArgs) -> anyhow::Result<crate::cluster::Timeouts> {
    let given = |flag: &str, v: Option<f64>| v.map(|v| seconds(flag, v)).transpose();
    let replace_after = match cluster.replace_after {
        Some(0.0) => Some(Duration::ZERO),
        v => given("--replace-after", v)?,
    };
    let timeouts = crate::cluster::timeouts::Given {
        rendezvous: given("--rendezvous-timeout", job.rendezvous_timeout)?,
        heartbeat_interval: given("--heartbeat-interval", cluster.heartbeat_interval)?,
        heartbeat_deadline: given("--heartbeat-deadline", cluster.heartbeat_deadline)?,
        collective: given("--collective-timeout", cluster.collective_timeout)?,
        rejoin: given("--rejoin-deadline", cluster.rejoin_deadline)?,
        replace_after,
        data: given("--data-timeout", job.data.data_timeout)?,
    }
    .derive();
    timeouts.check()?;
    Ok(timeouts)
}

/// A tool's wait for a failing data source (no cluster: no collective timeout to stay under).
fn data_timeout(data: &args::DataArgs) -> anyhow::Result<Duration> {
    data.data_timeout.map_or(Ok(crate::cluster::Timeouts::default().data), |v| seconds("--data-timeout", v))
}

/// How a columnar dataset is read, from the data flags and the S3 flags, waiting at most
/// `timeout` for a failing source.
fn data_options(
    data: &args::DataArgs,
    s3: &S3Args,
    observer: Arc<dyn trainerd_data::Observer>,
    timeout: Duration,
) -> anyhow::Result<trainerd_data::Options> {
    if data.loader_threads == Some(0) {
        anyhow::bail!("--loader-threads 0: expected at least 1");
    }
    Ok(trainerd_data::Options {
        s3: s3.options(),
        timeout,
        cache: Some((data.cache_dir(), data.data_cache_size)),
        threads: data.loader_threads(),
        observer,
    })
}

/// A positive number of seconds from `flag`'s `value`.
fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("{flag} {value}: expected a positive number of seconds"))
}

/// A flag that SIGTERM or SIGINT raises (stop at the next safe point); a second signal ends the
/// process at once.
fn stop_flag() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&stop))?;
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }
    Ok(stop)
}

/// libtorch's thread counts from `--threads` (default: the available cores); the intra-op count.
fn set_threads(threads: Option<usize>) -> anyhow::Result<usize> {
    let threads = match threads {
        Some(0) => anyhow::bail!("--threads 0: expected at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    tch::set_num_threads(threads as i32);
    tch::set_num_interop_threads(1);
    Ok(threads)
}

/// The device `--device` names on this machine. A worker's place among the workers of its node,
/// as torchrun's LOCAL_RANK (`trainerd local` sets it), picks its GPU: `--device auto` is
/// cuda:(LOCAL_RANK mod GPUs).
fn device(flag: &str, facts: &Facts) -> anyhow::Result<Device> {
    let local_rank = std::env::var("LOCAL_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
    Ok(facts.device(flag, local_rank)?)
}

#[cfg(test)]
mod tests {
    use super::told;

    #[test]
    fn each_cause_is_told_once() {
        let write = crate::checkpoint::CheckpointError::Write {
            path: "/out/model.safetensors".into(),
            source: std::io::Error::other("No space left on device"),
        };
        let e = anyhow::Error::new(write).context("ckpt export");
        assert_eq!(told(&e), "ckpt export: writing /out/model.safetensors: No space left on device");
        let e = anyhow::anyhow!("permission denied").context("writing the summary to s.json");
        assert_eq!(told(&e), "writing the summary to s.json: permission denied");
    }
}
