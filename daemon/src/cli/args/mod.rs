//! The command line's arguments, as clap parses them; what each command does is in its own
//! module of [`super`].

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use trainerd_sdk::PluginArgs;
use trainerd_storage::S3Options;

use crate::auth::ClusterKey;
use crate::cluster::{tf_config, ClusterConfig, Network};
use crate::ops::log::LogFormat;

mod data;
mod optim;

pub(crate) use data::{DataArgs, DataCommand, InspectText, ReadArgs};
pub(crate) use optim::OptimArgs;

/// The command line.
#[derive(Parser)]
#[command(name = "trainerd", version, about = "Fault-tolerant data-parallel training daemon")]
pub(crate) struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Log and progress lines: plain (coloured only on a terminal; syslog priorities in the
    /// journal) or json (one object per line).
    #[arg(long, global = true, value_enum, default_value = "plain", env = "TRAINERD_LOG_FORMAT")]
    pub(crate) log_format: LogFormat,
}

/// The commands.
#[derive(Subcommand)]
pub(crate) enum Command {
    /// Train a model plugin on a dataset: one worker, or a member of the TF_CONFIG cluster.
    Run(Box<RunArgs>),
    /// Start N workers on 127.0.0.1 as one cluster (each `trainerd run` with its own
    /// TF_CONFIG), prefix their output, restart any that dies (as systemd would), and stop them
    /// together on Ctrl-C.
    Local(LocalArgs),
    /// Evaluate a committed checkpoint on the test split (as Keras's model.evaluate): alone, or
    /// sharded over the TF_CONFIG cluster.
    Evaluate(Box<EvalArgs>),
    /// Write a committed checkpoint's outputs for every example of a split to Parquet (as Keras's
    /// model.predict): alone, or sharded over the TF_CONFIG cluster.
    Predict(Box<PredictArgs>),
    /// Inspect a checkpoint location (a directory, file:///path, s3://bucket/prefix).
    Ckpt {
        /// What to do.
        #[command(subcommand)]
        command: CkptCommand,
    },
    /// Datasets: inspect one, convert an MNIST-format directory to Parquet, read one through the
    /// input pipeline alone.
    Data {
        /// What to do.
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Inspect plugins.
    Plugin {
        /// What to do.
        #[command(subcommand)]
        command: PluginCommand,
    },
}

/// `trainerd local`'s flags.
#[derive(clap::Args)]
pub(crate) struct LocalArgs {
    /// Number of workers.
    #[arg(long)]
    pub(crate) workers: usize,
    /// Seconds before a worker that died is started again (systemd's RestartSec).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) restart_delay: f64,
    /// Workers not to restart when they die (a node gone for good), for example
    /// `--no-restart 2`: the others go on without them after `--replace-after`, when a
    /// majority remains.
    #[arg(long, value_delimiter = ',')]
    pub(crate) no_restart: Vec<usize>,
    /// Write every worker's lifecycle events here, each naming its worker (give it before
    /// the arguments for `trainerd run`).
    #[arg(long, env = "TRAINERD_EVENTS")]
    pub(crate) events: Option<PathBuf>,
    /// Arguments for `trainerd run` (every flag of `run` except --tf-config and --events).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub(crate) args: Vec<String>,
}

/// `trainerd plugin ...`.
#[derive(Subcommand)]
pub(crate) enum PluginCommand {
    /// Load a plugin (in a child process) and print its identity, or why it is refused.
    Check {
        /// Path of the plugin's shared library.
        path: PathBuf,
        /// The plugin's arguments.
        #[command(flatten)]
        args: PluginArgFlags,
        /// Load in this process (what the child runs).
        #[arg(long, hide = true)]
        in_process: bool,
    },
}

/// `trainerd ckpt ...`.
#[derive(Subcommand)]
pub(crate) enum CkptCommand {
    /// List commits: sequence, step, epoch, time, size, generation.
    List {
        /// Checkpoint location.
        url: String,
        /// S3 settings.
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
        /// S3 settings.
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
        /// S3 settings.
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
        /// S3 settings.
        #[command(flatten)]
        s3: S3Args,
    },
}

/// S3 settings beyond the standard AWS variables.
#[derive(clap::Args, Clone, Default)]
pub(crate) struct S3Args {
    /// S3 endpoint URL (MinIO, SeaweedFS, R2...); default: AWS_ENDPOINT_URL or AWS.
    #[arg(long)]
    pub(crate) s3_endpoint: Option<String>,
    /// S3 region; default: AWS_REGION or us-east-1.
    #[arg(long)]
    pub(crate) s3_region: Option<String>,
    /// Allow plain http to the endpoint (always allowed on loopback).
    #[arg(long)]
    pub(crate) s3_allow_http: bool,
    /// Do not prove, before the first commit, that the server refuses a second create-if-absent
    /// write (commits rely on it; a warning says it was skipped).
    #[arg(long)]
    pub(crate) s3_skip_probe: bool,
}

impl S3Args {
    /// The options the storage crate takes.
    pub(crate) fn options(&self) -> S3Options {
        S3Options {
            endpoint: self.s3_endpoint.clone(),
            region: self.s3_region.clone(),
            allow_http: self.s3_allow_http,
            skip_probe: self.s3_skip_probe,
        }
    }
}

/// `trainerd run`'s flags.
#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// The flags `run` and `evaluate` share.
    #[command(flatten)]
    pub(crate) job: JobArgs,
    /// Rows of a Parquet dataset shuffled together in training: row groups are shuffled, then
    /// each window of this many rows; a window of at least the split's rows shuffles it
    /// uniformly. Part of the run configuration. Memory: about two windows' worth of each
    /// worker's share of the rows, still encoded.
    #[arg(long, default_value_t = 65536)]
    pub(crate) shuffle_window: u64,
    /// Train without evaluating after each epoch (a dataset with no test or validation split):
    /// the epoch lines show training figures only. Part of the run configuration.
    #[arg(long)]
    pub(crate) no_evaluation: bool,
    /// Append every step's example ids (file index in sorted order, row) to this file, one JSON
    /// line per step (a Parquet dataset only): a debug mode for comparing runs' data.
    #[arg(long, env = "TRAINERD_LOG_EXAMPLES")]
    pub(crate) log_examples: Option<PathBuf>,
    /// Epochs (default: the plugin's).
    #[arg(long)]
    pub(crate) epochs: Option<u32>,
    /// The optimizer and the learning rate's schedule.
    #[command(flatten)]
    pub(crate) optim: OptimArgs,
    /// Clip the averaged gradient to this global 2-norm before each update (Keras's
    /// global_clipnorm, PyTorch's clip_grad_norm_); the norm is in the metrics as grad_norm.
    #[arg(long, value_parser = |t: &str| crate::optim::clip::Clip::parse("--clip-norm", t))]
    pub(crate) clip_norm: Option<f64>,
    /// Clamp every element of the averaged gradient to [-V, V] before each update (Keras's
    /// clipvalue, PyTorch's clip_grad_value_), after --clip-norm when both are given.
    #[arg(long, value_parser = |t: &str| crate::optim::clip::Clip::parse("--clip-value", t))]
    pub(crate) clip_value: Option<f64>,
    /// Shard the training state over the workers, bit for bit the unsharded run: `optimizer`
    /// (ZeRO stage 1: each keeps and updates the optimizer state of the gradient ranges it
    /// reduces, with a buddy copy of the previous worker's, and the parameters are gathered after
    /// the update) or `gradients` (ZeRO stage 2: also each gradient let go once its bucket is
    /// reduced, only the ranges it owns kept). A lost worker costs no step; a worker lost with
    /// its buddy sends the cluster back to the last commit (CPU and the ring only, so far).
    #[arg(long, value_enum, value_name = "LEVEL")]
    pub(crate) shard: Option<Shard>,
    /// The same as --shard optimizer.
    #[arg(long, conflicts_with = "shard")]
    pub(crate) shard_optimizer: bool,
    /// Stop when an epoch-end figure (val_loss, val_accuracy, loss, ...) has not improved by more
    /// than MIN_DELTA for PATIENCE epochs, as Keras's EarlyStopping: METRIC:PATIENCE[:MIN_DELTA].
    #[arg(long, value_name = "METRIC:PATIENCE[:MIN_DELTA]")]
    pub(crate) early_stopping: Option<String>,
    /// Multiply the learning rate by FACTOR when an epoch-end figure has not improved for
    /// PATIENCE epochs, as Keras's ReduceLROnPlateau: METRIC:FACTOR:PATIENCE.
    #[arg(long, value_name = "METRIC:FACTOR:PATIENCE")]
    pub(crate) reduce_lr_on_plateau: Option<String>,
    /// Seed of initialisation and data order.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// One replica per device in this daemon, as TensorFlow's MirroredStrategy: all (every GPU
    /// visible) or a list such as cuda:0,cuda:1 (cpu,cpu: replicas on the CPU). Each replica is a
    /// slot of the run with its own batch of --batch-size; the daemon is still one worker.
    #[arg(long, conflicts_with = "device")]
    pub(crate) devices: Option<String>,
    /// Gradient accumulation: each update sums N micro-batches of --batch-size per replica (one
    /// all-reduce per update). Each micro-batch is a slot of the run, so W workers accumulating N
    /// are bit for bit W x N workers.
    #[arg(long, default_value_t = 1)]
    pub(crate) accumulate: u32,
    /// Gradients travel in buckets of at most this many MB (float32), one reduction each, as
    /// DDP's bucket_cap_mb. Every worker must use the same.
    #[arg(long, default_value_t = crate::collective::buckets::DEFAULT_BUCKET_MB, value_name = "MB")]
    pub(crate) bucket_mb: f64,
    /// on: each bucket's reduction starts while the backward pass is still running, as soon as
    /// its gradients are final (the same bits); off: after the backward pass, for comparison.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub(crate) overlap: String,
    /// On CUDA, let operations that have no deterministic implementation run (libtorch warns once
    /// for each) rather than failing the step: the run is then not bit for bit reproducible, nor
    /// its resume exact. Without it every operation runs its deterministic algorithm (flash and
    /// memory-efficient attention's backward passes too, which otherwise run their faster
    /// non-deterministic ones), and one that has none fails the first step, naming it.
    #[arg(long)]
    pub(crate) allow_nondeterministic_ops: bool,
    /// What carries the gradients: ring (host-staged TCP ring), nccl (NCCL on the GPUs, the same
    /// bits) or auto (NCCL when every worker trains on CUDA with its own GPU).
    #[arg(long, default_value = "ring")]
    pub(crate) collective: String,
    /// Stop each epoch after this many steps.
    #[arg(long)]
    pub(crate) steps_per_epoch: Option<u64>,
    /// Write one JSON line per step (global loss, metrics, learning rate) to this file.
    #[arg(long)]
    pub(crate) metrics_log: Option<PathBuf>,
    /// Write one JSON line per lifecycle event (resumed, joined, step, abandoned, recovered,
    /// committed, exiting) to this file: a supervisor's channel (`trainerd local` hands each worker
    /// a pipe, /dev/fd/3).
    #[arg(long, env = "TRAINERD_EVENTS")]
    pub(crate) events: Option<PathBuf>,
    /// Write TensorBoard event files here (on the chief), as Keras's TensorBoard callback lays
    /// them out: DIR/train and DIR/validation.
    #[arg(long)]
    pub(crate) tensorboard_dir: Option<PathBuf>,
    /// Write the step loss to TensorBoard every N global steps (0: per epoch only).
    #[arg(long, default_value_t = 100)]
    pub(crate) tensorboard_every: u64,
    /// Serve Prometheus metrics (`/metrics`) and `/healthz` on this address (e.g.
    /// 127.0.0.1:9400; port 0 picks one). An address other than loopback needs
    /// --metrics-token-file (or --insecure).
    #[arg(long, env = "TRAINERD_METRICS_ADDR")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    /// A file holding the bearer token `/metrics` requires (Prometheus's
    /// `authorization.credentials_file`).
    #[arg(long, env = "TRAINERD_METRICS_TOKEN_FILE")]
    pub(crate) metrics_token_file: Option<PathBuf>,
    /// Seconds without training progress after which the daemon counts as hung (`/healthz`
    /// fails, systemd's watchdog pings stop); default: systemd's WatchdogSec, else 120.
    #[arg(long)]
    pub(crate) stall_timeout: Option<f64>,
    /// The cluster's timeouts.
    #[command(flatten)]
    pub(crate) timeouts: TimeoutArgs,
    /// The fewest workers that train (default: a majority of TF_CONFIG's training tasks, so that
    /// two sides of a partition never both train); fewer wait, as before.
    #[arg(long)]
    pub(crate) min_workers: Option<usize>,
    /// A worker that starts while the others train catches up first (their state, then every
    /// step's outputs, replayed) and takes its slots back without pausing them; the coordinator
    /// keeps the outputs not yet sent, up to this size (K, M, G suffixes), and past it the return
    /// pauses the others as a state transfer (0: always; docs/fault-tolerance.md).
    #[arg(long, default_value = "1G", value_parser = data::parse_bytes, value_name = "BYTES")]
    pub(crate) catch_up_memory: u64,
    /// Accept --min-workers of exactly half the workers, and with it the risk that both halves
    /// of a partition train.
    #[arg(long)]
    pub(crate) allow_even_split: bool,
    /// Keep this worker's vote here (fsynced), so that it can take part in electing a new
    /// coordinator when the chief is lost, and its position (the step its state reached, written
    /// after every step), so that the process that replaces it counts the steps it trained
    /// [default: $STATE_DIRECTORY, which systemd's
    /// StateDirectory= sets, else $XDG_STATE_HOME/trainerd/JOB or ~/.local/state/trainerd/JOB,
    /// JOB named for TF_CONFIG's cluster].
    #[arg(long)]
    pub(crate) state_dir: Option<PathBuf>,
    /// Take no part in electing a coordinator: a lost chief is waited for until it comes back.
    #[arg(long, conflicts_with = "state_dir")]
    pub(crate) no_failover: bool,
    /// Compare every member's state (an xxh3 digest of its parameters, buffers and optimizer
    /// state) every N global steps, as well as before each commit (0: before commits only). A
    /// member that differs (silent corruption) is named, and every member goes back to the last
    /// state they agreed on (docs/fault-tolerance.md).
    #[arg(long, default_value_t = crate::train::config::REPLICA_CHECK_EVERY)]
    pub(crate) replica_check_every: u64,
    /// Commit checkpoints here (a directory, file:///path, s3://bucket/prefix) and resume from
    /// the newest one at start.
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<String>,
    /// Commit every N steps, as well as at each epoch's end.
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u64,
    /// Keep the newest K commits (0: all).
    #[arg(long, default_value_t = 3)]
    pub(crate) keep_checkpoints: usize,
    /// Also keep the commit with the best value of an epoch-end figure (`val_accuracy`,
    /// `val_loss`, ...; losses and errors minimised, the rest maximised, unless `:min` or `:max`
    /// says): Keras's ModelCheckpoint(save_best_only=True). `ckpt list` names it and `evaluate
    /// --best` evaluates it.
    #[arg(long, value_name = "METRIC[:min|max]")]
    pub(crate) keep_best: Option<String>,
}

/// `trainerd evaluate`'s flags.
#[derive(clap::Args)]
pub(crate) struct EvalArgs {
    /// The flags `run` and `evaluate` share.
    #[command(flatten)]
    pub(crate) job: JobArgs,
    /// Checkpoint location (a directory, file:///path, s3://bucket/prefix).
    #[arg(long)]
    pub(crate) checkpoint: String,
    /// The commit to evaluate (default: the newest that verifies).
    #[arg(long, conflicts_with = "best")]
    pub(crate) sequence: Option<u64>,
    /// Evaluate the best commit (of a run with `--keep-best`).
    #[arg(long)]
    pub(crate) best: bool,
}

/// `trainerd predict`'s flags.
#[derive(clap::Args)]
pub(crate) struct PredictArgs {
    /// The checkpoint and the job, as `evaluate` takes them.
    #[command(flatten)]
    pub(crate) eval: EvalArgs,
    /// The split whose examples are predicted: test or train.
    #[arg(long, default_value = "test", value_parser = parse_split)]
    pub(crate) split: trainerd_sdk::Split,
    /// The Parquet file to write (example, output); in a cluster each worker writes
    /// NAME-0000r-of-0000n.parquet beside it.
    #[arg(long)]
    pub(crate) output: PathBuf,
}

fn parse_split(text: &str) -> Result<trainerd_sdk::Split, String> {
    match text {
        "test" => Ok(trainerd_sdk::Split::Test),
        "train" => Ok(trainerd_sdk::Split::Train),
        other => Err(format!("{other:?}: expected test or train")),
    }
}

/// The flags `run` and `evaluate` share: the plugin and its arguments, the data, where and how
/// the model computes, the cluster, S3, and the result's file.
#[derive(clap::Args)]
pub(crate) struct JobArgs {
    /// Path of the model plugin's shared library (.so).
    #[arg(long)]
    pub(crate) plugin: PathBuf,
    /// The plugin's arguments.
    #[command(flatten)]
    pub(crate) plugin_args: PluginArgFlags,
    /// The data.
    #[command(flatten)]
    pub(crate) data: DataArgs,
    /// Per-worker batch size (default: the plugin's).
    #[arg(long)]
    pub(crate) batch_size: Option<u32>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub(crate) device: String,
    /// libtorch threads (fixed, so results are reproducible; default: available cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// The forward pass's precision: fp32, or autocast to bf16 (CPU and CUDA) or fp16 (CUDA, with
    /// dynamic loss scaling); parameters, optimizer state and checkpoints stay float32. Part of
    /// the run configuration.
    #[arg(long, default_value = "fp32", value_parser = |t: &str| t.parse::<crate::optim::precision::Precision>())]
    pub(crate) precision: crate::optim::precision::Precision,
    /// Write the result as JSON to this file: a run's summary, or an evaluation's figures.
    #[arg(long)]
    pub(crate) summary: Option<PathBuf>,
    /// The cluster.
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// Seconds to wait for every worker to join at the start [default: 300].
    #[arg(long)]
    pub(crate) rendezvous_timeout: Option<f64>,
    /// S3 settings.
    #[command(flatten)]
    pub(crate) s3: S3Args,
}

/// `--plugin-arg KEY=VALUE`, for every command that loads a plugin.
#[derive(clap::Args, Clone, Debug, Default)]
pub(crate) struct PluginArgFlags {
    /// A setting for the plugin, as KEY=VALUE; repeatable. `trainerd plugin check` lists the
    /// keys a plugin accepts. Without any, the space-separated pairs of $TRAINERD_PLUGIN_ARGS.
    /// Every worker must give the same (a plugin may exempt a key, such as a file's path).
    #[arg(long = "plugin-arg", value_name = "KEY=VALUE")]
    pub(crate) plugin_arg: Vec<String>,
}

impl PluginArgFlags {
    /// The arguments: the flags, or else $TRAINERD_PLUGIN_ARGS.
    pub(crate) fn parse(&self) -> anyhow::Result<PluginArgs> {
        if !self.plugin_arg.is_empty() {
            return Ok(PluginArgs::parse(&self.plugin_arg)?);
        }
        let env = std::env::var("TRAINERD_PLUGIN_ARGS").unwrap_or_default();
        let items: Vec<&str> = env.split_whitespace().collect();
        PluginArgs::parse(&items).context("TRAINERD_PLUGIN_ARGS")
    }

    /// The flags that give `args` to a child `trainerd`.
    pub(crate) fn to_flags(args: &PluginArgs) -> Vec<String> {
        args.iter().map(|(k, v)| format!("--plugin-arg={k}={v}")).collect()
    }
}

/// The cluster's timeouts that only `run` has (a timeout not given is derived from those given).
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub(crate) struct TimeoutArgs {
    /// Seconds between heartbeats to the chief [default: 0.1; at most a fifth of the heartbeat
    /// deadline].
    #[arg(long)]
    pub(crate) heartbeat_interval: Option<f64>,
    /// Seconds without a heartbeat after which a worker (or the chief) counts as failed
    /// [default: 1.5; at least 15 heartbeat intervals, under a third of the collective timeout].
    #[arg(long)]
    pub(crate) heartbeat_deadline: Option<f64>,
    /// Seconds a socket may carry no bytes before its collective fails (a backstop: failures
    /// are normally detected by the heartbeats and pushed notices first) [default: 120; above 4
    /// heartbeat deadlines and twice the data timeout, under half the rejoin deadline].
    #[arg(long)]
    pub(crate) collective_timeout: Option<f64>,
    /// Seconds the survivors wait for a lost worker to return, when fewer than --min-workers
    /// are left, before they exit non-zero (so that their supervisor restarts them); long
    /// enough for a node to reboot [default: 600; above twice the collective timeout].
    #[arg(long)]
    pub(crate) rejoin_deadline: Option<f64>,
    /// Seconds a lost worker is waited for before the others go on without it, its slots
    /// (virtual ranks) spread over them [default: 0, they go on at once].
    #[arg(long)]
    pub(crate) replace_after: Option<f64>,
}

/// The cluster flags `run` and `evaluate` share.
#[derive(clap::Args)]
pub(crate) struct ClusterArgs {
    /// The cluster, as TensorFlow's TF_CONFIG JSON or @FILE (default: the TF_CONFIG variable;
    /// none means one worker).
    #[arg(long)]
    pub(crate) tf_config: Option<String>,
    /// The cluster secret: a file (the same on every node, readable only by trainerd's user)
    /// whose contents every control-plane and data-plane connection proves it knows. Needed
    /// when TF_CONFIG has a non-loopback address.
    #[arg(long, env = "TRAINERD_SECRET_FILE")]
    pub(crate) secret_file: Option<PathBuf>,
    /// Run a cluster across hosts without a secret: anyone who can reach its ports can join it.
    #[arg(long)]
    pub(crate) insecure: bool,
    /// The address the control plane and the data listener bind (default: every interface for a
    /// cluster across hosts, the TF_CONFIG address for a loopback one).
    #[arg(long, env = "TRAINERD_LISTEN")]
    pub(crate) listen: Option<std::net::IpAddr>,
}

impl ClusterArgs {
    /// The cluster and how its members reach each other.
    pub(crate) fn plan(&self) -> anyhow::Result<(Option<ClusterConfig>, Network)> {
        let cluster = cluster(self.tf_config.as_deref())?;
        let key = self.secret_file.as_deref().map(ClusterKey::load).transpose()?;
        let network = match &cluster {
            Some(c) => Network::plan(c, self.listen, key, self.insecure)?,
            None => Network::loopback(),
        };
        if cluster.is_some() && network.key.is_none() && self.insecure {
            // The command line's own warnings keep the binary's target, as the logs have always named them.
            tracing::warn!(target: "trainerd", "--insecure: the cluster's ports accept anyone who can reach them");
        }
        Ok((cluster, network))
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

/// What `--shard` shards (docs/fault-tolerance.md, "Sharded gradients and parameters").
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Shard {
    /// The optimizer state (ZeRO stage 1).
    Optimizer,
    /// The optimizer state and the gradients (ZeRO stage 2).
    Gradients,
}

impl RunArgs {
    /// The sharding asked for (`--shard`, or `--shard-optimizer`).
    pub(crate) fn shard(&self) -> Option<Shard> {
        self.shard.or(self.shard_optimizer.then_some(Shard::Optimizer))
    }

    /// The flag as it was given, for messages: `--shard-optimizer` or `--shard LEVEL`.
    pub(crate) fn shard_flag(&self) -> &'static str {
        match self.shard {
            Some(Shard::Gradients) => "--shard gradients",
            Some(Shard::Optimizer) => "--shard optimizer",
            None => "--shard-optimizer",
        }
    }
}
