//! The `trainerd` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use trainerd::accel::{self, CudaLibrary};
use trainerd::cluster::auth::ClusterKey;
use trainerd::cluster::{tf_config, ClusterConfig, Network, Timeouts};
use trainerd::collective::buckets::DEFAULT_BUCKET_BYTES;
use trainerd::config::{self, OptimizerFlags};
use trainerd::evaluate::EvalConfig;
use trainerd::ops::log::LogFormat;
use trainerd::ops::notify::{self, Notifier};
use trainerd::ops::serve::{self, Token};
use trainerd::ops::Telemetry;
use trainerd::plugin::Plugin;
use trainerd::progress::Progress;
use trainerd::train::{self, CheckpointConfig, Outcome, RunConfig};
use trainerd_sdk::LrSchedule;
use trainerd_storage::{CheckpointStore, Location, S3Options};

#[derive(Parser)]
#[command(name = "trainerd", version, about = "Fault-tolerant data-parallel training daemon")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log and progress lines: plain (coloured only on a terminal; syslog priorities in the
    /// journal) or json (one object per line).
    #[arg(long, global = true, value_enum, default_value = "plain", env = "TRAINERD_LOG_FORMAT")]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model plugin on a dataset: one worker, or a member of the TF_CONFIG cluster.
    Run(Box<RunArgs>),
    /// Start N workers on 127.0.0.1 as one cluster (each `trainerd run` with its own
    /// TF_CONFIG), prefix their output, restart any that dies (as systemd would), and stop them
    /// together on Ctrl-C.
    Local {
        /// Number of workers.
        #[arg(long)]
        workers: usize,
        /// Seconds before a worker that died is started again (systemd's RestartSec).
        #[arg(long, default_value_t = 1.0)]
        restart_delay: f64,
        /// Arguments for `trainerd run` (every flag of `run` except --tf-config).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Evaluate a committed checkpoint on the test split (as Keras's model.evaluate): alone, or
    /// sharded over the TF_CONFIG cluster.
    Evaluate(Box<EvalArgs>),
    /// Inspect a checkpoint location (a directory, file:///path, s3://bucket/prefix).
    Ckpt {
        #[command(subcommand)]
        command: CkptCommand,
    },
    /// Inspect plugins.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Load a plugin (in a child process) and print its identity, or why it is refused.
    Check {
        /// Path of the plugin's shared library.
        path: PathBuf,
        /// Load in this process (what the child runs).
        #[arg(long, hide = true)]
        in_process: bool,
    },
}

#[derive(Subcommand)]
enum CkptCommand {
    /// List commits: sequence, step, epoch, time, size, generation.
    List {
        /// Checkpoint location.
        url: String,
        #[command(flatten)]
        s3: S3Args,
    },
    /// Show a commit's record and manifest (default: the newest).
    Show {
        /// Checkpoint location.
        url: String,
        /// Commit sequence.
        #[arg(long)]
        sequence: Option<u64>,
        #[command(flatten)]
        s3: S3Args,
    },
    /// Verify every blob's sha256 of every commit (or one); exits non-zero on damage.
    Verify {
        /// Checkpoint location.
        url: String,
        /// Commit sequence.
        #[arg(long)]
        sequence: Option<u64>,
        #[command(flatten)]
        s3: S3Args,
    },
    /// Write a commit's parameters (default: the newest) as one safetensors file.
    Export {
        /// Checkpoint location.
        url: String,
        /// Output file.
        #[arg(long, short)]
        output: PathBuf,
        /// Commit sequence.
        #[arg(long)]
        sequence: Option<u64>,
        #[command(flatten)]
        s3: S3Args,
    },
}

/// S3 settings beyond the standard AWS variables.
#[derive(clap::Args, Clone, Default)]
struct S3Args {
    /// S3 endpoint URL (MinIO, SeaweedFS, R2...); default: AWS_ENDPOINT_URL or AWS.
    #[arg(long)]
    s3_endpoint: Option<String>,
    /// S3 region; default: AWS_REGION or us-east-1.
    #[arg(long)]
    s3_region: Option<String>,
    /// Allow plain http to the endpoint (always allowed on loopback).
    #[arg(long)]
    s3_allow_http: bool,
    /// Do not prove, before the first commit, that the server refuses a second create-if-absent
    /// write (commits rely on it; a warning says it was skipped).
    #[arg(long)]
    s3_skip_probe: bool,
}

impl S3Args {
    fn options(&self) -> S3Options {
        S3Options {
            endpoint: self.s3_endpoint.clone(),
            region: self.s3_region.clone(),
            allow_http: self.s3_allow_http,
            skip_probe: self.s3_skip_probe,
        }
    }
}

fn open_store(url: &str, s3: &S3Args) -> anyhow::Result<CheckpointStore> {
    let location: Location = url.parse()?;
    Ok(location.open(&s3.options())?)
}

fn ckpt(command: CkptCommand) -> anyhow::Result<i32> {
    match command {
        CkptCommand::List { url, s3 } => print!("{}", trainerd::ckpt::list(&open_store(&url, &s3)?)?),
        CkptCommand::Show { url, sequence, s3 } => {
            print!("{}", trainerd::ckpt::show(&open_store(&url, &s3)?, sequence)?)
        }
        CkptCommand::Verify { url, sequence, s3 } => {
            let ok = trainerd::ckpt::verify(&open_store(&url, &s3)?, sequence, &mut std::io::stdout())?;
            if !ok {
                eprintln!("error: {url}: damaged commits (see above)");
                return Ok(1);
            }
        }
        CkptCommand::Export { url, output, sequence, s3 } => {
            let text =
                trainerd::ckpt::export(&open_store(&url, &s3)?, sequence, &output).map_err(anyhow::Error::msg)?;
            println!("{text}");
        }
    }
    Ok(0)
}

#[derive(clap::Args)]
struct RunArgs {
    /// Path of the model plugin's shared library (.so).
    #[arg(long)]
    plugin: PathBuf,
    /// Dataset directory, handed to the plugin.
    #[arg(long)]
    data: PathBuf,
    /// Epochs (default: the plugin's).
    #[arg(long)]
    epochs: Option<u32>,
    /// Per-worker batch size (default: the plugin's).
    #[arg(long)]
    batch_size: Option<u32>,
    /// Optimizer: sgd, adam or rmsprop (default: the plugin's).
    #[arg(long)]
    optimizer: Option<String>,
    /// Learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Momentum (sgd, rmsprop).
    #[arg(long)]
    momentum: Option<f64>,
    /// L2 weight decay.
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Nesterov momentum (sgd).
    #[arg(long)]
    nesterov: bool,
    /// Learning-rate schedule: constant, cosine[:MIN_LR], step:EVERY:GAMMA or exp:GAMMA.
    #[arg(long, value_parser = trainerd::schedule::parse)]
    lr_schedule: Option<LrSchedule>,
    /// Seed of initialisation and data order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// libtorch threads (fixed, so results are reproducible; default: available cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Stop each epoch after this many steps.
    #[arg(long)]
    steps_per_epoch: Option<u64>,
    /// Write the run's summary as JSON to this file.
    #[arg(long)]
    summary: Option<PathBuf>,
    /// Write one JSON line per step (global loss, metrics, learning rate) to this file.
    #[arg(long)]
    metrics_log: Option<PathBuf>,
    /// Write TensorBoard event files here (on the chief), as Keras's TensorBoard callback lays
    /// them out: DIR/train and DIR/validation.
    #[arg(long)]
    tensorboard_dir: Option<PathBuf>,
    /// Write the step loss to TensorBoard every N global steps (0: per epoch only).
    #[arg(long, default_value_t = 100)]
    tensorboard_every: u64,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Serve Prometheus metrics (`/metrics`) and `/healthz` on this address (e.g.
    /// 127.0.0.1:9400; port 0 picks one). An address other than loopback needs
    /// --metrics-token-file (or --insecure).
    #[arg(long, env = "TRAINERD_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// A file holding the bearer token `/metrics` requires (Prometheus's
    /// `authorization.credentials_file`).
    #[arg(long, env = "TRAINERD_METRICS_TOKEN_FILE")]
    metrics_token_file: Option<PathBuf>,
    /// Seconds without training progress after which the daemon counts as hung (`/healthz`
    /// fails, systemd's watchdog pings stop); default: systemd's WatchdogSec, else 120.
    #[arg(long)]
    stall_timeout: Option<f64>,
    /// Seconds to wait for every worker to join at the start.
    #[arg(long, default_value_t = 300.0)]
    rendezvous_timeout: f64,
    /// Seconds between heartbeats to the chief.
    #[arg(long, default_value_t = 0.1)]
    heartbeat_interval: f64,
    /// Seconds without a heartbeat after which a worker (or the chief) counts as failed.
    #[arg(long, default_value_t = 1.5)]
    heartbeat_deadline: f64,
    /// Seconds a socket may carry no bytes before its collective fails (a backstop: failures
    /// are normally detected by the heartbeats and pushed notices first).
    #[arg(long, default_value_t = 120.0)]
    collective_timeout: f64,
    /// Seconds the survivors wait for a lost worker to return before they exit non-zero (so
    /// that their supervisor restarts them); long enough for a node to reboot.
    #[arg(long, default_value_t = 600.0)]
    rejoin_deadline: f64,
    /// Commit checkpoints here (a directory, file:///path, s3://bucket/prefix) and resume from
    /// the newest one at start.
    #[arg(long)]
    checkpoint_dir: Option<String>,
    /// Commit every N steps, as well as at each epoch's end.
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Keep the newest K commits (0: all).
    #[arg(long, default_value_t = 3)]
    keep_checkpoints: usize,
    #[command(flatten)]
    s3: S3Args,
}

#[derive(clap::Args)]
struct EvalArgs {
    /// Checkpoint location (a directory, file:///path, s3://bucket/prefix).
    #[arg(long)]
    checkpoint: String,
    /// The commit to evaluate (default: the newest that verifies).
    #[arg(long)]
    sequence: Option<u64>,
    /// Path of the model plugin's shared library (.so).
    #[arg(long)]
    plugin: PathBuf,
    /// Dataset directory, handed to the plugin.
    #[arg(long)]
    data: PathBuf,
    /// Per-worker batch size (default: the plugin's).
    #[arg(long)]
    batch_size: Option<u32>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// libtorch threads (default: available cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Write the result as JSON to this file.
    #[arg(long)]
    summary: Option<PathBuf>,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Seconds to wait for every worker to join.
    #[arg(long, default_value_t = 300.0)]
    rendezvous_timeout: f64,
    #[command(flatten)]
    s3: S3Args,
}

/// The cluster flags `run` and `evaluate` share.
#[derive(clap::Args)]
struct ClusterArgs {
    /// The cluster, as TensorFlow's TF_CONFIG JSON or @FILE (default: the TF_CONFIG variable;
    /// none means one worker).
    #[arg(long)]
    tf_config: Option<String>,
    /// The cluster secret: a file (the same on every node, readable only by trainerd's user)
    /// whose contents every control-plane and data-plane connection proves it knows. Needed
    /// when TF_CONFIG has a non-loopback address.
    #[arg(long, env = "TRAINERD_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    /// Run a cluster across hosts without a secret: anyone who can reach its ports can join it.
    #[arg(long)]
    insecure: bool,
    /// The address the control plane and the data listener bind (default: every interface for a
    /// cluster across hosts, the TF_CONFIG address for a loopback one).
    #[arg(long, env = "TRAINERD_LISTEN")]
    listen: Option<std::net::IpAddr>,
}

impl ClusterArgs {
    /// The cluster and how its members reach each other.
    fn plan(&self) -> anyhow::Result<(Option<ClusterConfig>, Network)> {
        let cluster = cluster(self.tf_config.as_deref())?;
        let key = self.secret_file.as_deref().map(ClusterKey::load).transpose()?;
        let network = match &cluster {
            Some(c) => Network::plan(c, self.listen, key, self.insecure).map_err(anyhow::Error::msg)?,
            None => Network::loopback(),
        };
        if cluster.is_some() && network.key.is_none() && self.insecure {
            tracing::warn!("--insecure: the cluster's ports accept anyone who can reach them");
        }
        Ok((cluster, network))
    }
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

/// Whether the command line asks for a CUDA device (`--device cuda`, `--device=cuda:1`).
fn asks_for_cuda(args: &[String]) -> bool {
    args.iter().enumerate().any(|(i, a)| {
        let value = a.strip_prefix("--device=").or_else(|| (i > 0 && args[i - 1] == "--device").then_some(a.as_str()));
        value.is_some_and(|v| v == "cuda" || v.starts_with("cuda:"))
    })
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    // Before anything asks libtorch about CUDA (it caches the answer).
    let cuda = accel::load_cuda(asks_for_cuda(&argv));
    let mut command = Cli::command();
    if argv.iter().skip(1).any(|a| a == "--version" || a == "-V") {
        let facts = accel::facts(cuda.clone());
        let version = format!("{}\n{}", env!("CARGO_PKG_VERSION"), facts.line());
        // Once per process, and clap wants a 'static string.
        command = command.version(&*Box::leak(version.into_boxed_str()));
    }
    let cli = match Cli::from_arg_matches(&command.get_matches_from(&argv)) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    trainerd::ops::log::init(cli.log_format);
    let result = match cli.command {
        Command::Run(args) => run(*args, cuda, cli.log_format),
        Command::Local { workers, restart_delay, args } => Duration::try_from_secs_f64(restart_delay)
            .map_err(|_| anyhow::anyhow!("--restart-delay {restart_delay}: expected a number of seconds"))
            .and_then(|delay| trainerd::local::run(workers, delay, &args)),
        Command::Evaluate(args) => evaluate(*args, cuda, cli.log_format),
        Command::Ckpt { command } => ckpt(command),
        Command::Plugin { command: PluginCommand::Check { path, in_process } } => {
            if in_process {
                let facts = accel::facts(cuda);
                Plugin::load(&path)
                    .map_err(anyhow::Error::from)
                    .and_then(|p| Ok(trainerd::check::describe(&p, &facts)?))
                    .map(|text| {
                        println!("{text}");
                        0
                    })
            } else {
                trainerd::check::check_in_child(&path).context("running the plugin check")
            }
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

/// The cluster from `--tf-config` (JSON or @FILE) or the TF_CONFIG variable.
fn cluster(flag: Option<&str>) -> anyhow::Result<Option<ClusterConfig>> {
    let (text, source) = match flag {
        Some(f) => match f.strip_prefix('@') {
            Some(file) => (
                std::fs::read_to_string(file).with_context(|| format!("--tf-config {f}: cannot read {file}"))?,
                format!("--tf-config {f}"),
            ),
            None => (f.to_string(), "--tf-config".to_string()),
        },
        None => (std::env::var("TF_CONFIG").unwrap_or_default(), "TF_CONFIG".to_string()),
    };
    Ok(tf_config::parse(&text, &source)?)
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("{flag} {value}: expected a positive number of seconds"))
}

/// Exit status of a run that finished but whose final checkpoint failed to commit: restarting it
/// cannot help (the other workers are done), so the systemd unit does not.
const EXIT_FINISHED_UNCOMMITTED: i32 = 3;

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

fn run(args: RunArgs, cuda: CudaLibrary, log_format: LogFormat) -> anyhow::Result<i32> {
    // SIGTERM or SIGINT: stop at the next step boundary after the cluster's commit; a second one
    // ends the process at once.
    let stop = stop_flag()?;
    let timeouts = Timeouts {
        rendezvous: seconds("--rendezvous-timeout", args.rendezvous_timeout)?,
        heartbeat_interval: seconds("--heartbeat-interval", args.heartbeat_interval)?,
        heartbeat_deadline: seconds("--heartbeat-deadline", args.heartbeat_deadline)?,
        collective: seconds("--collective-timeout", args.collective_timeout)?,
        rejoin: seconds("--rejoin-deadline", args.rejoin_deadline)?,
    };
    timeouts.check().map_err(anyhow::Error::msg)?;
    let (cluster, network) = args.cluster.plan()?;
    let facts = accel::facts(cuda);
    // A worker's place among the workers of its node, as torchrun's LOCAL_RANK (`trainerd local`
    // sets it): `--device auto` is cuda:(LOCAL_RANK mod GPUs).
    let local_rank = std::env::var("LOCAL_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
    let device = facts.device(&args.device, local_rank).map_err(anyhow::Error::msg)?;
    if device.is_cuda() {
        for missing in accel::make_deterministic() {
            tracing::warn!("this libtorch has no switch for {missing}; results on CUDA may not be reproducible");
        }
    }
    let threads = set_threads(args.threads)?;

    let token = args.metrics_token_file.as_deref().map(Token::load).transpose().map_err(anyhow::Error::msg)?;
    if let Some(addr) = args.metrics_addr.filter(|a| !a.ip().is_loopback() && token.is_none() && !args.cluster.insecure)
    {
        anyhow::bail!(
            "--metrics-addr {addr} is not a loopback address: give --metrics-token-file so that only your \
             Prometheus can read the metrics, or pass --insecure"
        );
    }
    let plugin = Plugin::load(&args.plugin)?;
    let defaults = plugin.info().defaults.clone();
    let flags = OptimizerFlags {
        name: args.optimizer,
        lr: args.lr,
        momentum: args.momentum,
        weight_decay: args.weight_decay,
        nesterov: args.nesterov,
    };
    let cfg = RunConfig {
        data_dir: args.data,
        epochs: args.epochs.unwrap_or(defaults.epochs),
        batch_size: args.batch_size.unwrap_or(defaults.batch_size),
        optimizer: config::optimizer(&defaults.optimizer, &flags).map_err(anyhow::Error::msg)?,
        schedule: args.lr_schedule.unwrap_or(defaults.schedule),
        seed: args.seed,
        device,
        steps_per_epoch: args.steps_per_epoch,
        threads,
        cluster: cluster.clone(),
        network,
        timeouts,
        bucket_bytes: DEFAULT_BUCKET_BYTES,
        metrics_log: args.metrics_log,
        tensorboard_dir: args.tensorboard_dir,
        tensorboard_every: args.tensorboard_every,
        checkpoint: match &args.checkpoint_dir {
            None if args.checkpoint_every > 0 => anyhow::bail!("--checkpoint-every needs --checkpoint-dir"),
            None => None,
            Some(url) => Some(CheckpointConfig {
                location: url.parse()?,
                s3: args.s3.options(),
                every: args.checkpoint_every,
                keep: args.keep_checkpoints,
            }),
        },
    };
    if cfg.batch_size == 0 {
        anyhow::bail!("--batch-size 0: expected at least 1");
    }
    let info = plugin.info();
    let (rank, workers) = cluster.as_ref().map_or((0, 1), |c| (c.rank, c.world_size()));
    let who = cluster.as_ref().map_or("one worker".to_string(), |c| format!("{} of {workers} workers", c.me()));
    let progress = Progress::stdout(log_format);
    let mut progress = if rank == 0 { progress } else { progress.without_step_lines() };
    progress.line(&format!(
        "trainerd: {} {} on {} with {threads} thread(s); {who}, batch {} per worker, {} epoch(s), optimizer {} lr {}, seed {}",
        info.name,
        info.version,
        facts.describe(cfg.device),
        cfg.batch_size,
        cfg.epochs,
        cfg.optimizer.name(),
        cfg.optimizer.lr(),
        cfg.seed
    ));
    progress.line(&format!("trainerd: {}", facts.line()));
    let stall = match args.stall_timeout {
        Some(s) => seconds("--stall-timeout", s)?,
        None => notify::watchdog_period().unwrap_or(Duration::from_secs(120)),
    };
    let telemetry = Arc::new(Telemetry::new(stall, cfg.epochs, workers));
    if let Some(addr) = args.metrics_addr {
        let bound = serve::start(addr, Arc::clone(&telemetry), token).map_err(anyhow::Error::msg)?;
        progress.line(&format!("trainerd: metrics on http://{bound}/metrics, health on http://{bound}/healthz"));
    }
    let notifier = Notifier::start(Arc::clone(&telemetry), Arc::clone(&stop));
    let outcome = train::run(&plugin, &cfg, &mut progress, &stop, &telemetry);
    // STOPPING=1 before the last lines: the run is over, however it ended.
    telemetry.set_stopping();
    if let Some(n) = notifier {
        n.finish();
    }
    let summary = match outcome? {
        Outcome::Finished(summary) => summary,
        Outcome::Stopped { step, saved } => {
            progress.line(&format!("trainerd: stopped by signal at global step {step}; the state is {saved}"));
            return Ok(0);
        }
    };
    progress.line(&format!(
        "done: {} steps, test loss {:.4}{}, {:.0} examples/s, params sha256 {}",
        summary.steps,
        summary.test_loss,
        summary.test_accuracy.map(|a| format!(", test accuracy {a:.4}")).unwrap_or_default(),
        summary.examples_per_second,
        summary.params_sha256
    ));
    if let Some(path) = &args.summary {
        summary.write(path).with_context(|| format!("writing the summary to {}", path.display()))?;
    }
    if let Some(e) = &summary.checkpoint_error {
        progress.line(&format!("error: training finished, but its last checkpoint was not committed: {e}"));
        return Ok(EXIT_FINISHED_UNCOMMITTED);
    }
    Ok(0)
}

fn evaluate(args: EvalArgs, cuda: CudaLibrary, log_format: LogFormat) -> anyhow::Result<i32> {
    let stop = stop_flag()?;
    let timeouts =
        Timeouts { rendezvous: seconds("--rendezvous-timeout", args.rendezvous_timeout)?, ..Timeouts::default() };
    let (cluster, network) = args.cluster.plan()?;
    let facts = accel::facts(cuda);
    let local_rank = std::env::var("LOCAL_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
    let device = facts.device(&args.device, local_rank).map_err(anyhow::Error::msg)?;
    let threads = set_threads(args.threads)?;
    let plugin = Plugin::load(&args.plugin)?;
    let cfg = EvalConfig {
        data_dir: args.data,
        location: args.checkpoint.parse()?,
        s3: args.s3.options(),
        sequence: args.sequence,
        batch_size: args.batch_size.unwrap_or(plugin.info().defaults.batch_size),
        device,
        threads,
        cluster,
        network,
        timeouts,
    };
    if cfg.batch_size == 0 {
        anyhow::bail!("--batch-size 0: expected at least 1");
    }
    let mut progress = Progress::stdout(log_format);
    let result = trainerd::evaluate::run(&plugin, &cfg, &mut progress, &stop)?;
    progress.line(&format!(
        "evaluated checkpoint {} ({} test examples on {} worker(s)): test loss {:.4}{}, params sha256 {}",
        result.sequence,
        result.examples,
        result.workers,
        result.test_loss,
        result.test_accuracy.map(|a| format!(", test accuracy {a:.4}")).unwrap_or_default(),
        result.params_sha256
    ));
    if let Some(path) = &args.summary {
        let json = serde_json::to_string_pretty(&result)? + "\n";
        trainerd::atomic::write_file(path, &[json.as_bytes()])
            .with_context(|| format!("writing the summary to {}", path.display()))?;
    }
    Ok(0)
}
