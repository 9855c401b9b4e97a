//! The `trainerd` command line: [`args`] is what clap parses, [`run`] trains, [`evaluate`]
//! evaluates a commit; `local`, `ckpt` and `plugin check` go to their modules of the crate. The
//! binary (`main.rs`) only calls [`main`].

pub mod args;
pub mod data;
pub mod evaluate;
pub mod local;
pub mod plugin_args;
pub mod run;

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};
use tch::Device;
use trainerd_storage::{CheckpointStore, Location};

use crate::ops::log::LogFormat;
use crate::plugin::Plugin;
use crate::sys::accel::{self, CudaLibrary, Facts};
use args::{CkptCommand, Cli, Command, DataCommand, PluginCommand, S3Args};

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
        Command::Local { workers, restart_delay, no_restart, events, args } => {
            Duration::try_from_secs_f64(restart_delay)
                .map_err(|_| anyhow::anyhow!("--restart-delay {restart_delay}: expected a number of seconds"))
                .and_then(|delay| crate::cli::local::run(workers, (delay, &no_restart), events.as_deref(), &args))
        }
        Command::Evaluate(args) => evaluate::evaluate(*args, cuda, cli.log_format),
        Command::Ckpt { command } => ckpt(command),
        Command::Data { command } => data(command),
        Command::Plugin { command: PluginCommand::Check { path, args, in_process } } => {
            args.parse().and_then(|args| plugin_check(&path, &args, in_process, cuda))
        }
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            match cli.log_format {
                LogFormat::Json => eprintln!("{}", serde_json::json!({"level": "error", "message": format!("{e:#}")})),
                LogFormat::Plain => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
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

/// `trainerd plugin check PATH`: in a child process (a plugin that crashes takes only the child),
/// or, in that child, here.
fn plugin_check(
    path: &std::path::Path,
    args: &trainerd_sdk::PluginArgs,
    in_process: bool,
    cuda: CudaLibrary,
) -> anyhow::Result<i32> {
    if !in_process {
        return crate::plugin::describe::check_in_child(path, args).context("running the plugin check");
    }
    let facts = accel::facts(cuda);
    let plugin = match Plugin::load(path, args) {
        Ok(plugin) => plugin,
        Err(refused @ crate::plugin::LoadError::Refused { .. }) => {
            let specs = Plugin::accepted(path)?;
            anyhow::bail!("{refused}\n{}", crate::plugin::describe::arguments(&specs, args));
        }
        Err(other) => return Err(other.into()),
    };
    let text = crate::plugin::describe::describe(&plugin, &facts)?;
    println!("{text}");
    Ok(0)
}

fn open_store(url: &str, s3: &S3Args) -> anyhow::Result<CheckpointStore> {
    let location: Location = url.parse()?;
    Ok(location.open(&s3.options())?)
}

/// `trainerd ckpt list|show|verify|export URL`.
fn ckpt(command: CkptCommand) -> anyhow::Result<i32> {
    match command {
        CkptCommand::List { url, s3 } => print!("{}", crate::checkpoint::inspect::list(&open_store(&url, &s3)?)?),
        CkptCommand::Show { url, sequence, s3 } => {
            print!("{}", crate::checkpoint::inspect::show(&open_store(&url, &s3)?, sequence)?)
        }
        CkptCommand::Verify { url, sequence, s3 } => {
            let ok = crate::checkpoint::inspect::verify(&open_store(&url, &s3)?, sequence, &mut std::io::stdout())?;
            if !ok {
                eprintln!("error: {url}: damaged commits (see above)");
                return Ok(crate::exit::Exit::Failed.code());
            }
        }
        CkptCommand::Export { url, output, sequence, s3 } => {
            let text = crate::checkpoint::inspect::export(&open_store(&url, &s3)?, sequence, &output)
                .map_err(anyhow::Error::msg)?;
            println!("{text}");
        }
    }
    Ok(0)
}

/// The data's wait bound checked below `collective` (the collective timeout): a worker waiting
/// for its data gives up before its peers waiting in a collective do.
fn data_wait_fits(data: &args::DataArgs, collective: Duration) -> anyhow::Result<()> {
    if seconds("--data-timeout", data.data_timeout)? >= collective {
        anyhow::bail!(
            "--data-timeout {}s must be less than --collective-timeout {}s: a worker waiting for its data must give up \
             before its peers waiting in a collective do",
            data.data_timeout,
            collective.as_secs_f64()
        );
    }
    Ok(())
}

/// How a columnar dataset is read, from the data flags and the S3 flags.
fn data_options(
    data: &args::DataArgs,
    s3: &S3Args,
    observer: Arc<dyn trainerd_data::Observer>,
) -> anyhow::Result<trainerd_data::Options> {
    let timeout = seconds("--data-timeout", data.data_timeout)?;
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

/// `trainerd data inspect|convert|read`.
fn data(command: DataCommand) -> anyhow::Result<i32> {
    match command {
        DataCommand::Inspect { url, s3 } => data::inspect(&url, &s3),
        DataCommand::Convert { from, to, rows_per_file, rows_per_group, s3 } => {
            anyhow::ensure!(
                rows_per_file > 0 && rows_per_group > 0,
                "--rows-per-file and --rows-per-group: expected at least 1"
            );
            data::convert(&from, &to, trainerd_data::convert::Sharding { rows_per_file, rows_per_group }, &s3)
        }
        DataCommand::Read(args) => data::read(&args),
    }
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
    facts.device(flag, local_rank).map_err(anyhow::Error::msg)
}
