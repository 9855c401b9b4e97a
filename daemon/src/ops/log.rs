//! Log lines for people and for machines. `plain` (the default) writes one line per event,
//! coloured only on a terminal; to the journal (systemd's `JOURNAL_STREAM` names standard
//! error) it leaves the time to journald and prefixes each line with its syslog priority
//! (`<4>` for a warning), so `journalctl -p warning` finds them. `json` writes one JSON object
//! per line for log shippers. Progress lines ([`crate::ops::progress`]) follow the same format.

use std::io::IsTerminal;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// One readable line per event.
    Plain,
    /// One JSON object per line.
    Json,
}

/// Whether `JOURNAL_STREAM` (`device:inode`) is this process's standard error or output.
pub(crate) fn journal(stream: impl std::os::fd::AsFd) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else { return false };
    let Some((dev, ino)) = value.to_str().and_then(|v| v.split_once(':')) else { return false };
    let Ok(file) = stream.as_fd().try_clone_to_owned().map(std::fs::File::from) else { return false };
    file.metadata().is_ok_and(|m| dev.parse() == Ok(m.dev()) && ino.parse() == Ok(m.ino()))
}

/// The syslog priority journald reads from a `<N>` prefix.
pub(crate) fn priority(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// A plain line: `[<N>]TIME LEVEL target: message fields`, without the time in the journal.
struct Plain {
    journal: bool,
}

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let meta = event.metadata();
        if self.journal {
            write!(w, "<{}>", priority(*meta.level()))?;
        } else {
            SystemTime.format_time(&mut w)?;
            write!(w, " ")?;
        }
        write!(w, "{} {}: ", meta.level(), meta.target())?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// Installs the process's logger on standard error; the level comes from `TRAINERD_LOG`
/// (default `warn`).
pub(crate) fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TRAINERD_LOG").unwrap_or_else(|_| "warn".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let tty = std::io::stderr().is_terminal();
    let result = match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
        LogFormat::Plain if tty => builder.try_init(),
        LogFormat::Plain => {
            builder.with_ansi(false).event_format(Plain { journal: journal(std::io::stderr()) }).try_init()
        }
    };
    if let Err(e) = result {
        eprintln!("warning: logging was set up already: {e}");
    }
}
