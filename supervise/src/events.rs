//! Lifecycle events for supervisors: what a worker did (resumed, joined, stepped, abandoned a
//! step, recovered, committed, is exiting), one JSON object per line, on a channel of its own
//! (`--events PATH`, or `TRAINERD_EVENTS`). The user's chosen log format stays as it is; a
//! supervisor (`trainerd local`, the chaos tests) learns what happened from these records, never
//! from the wording of the human lines.
//!
//! A record is `{"time": UNIX_SECONDS, "pid": PID, "event": NAME, ...fields}`; one forwarded by
//! `trainerd local` also names its `worker`. A supervisor hands each child a pipe ([`Pipe`]): the child
//! writes to its inherited descriptor 3 (`TRAINERD_EVENTS=/dev/fd/3`).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// The variable (and `--events`' environment name) that names the events file.
pub const VARIABLE: &str = "TRAINERD_EVENTS";
/// The descriptor a supervised child writes its events to.
const CHILD_FD: i32 = 3;

/// What happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The chief restored a commit: training continues from it.
    Resumed {
        /// The commit's sequence.
        sequence: u64,
        /// Its epoch (0-based; the run is complete when it equals the epochs).
        epoch: u32,
        /// Steps of that epoch done.
        step_in_epoch: u64,
        /// Its global step.
        global_step: u64,
    },
    /// This worker is in a formed generation (alone: at once), about to train from `global_step`.
    Joined {
        /// The generation.
        generation: u64,
        /// This worker's rank.
        rank: usize,
        /// Workers in the generation.
        workers: usize,
        /// The global step the generation continues from.
        global_step: u64,
        /// A generation had formed before: this one is a recovery.
        recovery: bool,
        /// Steps the cluster lost: trained, and not held by the state this generation continues
        /// from, with no repair asking for it.
        steps_lost: u64,
        /// Steps the members' states had reached that this generation does not continue from:
        /// those lost, and those a repair of a corrupted replica went back over.
        #[serde(default)]
        steps_trained_again: u64,
        /// The rank the state came from, when some member received it.
        source: Option<usize>,
        /// Workers present in the generation, when fewer than `workers` (the others' slots are
        /// spread over them).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        present: Option<usize>,
        /// Who holds which slots, when some worker holds several (`worker 0: slots 0-1, ...`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        layout: Option<String>,
    },
    /// A step is done.
    Step {
        /// Epoch (0-based).
        epoch: u32,
        /// Step in the epoch (1-based).
        step: u64,
        /// Global steps done.
        global_step: u64,
    },
    /// The generation ended at a step boundary every member learned from the step's all-reduce
    /// (a worker came back): nothing was abandoned, and every member joins the next one.
    Ended {
        /// The generation that ended.
        generation: u64,
        /// The last global step it completed.
        step: u64,
        /// Why.
        reason: String,
    },
    /// A step (or a formation, or a barrier) was abandoned: a member failed or was stopped.
    Abandoned {
        /// The generation abandoned.
        generation: u64,
        /// The global step (1-based) that was not completed.
        step: u64,
        /// Why.
        reason: String,
    },
    /// The first step after a recovery is done.
    Recovered {
        /// The recovered generation.
        generation: u64,
        /// The global step it continued from.
        global_step: u64,
        /// Steps lost.
        steps_lost: u64,
        /// Steps trained again (those lost, and those a repair went back over).
        #[serde(default)]
        steps_trained_again: u64,
        /// Seconds from the failure (or this process's start) to this step.
        seconds: f64,
    },
    /// The chief committed a checkpoint.
    Committed {
        /// Its sequence.
        sequence: u64,
        /// The global step it holds.
        global_step: u64,
    },
    /// The process is about to exit with `status`.
    Exiting {
        /// The exit status.
        status: i32,
    },
}

/// An event as written: when, by which process, from which worker (when forwarded), what.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Unix time in seconds.
    pub time: f64,
    /// The process that emitted it.
    #[serde(default)]
    pub pid: u32,
    /// The worker it came from, in a record a launcher forwards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<usize>,
    /// What happened.
    #[serde(flatten)]
    pub event: Event,
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Where events go: nowhere, or a file (a pipe) written one line per event. Clones write to the
/// same file. A write that fails is reported once, and events stop: they never stop the run.
#[derive(Clone, Default)]
pub struct Events(Option<Arc<Mutex<Option<File>>>>);

impl Events {
    /// No events.
    pub fn none() -> Events {
        Events(None)
    }

    /// Events appended to `path` (`/dev/fd/N`: an inherited descriptor).
    pub fn open(path: &Path) -> std::io::Result<Events> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Events(Some(Arc::new(Mutex::new(Some(file))))))
    }

    /// Writes `event`.
    pub fn emit(&self, event: Event) {
        self.write(&Record { time: now(), pid: std::process::id(), worker: None, event });
    }

    /// Writes `record` as it is (a launcher forwarding its workers' records).
    pub fn write(&self, record: &Record) {
        let Some(sink) = &self.0 else { return };
        let mut file = sink.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(f) = file.as_mut() else { return };
        let line = serde_json::to_string(record).expect("plain data") + "\n";
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!("events: {e}; no more events are written");
            *file = None;
        }
    }
}

/// The records in `stream`, one per line, until it ends; a line that is not a record is skipped
/// with a warning.
pub fn records(stream: impl Read) -> impl Iterator<Item = Record> {
    BufReader::new(stream).lines().map_while(Result::ok).filter_map(|line| match serde_json::from_str(&line) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!("events: not a record ({e}): {line}");
            None
        }
    })
}

/// A pipe a supervised child writes its events into.
pub struct Pipe {
    reader: File,
    writer: OwnedFd,
}

impl Pipe {
    /// A new pipe (both ends closed on exec, until [`Pipe::hand_to`] gives one to a child).
    pub fn new() -> std::io::Result<Pipe> {
        let mut fds = [0; 2];
        // SAFETY: pipe2(2) fills the two descriptors, which we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fresh descriptors from pipe2, owned by nothing else.
        let (reader, writer) = unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Pipe { reader, writer })
    }

    /// Makes `cmd`'s child write its events into this pipe: the write end becomes its
    /// descriptor 3, and `TRAINERD_EVENTS` names it.
    pub fn hand_to(&self, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        let fd = self.writer.as_raw_fd();
        cmd.env(VARIABLE, format!("/dev/fd/{CHILD_FD}"));
        // SAFETY: dup2 and fcntl are async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let done = if fd == CHILD_FD { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, CHILD_FD) };
                if done < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
    }

    /// The read end, once the child is started (this process's write end is closed, so the
    /// reader sees the end of the stream when the child exits).
    pub fn into_reader(self) -> File {
        self.reader
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_flat_json_object() {
        let r = Record { time: 1.5, pid: 7, worker: Some(2), event: Event::Committed { sequence: 3, global_step: 40 } };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(line, r#"{"time":1.5,"pid":7,"worker":2,"event":"committed","sequence":3,"global_step":40}"#);
        assert_eq!(serde_json::from_str::<Record>(&line).unwrap(), r);
        let alone: Record = serde_json::from_str(r#"{"time":2.0,"event":"exiting","status":3}"#).unwrap();
        assert_eq!((alone.worker, alone.event), (None, Event::Exiting { status: 3 }));
    }

    #[test]
    fn a_child_writes_its_events_into_the_pipe_and_the_reader_sees_them_end() {
        let pipe = Pipe::new().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo '{"time":1.0,"event":"exiting","status":0}' > "$TRAINERD_EVENTS"; echo noise >&3"#]);
        pipe.hand_to(&mut cmd);
        let mut child = cmd.spawn().unwrap();
        let got: Vec<Record> = records(pipe.into_reader()).collect();
        child.wait().unwrap();
        assert_eq!(got.iter().map(|r| r.event.clone()).collect::<Vec<_>>(), [Event::Exiting { status: 0 }]);
    }
}
