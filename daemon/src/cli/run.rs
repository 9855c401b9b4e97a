//! `trainerd run`: the flags made into a [`RunConfig`], the operator's surfaces started (metrics,
//! systemd), the run, and how it ended: the last lines, the summary, the exit status, and the
//! `exiting` event.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::args::RunArgs;
use super::data::bytes;
use super::{data_options, device, seconds, set_threads, stop_flag};
use crate::cluster::{ClusterConfig, Network, Timeouts};
use crate::events::{Event, Events};
use crate::exit::Exit;
use crate::input::{DataSource, Watch};
use crate::ops::log::LogFormat;
use crate::ops::notify::{self, Notifier};
use crate::ops::progress::Progress;
use crate::ops::serve::{self, Token};
use crate::ops::Telemetry;
use crate::optim::flags::{self, OptimizerFlags};
use crate::plugin::Plugin;
use crate::sys::accel::{self, CudaLibrary, Facts};
use crate::train::report::Outputs;
use crate::train::{self, CheckpointConfig, Outcome, RunConfig};

/// Runs `trainerd run`; its exit status. Every way out, errors included, is an `exiting` event.
pub(crate) fn run(args: RunArgs, cuda: CudaLibrary, log_format: LogFormat) -> anyhow::Result<i32> {
    let events = match &args.events {
        Some(path) => Events::open(path).with_context(|| format!("--events {}", path.display()))?,
        None => Events::none(),
    };
    // Before libtorch reads it: kernels this CPU cannot run would die of an illegal instruction.
    let checked = crate::sys::cpu::check_variable().map_err(anyhow::Error::from);
    let result = checked.and_then(|()| train(args, cuda, log_format, &events));
    let status = result.as_ref().map_or_else(super::status_of, |&code| code);
    events.emit(Event::Exiting { status });
    result
}

fn train(args: RunArgs, cuda: CudaLibrary, log_format: LogFormat, events: &Events) -> anyhow::Result<i32> {
    // SIGTERM or SIGINT: stop at the next step boundary after the cluster's commit; a second one
    // ends the process at once.
    let stop = stop_flag()?;
    let timeouts = Timeouts { min_workers: args.min_workers, ..super::timeouts(&args.job, &args.timeouts)? };
    let (cluster, network) = args.job.cluster.plan()?;
    if let Some(c) = &cluster {
        timeouts.check_min_workers(c.world_size(), args.allow_even_split)?;
    }
    let facts = accel::facts(cuda);
    let devices = devices(&args, &facts)?;
    let device = devices[0];
    if device.is_cuda() {
        for missing in accel::make_deterministic(!args.allow_nondeterministic_ops) {
            tracing::warn!(target: "trainerd", "this libtorch has no switch for {missing}; results on CUDA may not be reproducible");
        }
    }
    let threads = set_threads(args.job.threads)?;
    let (collective, not_nccl) = collective(&args.collective, cluster.as_ref(), device, &facts)?;
    let token = args.metrics_token_file.as_deref().map(Token::load).transpose()?;
    if let Some(addr) =
        args.metrics_addr.filter(|a| !a.ip().is_loopback() && token.is_none() && !args.job.cluster.insecure)
    {
        anyhow::bail!(
            "--metrics-addr {addr} is not a loopback address: give --metrics-token-file so that only your \
             Prometheus can read the metrics, or pass --insecure"
        );
    }
    let plugin = Plugin::load(&args.job.plugin, &args.job.plugin_args.parse()?)?;
    let stall = match args.stall_timeout {
        Some(s) => seconds("--stall-timeout", s)?,
        None => notify::watchdog_period().unwrap_or(Duration::from_secs(120)),
    };
    let workers = cluster.as_ref().map_or(1, ClusterConfig::world_size);
    let epochs = args.epochs.unwrap_or(plugin.info().defaults.epochs);
    // Before the data opens: a failing data source is shown in STATUS= and keeps the watchdog fed.
    let telemetry = Arc::new(Telemetry::new(stall, epochs, workers));
    let mut progress = Progress::stdout(log_format);
    let data = data_source(&args, &plugin, (timeouts.data, &telemetry), &mut progress)?;
    let mut cfg = run_config(&args, &plugin, (cluster, network, data), (timeouts, devices, threads))?;
    cfg.gpus = gpus(&cfg.devices, &facts);
    cfg.collective = collective;
    if cfg.cluster.as_ref().is_some_and(|c| c.rank != 0) {
        progress = progress.without_step_lines();
    }
    announce(&mut progress, &plugin, &facts, (&cfg, not_nccl.as_deref(), &optimizer_flags(&args.optim)));
    if let Some(addr) = args.metrics_addr {
        let bound = serve::start(addr, Arc::clone(&telemetry), token)?;
        progress.line(&format!("trainerd: metrics on http://{bound}/metrics, health on http://{bound}/healthz"));
    }
    let notifier = Notifier::start(Arc::clone(&telemetry), Arc::clone(&stop));
    let outputs = Outputs { progress: &mut progress, telemetry: Arc::clone(&telemetry), events: events.clone() };
    let outcome = train::run(&plugin, &cfg, outputs, &stop);
    // STOPPING=1 before the last lines: the run is over, however it ended.
    telemetry.set_stopping();
    if let Some(n) = notifier {
        n.finish();
    }
    ended(outcome?, &mut progress, args.job.summary.as_ref())
}

/// `--early-stopping` and `--reduce-lr-on-plateau`, their figures checked against the plugin's
/// metrics.
fn callbacks(args: &RunArgs, plugin: &Plugin) -> anyhow::Result<crate::optim::callbacks::Callbacks> {
    use crate::optim::callbacks::{figure_names, parse_early_stopping, parse_reduce_lr};
    let names = figure_names(&plugin.info().metrics, !args.no_evaluation);
    Ok(crate::optim::callbacks::Callbacks {
        early_stopping: args.early_stopping.as_deref().map(|t| parse_early_stopping(t, &names)).transpose()?,
        reduce_lr_on_plateau: args.reduce_lr_on_plateau.as_deref().map(|t| parse_reduce_lr(t, &names)).transpose()?,
    })
}

/// The devices of this worker's replicas: `--devices`, else the one `--device` names.
fn devices(args: &RunArgs, facts: &Facts) -> anyhow::Result<Vec<tch::Device>> {
    match &args.devices {
        Some(list) => Ok(facts.devices(list)?),
        None => Ok(vec![device(&args.job.device, facts)?]),
    }
}

/// The backend `--collective` gives this worker (and, for `auto`, why not NCCL): NCCL can only
/// be picked automatically when no two workers can land on one GPU, which is judged from the
/// workers of TF_CONFIG on this host and the GPUs visible here.
fn collective(
    choice: &str,
    cluster: Option<&ClusterConfig>,
    device: tch::Device,
    facts: &Facts,
) -> anyhow::Result<(crate::collective::Backend, Option<String>)> {
    let sharing = cluster.map_or(0, |c| {
        let host = |a: &str| a.rsplit_once(':').map_or(a, |(h, _)| h).to_string();
        let mine = host(&c.me().address);
        c.members.iter().enumerate().filter(|&(r, m)| r != c.rank && host(&m.address) == mine).count()
    });
    // NCCL_HOSTID lets ranks share a GPU; TRAINERD_NCCL_ENTER_TOGETHER=0 turns off their meeting
    // before each NCCL all-reduce (to measure what it does).
    let hostid = std::env::var_os("NCCL_HOSTID").is_some();
    let enter_together = hostid && std::env::var("TRAINERD_NCCL_ENTER_TOGETHER").map_or(true, |v| v != "0");
    let host = crate::collective::Host { sharing, gpus: facts.gpus.len(), hostid, enter_together };
    Ok(crate::collective::choose(choice, device, host)?)
}

/// The data `--data` names, opened (a columnar dataset: indexed and checked against the
/// plugin's columns), its failures told to `telemetry`; a read waits `data_timeout` for a
/// failing source; raw text's tokenizing told on `progress`.
fn data_source(
    args: &RunArgs,
    plugin: &Plugin,
    (data_timeout, telemetry): (Duration, &Arc<Telemetry>),
    progress: &mut Progress,
) -> anyhow::Result<DataSource> {
    let options = data_options(&args.job.data, &args.job.s3, Arc::new(Watch(Arc::clone(telemetry))), data_timeout)?;
    let opening = (options, &args.job.data.text_options());
    let say = &mut |line: &str| progress.line(line);
    let window = (args.shuffle_window, !args.no_evaluation);
    let data = DataSource::open(&args.job.data.data, plugin.info(), window, opening, say)?;
    if let (Some(path), DataSource::Plugin(dir, _)) = (&args.log_examples, &data) {
        anyhow::bail!(
            "--log-examples {}: the data at {} is in the plugin's own format, which has no example ids; it needs a \
             Parquet dataset",
            path.display(),
            dir.display()
        );
    }
    Ok(data)
}

/// Where and how often to commit, if anywhere, and which commit to keep as the best.
fn checkpoint_config(args: &RunArgs, plugin: &Plugin) -> anyhow::Result<Option<CheckpointConfig>> {
    let names = crate::optim::callbacks::figure_names(&plugin.info().metrics, !args.no_evaluation);
    let best = args.keep_best.as_deref().map(|t| crate::optim::callbacks::parse_keep_best(t, &names));
    Ok(match &args.checkpoint_dir {
        None if args.checkpoint_every > 0 => anyhow::bail!("--checkpoint-every needs --checkpoint-dir"),
        None if best.is_some() => anyhow::bail!("--keep-best needs --checkpoint-dir"),
        None => None,
        Some(url) => Some(CheckpointConfig {
            location: url.parse()?,
            s3: args.job.s3.options(),
            every: args.checkpoint_every,
            keep: args.keep_checkpoints,
            best: best.transpose()?,
        }),
    })
}

/// The optimizer's flags.
fn optimizer_flags(o: &crate::cli::args::OptimArgs) -> OptimizerFlags {
    OptimizerFlags {
        name: o.optimizer.clone(),
        lr: o.lr,
        momentum: o.momentum,
        weight_decay: o.weight_decay,
        nesterov: o.nesterov,
        adam: [o.adam_beta1, o.adam_beta2, o.adam_epsilon],
        decay_all: o.decay_all_parameters,
    }
}

/// What to train and how: the flags over the plugin's defaults.
fn run_config(
    args: &RunArgs,
    plugin: &Plugin,
    (cluster, network, data): (Option<ClusterConfig>, Network, DataSource),
    (timeouts, devices, threads): (Timeouts, Vec<tch::Device>, usize),
) -> anyhow::Result<RunConfig> {
    let defaults = plugin.info().defaults.clone();
    let o = &args.optim;
    let optimizer = flags::optimizer(&defaults.optimizer, &optimizer_flags(o), &plugin.info().no_decay)?;
    let checkpoint = checkpoint_config(args, plugin)?;
    let batch_size = args.job.batch_size.unwrap_or(defaults.batch_size);
    if batch_size == 0 {
        anyhow::bail!("--batch-size 0: expected at least 1");
    }
    if args.accumulate == 0 {
        anyhow::bail!("--accumulate 0: expected at least 1 (micro-batches per update)");
    }
    for &device in &devices {
        args.job.precision.check(device)?;
    }
    let (shard_optimizer, shard_gradients) = sharding(args, &devices, cluster.is_some() && checkpoint.is_none())?;
    let clip = clip(args, &optimizer)?;
    Ok(RunConfig {
        data,
        plugin: plugin.agreement(),
        precision: args.job.precision,
        evaluate: !args.no_evaluation,
        log_examples: args.log_examples.clone(),
        state_dir: state_dir(args, cluster.as_ref())?,
        epochs: args.epochs.unwrap_or(defaults.epochs),
        batch_size,
        optimizer,
        schedule: o.lr_schedule.clone().unwrap_or(defaults.schedule),
        warmup: o.warmup_steps.filter(|w| *w != crate::optim::schedule::Warmup::Steps(0)),
        seed: args.seed,
        device: devices[0],
        devices,
        accumulate: args.accumulate as usize,
        clip,
        shard_optimizer,
        shard_gradients,
        catch_up_memory: args.catch_up_memory,
        callbacks: callbacks(args, plugin)?,
        steps_per_epoch: args.steps_per_epoch,
        threads,
        cluster,
        network,
        timeouts,
        bucket_bytes: bucket_bytes(args.bucket_mb)?,
        overlap: args.overlap == "on",
        collective: crate::collective::Backend::Ring,
        metrics_log: args.metrics_log.clone(),
        tensorboard_dir: args.tensorboard_dir.clone(),
        tensorboard_every: args.tensorboard_every,
        replica_check_every: args.replica_check_every,
        gpus: Vec::new(),
        checkpoint,
    })
}

/// What `--shard` shards (the optimizer state; the gradients too), where it can run on `devices`
/// (`uncommitted`: a cluster without checkpoints).
fn sharding(args: &RunArgs, devices: &[tch::Device], uncommitted: bool) -> anyhow::Result<(bool, bool)> {
    let Some(level) = args.shard() else { return Ok((false, false)) };
    shardable(args.shard_flag(), devices, uncommitted)?;
    Ok((true, level == crate::cli::args::Shard::Gradients))
}

/// Whether sharding (`flag`, as given) can run on `devices` (`uncommitted`: a cluster without
/// checkpoints).
fn shardable(flag: &str, devices: &[tch::Device], uncommitted: bool) -> anyhow::Result<()> {
    if let Some(cuda) = devices.iter().find(|d| d.is_cuda()) {
        anyhow::bail!(
            "{flag} runs on the CPU so far (its update is proven element by element on the CPU's float32 loops, not \
             yet on {cuda:?}): train on --device cpu, or without {flag}"
        );
    }
    if uncommitted {
        anyhow::bail!(
            "{flag} needs --checkpoint-dir: a worker lost together with its buddy (the next worker) takes their \
             ranges of the optimizer state with them, and the cluster goes back to the last commit"
        );
    }
    Ok(())
}

/// The gradient clipping: the flags', or a Keras model's compile()'s `global_clipnorm` and
/// `clipvalue` where the flags say nothing. Its per-variable `clipnorm` is the optimizer's, which
/// a sharded optimizer state cannot run.
/// `--bucket-mb` in bytes (MiB, as DDP's `bucket_cap_mb`).
fn bucket_bytes(mb: f64) -> anyhow::Result<usize> {
    let bytes = (mb * (1u64 << 20) as f64).round();
    if !mb.is_finite() || bytes < 4.0 {
        anyhow::bail!("--bucket-mb {mb}: expected a size in MB of at least one float32 (4 bytes), such as 25");
    }
    Ok(bytes as usize)
}

fn clip(args: &RunArgs, optimizer: &trainerd_sdk::OptimizerConfig) -> anyhow::Result<crate::optim::clip::Clip> {
    let keras = match optimizer {
        trainerd_sdk::OptimizerConfig::Keras(k) => Some(k),
        _ => None,
    };
    if args.shard().is_some() && keras.is_some_and(|k| k.clipnorm.is_some()) {
        let flag = args.shard_flag();
        anyhow::bail!(
            "{flag} with the Keras optimizer's clipnorm: clipnorm scales each variable's gradient by its own norm, \
             which no worker holds whole when the state is sharded; use global_clipnorm in compile() (or \
             --clip-norm), or train without {flag}"
        );
    }
    Ok(crate::optim::clip::Clip {
        norm: args.clip_norm.or(keras.and_then(|k| k.global_clipnorm)),
        value: args.clip_value.or(keras.and_then(|k| k.clipvalue)),
    })
}

/// A Keras model's optimizer as the run uses it: compile()'s, with Keras's rules, and which flags
/// won over what compile() said. `None` for other models.
fn keras_line(cfg: &RunConfig, flags: &OptimizerFlags) -> Option<String> {
    let trainerd_sdk::OptimizerConfig::Keras(k) = &cfg.optimizer else { return None };
    let whose = match flags::keras_overrides(flags) {
        Some(given) => format!("from compile(), {given} from the command line over it"),
        None => "from compile()".to_string(),
    };
    Some(format!("trainerd: optimizer {whose}: {} with Keras's update rules, {}", k.name(), k.describe()))
}

/// The GPU model of each CUDA device in `devices` (none on the CPU).
fn gpus(devices: &[tch::Device], facts: &Facts) -> Vec<String> {
    let name = |i: usize| facts.gpus.get(i).cloned().unwrap_or_else(|| format!("cuda:{i}"));
    devices.iter().filter_map(|d| if let tch::Device::Cuda(i) = d { Some(name(*i)) } else { None }).collect()
}

/// What the start says of `--shard` (in a cluster of several workers).
fn sharding_lines(cfg: &RunConfig) -> Vec<&'static str> {
    let mut lines = Vec::new();
    if cfg.shard_optimizer && cfg.cluster.as_ref().is_some_and(|c| c.world_size() > 1) {
        lines.push(
            "trainerd: optimizer state sharded over the workers (ZeRO stage 1): each keeps the state of the gradient \
             ranges it reduces and a buddy copy of the previous worker's, so that a worker lost costs no step (a \
             worker lost with its buddy sends the cluster back to the last commit)",
        );
        if cfg.shard_gradients {
            lines.push(
                "trainerd: gradients sharded too (ZeRO stage 2): each gradient is let go once its bucket is staged, \
                 and each bucket once reduce-scattered, keeping only the ranges this worker owns; the parameters are \
                 written a bucket at a time as they are gathered",
            );
        }
    }
    lines
}

/// The run's first lines: what trains where, which libtorch, and (in a cluster) what carries the
/// gradients, with why not NCCL when `--collective auto` chose the ring.
fn announce(
    progress: &mut Progress,
    plugin: &Plugin,
    facts: &Facts,
    (cfg, not_nccl, flags): (&RunConfig, Option<&str>, &OptimizerFlags),
) {
    let info = plugin.info();
    let who = match &cfg.cluster {
        None => "one worker".to_string(),
        Some(c) => format!("{} of {} workers", c.me(), c.world_size()),
    };
    let (on, mut each) = match cfg.devices.len() {
        1 => (facts.describe(cfg.device), "worker".to_string()),
        n => (
            format!("{n} replicas ({})", cfg.devices.iter().map(|&d| facts.describe(d)).collect::<Vec<_>>().join(", ")),
            "replica".to_string(),
        ),
    };
    if cfg.accumulate > 1 {
        each = format!("micro-batch, {} micro-batches per update per {each}", cfg.accumulate);
    }
    progress.line(&format!(
        "trainerd: {} {} on {on} with {} thread(s); {who}, batch {} per {each}, {} epoch(s), optimizer {} lr {}, seed {}",
        info.name,
        info.version,
        cfg.threads,
        cfg.batch_size,
        cfg.epochs,
        cfg.optimizer.name(),
        cfg.optimizer.lr(),
        cfg.seed
    ));
    if let Some(line) = keras_line(cfg, flags) {
        progress.line(&line);
    }
    progress.line(&format!("trainerd: {}", facts.line()));
    match crate::sys::cpu::resolved() {
        Ok(resolved) => progress.line(&format!("trainerd: {}", crate::sys::cpu::describe(resolved))),
        Err(e) => progress.line(&format!("warning: {e}")),
    }
    if let Some(line) = cfg.precision.start_line() {
        progress.line(line);
    }
    sharding_lines(cfg).into_iter().for_each(|line| progress.line(line));
    if cfg.cluster.is_some() {
        let why = not_nccl.map(|w| format!(" (--collective auto: not NCCL, {w})")).unwrap_or_default();
        progress.line(&format!("trainerd: gradients over the {}{why}", cfg.collective.describe()));
    }
    progress.line(&format!("trainerd: {}", cfg.data.describe()));
}

/// The last lines of a run that ended with `outcome`, its summary written; its exit status.
fn ended(outcome: Outcome, progress: &mut Progress, summary_path: Option<&PathBuf>) -> anyhow::Result<i32> {
    let summary = match outcome {
        Outcome::Finished(summary) => summary,
        Outcome::Stopped { step, saved } => {
            progress.line(&format!("trainerd: stopped by signal at global step {step}; the state is {saved}"));
            return Ok(Exit::Done.code());
        }
        Outcome::AlreadyFinished(said) => {
            progress.line(&format!("trainerd: {said}; nothing left to do"));
            return Ok(Exit::Done.code());
        }
    };
    let evaluated = match summary.test_loss {
        Some(loss) => format!(
            "test loss {loss:.4}{}",
            summary.test_accuracy.map(|a| format!(", test accuracy {a:.4}")).unwrap_or_default()
        ),
        None => "not evaluated (--no-evaluation)".into(),
    };
    progress.line(&format!(
        "done: {} steps, {evaluated}, {:.0} examples/s, params sha256 {}",
        summary.steps, summary.examples_per_second, summary.params_sha256
    ));
    if let Some(d) = &summary.data {
        let per_epoch = d.train_epochs.iter().map(|(_, t)| t.fetched).max().unwrap_or(0);
        let cached: u64 = d.train_epochs.iter().map(|(_, t)| t.from_cache).sum();
        progress.line(&format!(
            "data: at most {} fetched in an epoch (each row group of the training split's {} once), {} from the \
             local cache; at most {} of rows held",
            bytes(per_epoch),
            bytes(d.train_projected_bytes),
            bytes(cached),
            bytes(d.peak_held_bytes)
        ));
    }
    if let Some(path) = summary_path {
        summary.write(path).with_context(|| format!("writing the summary to {}", path.display()))?;
    }
    if let Some(e) = &summary.checkpoint_error {
        progress.line(&format!("error: training finished, but its last checkpoint was not committed: {e}"));
        return Ok(Exit::FinishedUncommitted.code());
    }
    Ok(Exit::Done.code())
}

/// Where this worker keeps its vote for electing a coordinator: `--state-dir`, else systemd's
/// `$STATE_DIRECTORY` (the unit's `StateDirectory=`), else the user's state directory
/// (`$XDG_STATE_HOME`, or `~/.local/state`) under `trainerd/JOB`, JOB named for the cluster;
/// created if missing. None with `--no-failover`, or alone: this worker takes no part in an
/// election (a chief lost for good is waited for).
fn state_dir(args: &RunArgs, cluster: Option<&ClusterConfig>) -> anyhow::Result<Option<PathBuf>> {
    let Some(cluster) = cluster.filter(|_| !args.no_failover) else { return Ok(None) };
    let dir = match (&args.state_dir, std::env::var_os("STATE_DIRECTORY")) {
        (Some(d), _) => d.clone(),
        // systemd may list several, separated by colons: the first is the unit's own.
        (None, Some(v)) => PathBuf::from(v.to_string_lossy().split(':').next().unwrap_or_default()),
        (None, None) => {
            let base = match (std::env::var_os("XDG_STATE_HOME"), std::env::var_os("HOME")) {
                (Some(x), _) if !x.is_empty() => PathBuf::from(x),
                (_, Some(home)) => PathBuf::from(home).join(".local/state"),
                _ => anyhow::bail!(
                    "no --state-dir, $STATE_DIRECTORY, $XDG_STATE_HOME or $HOME to keep this worker's vote in: give \
                     --state-dir, or --no-failover to wait for a lost chief instead"
                ),
            };
            base.join("trainerd").join(job_name(&cluster.cluster_json()))
        }
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("--state-dir {}", dir.display()))?;
    Ok(Some(dir))
}

/// A job's name for its default state directory: the first 16 hex digits of the sha256 of
/// TF_CONFIG's cluster, so that every job on a machine has its own.
fn job_name(cluster_json: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(cluster_json.as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}
