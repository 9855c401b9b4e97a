//! `TF_CONFIG`, read exactly as TensorFlow's `TFConfigClusterResolver` reads it, for
//! MultiWorkerMirroredStrategy: `cluster` maps job names to lists of `host:port`; `task` names
//! this process's job and index; the chief is the `chief` task if there is one, else worker 0.
//!
//! Training members are the chief (if any) and the workers, ranked chief first, then workers in
//! index order. `ps` (parameter-server training) and an `evaluator` task are refused. Every
//! error names the field and the value. No I/O here: [`parse`] is a pure function.

use std::collections::BTreeMap;

use serde_json::Value;

/// One training member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Member {
    /// `chief` or `worker`.
    pub(crate) job: String,
    /// Index within the job.
    pub(crate) index: usize,
    /// `host:port` of its control plane.
    pub(crate) address: String,
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.job, self.index, self.address)
    }
}

/// A parsed cluster, from this process's point of view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClusterConfig {
    /// Training members in rank order (rank 0 is the chief).
    pub(crate) members: Vec<Member>,
    /// This process's rank.
    pub(crate) rank: usize,
    /// The `cluster` object as given (job -> addresses), for comparing with peers.
    pub(crate) jobs: BTreeMap<String, Vec<String>>,
}

impl ClusterConfig {
    /// Number of training members.
    pub(crate) fn world_size(&self) -> usize {
        self.members.len()
    }

    /// This process.
    pub(crate) fn me(&self) -> &Member {
        &self.members[self.rank]
    }

    /// The `cluster` object as canonical JSON (sorted keys).
    pub(crate) fn cluster_json(&self) -> String {
        serde_json::to_string(&self.jobs).expect("strings serialize")
    }
}

/// A `TF_CONFIG` that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}: {problem}")]
pub(crate) struct TfConfigError {
    /// Where the config came from (`TF_CONFIG` or `--tf-config`).
    pub(crate) source_name: String,
    /// What is wrong, naming the field and value.
    #[source]
    pub(crate) problem: Problem,
}

/// What is wrong with a `TF_CONFIG`, naming the field and the value (shortened, as JSON).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Problem {
    /// Not JSON.
    #[error("invalid JSON: {0}")]
    Json(#[source] serde_json::Error),
    /// JSON, not an object.
    #[error("expected a JSON object with \"cluster\" and \"task\", got {got}")]
    NotAnObject {
        /// What it is.
        got: String,
    },
    /// A `cluster` that is not an object.
    #[error("\"cluster\" must be an object of job -> [\"host:port\", ...], got {got}")]
    ClusterNotAnObject {
        /// What it is.
        got: String,
    },
    /// A `task` without a `cluster`.
    #[error("\"task\" is set but \"cluster\" is missing or empty")]
    TaskWithoutCluster,
    /// A job TensorFlow does not have.
    #[error("unknown job type {job:?} in \"cluster\" (expected chief, worker, ps or evaluator)")]
    UnknownJob {
        /// The job.
        job: String,
    },
    /// A job whose tasks are not a list.
    #[error("cluster.{job} must be a list of \"host:port\" strings, got {got}")]
    JobNotAList {
        /// The job.
        job: String,
        /// What it is.
        got: String,
    },
    /// A task address that is not a string.
    #[error("cluster.{job}[{index}] must be a \"host:port\" string, got {got}")]
    AddressNotAString {
        /// The job.
        job: String,
        /// The task's index.
        index: usize,
        /// What it is.
        got: String,
    },
    /// A task address that is not `host:port`.
    #[error("cluster.{job}[{index}]: {address:?} is not host:port ({why})")]
    BadAddress {
        /// The job.
        job: String,
        /// The task's index.
        index: usize,
        /// The address.
        address: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// One address for two tasks.
    #[error("address {address} appears twice in \"cluster\" ({first} and {second})")]
    DuplicateAddress {
        /// The address.
        address: String,
        /// The first task with it.
        first: String,
        /// The second.
        second: String,
    },
    /// Parameter servers.
    #[error(
        "parameter-server training is not supported (\"cluster\" has a \"ps\" job); trainerd trains with \
         synchronous all-reduce among chief and worker tasks"
    )]
    ParameterServers,
    /// More than one chief.
    #[error("cluster.chief has {count} tasks; a cluster has at most one chief")]
    Chiefs {
        /// Tasks of the chief job.
        count: usize,
    },
    /// No `task`.
    #[error("missing \"task\" (expected {{\"type\": \"worker\", \"index\": N}})")]
    MissingTask,
    /// A `task` that is not an object.
    #[error("\"task\" must be an object, got {got}")]
    TaskNotAnObject {
        /// What it is.
        got: String,
    },
    /// No `task.type`.
    #[error("task.type is missing (expected \"chief\" or \"worker\")")]
    MissingType,
    /// A `task.type` that is not a string.
    #[error("task.type must be a string, got {got}")]
    TypeNotAString {
        /// What it is.
        got: String,
    },
    /// A `task.index` that is not an index.
    #[error("task.index must be a non-negative integer, got {got}")]
    BadIndex {
        /// What it is.
        got: String,
    },
    /// An evaluator task.
    #[error(
        "task.type \"evaluator\" is not supported: every worker evaluates on the test split after each epoch, so no \
         evaluator task is needed"
    )]
    Evaluator,
    /// A parameter-server task.
    #[error("task.type \"ps\": parameter-server training is not supported")]
    ParameterServerTask,
    /// Another task type.
    #[error("unknown task.type {task_type:?} (expected \"chief\" or \"worker\")")]
    UnknownTaskType {
        /// The type.
        task_type: String,
    },
    /// An index beyond the job's tasks.
    #[error("task index {index} is out of range: cluster.{job} has {count} task{}", if *count == 1 { "" } else { "s" })]
    IndexOutOfRange {
        /// The index.
        index: usize,
        /// The job.
        job: String,
        /// Its tasks.
        count: usize,
    },
}

const JOBS: [&str; 4] = ["chief", "worker", "ps", "evaluator"];

/// Parses a TF_CONFIG text. `Ok(None)` means no cluster (an empty object, or no `cluster` and no
/// `task`): train on one worker. `source_name` prefixes errors.
pub(crate) fn parse(text: &str, source_name: &str) -> Result<Option<ClusterConfig>, TfConfigError> {
    parse_text(text).map_err(|problem| TfConfigError { source_name: source_name.to_string(), problem })
}

fn parse_text(text: &str) -> Result<Option<ClusterConfig>, Problem> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let value: Value = serde_json::from_str(text).map_err(Problem::Json)?;
    let Value::Object(top) = value else { return Err(Problem::NotAnObject { got: brief(&value) }) };
    let task = top.get("task");
    let cluster = match top.get("cluster") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m).filter(|m| !m.is_empty()),
        Some(other) => return Err(Problem::ClusterNotAnObject { got: brief(other) }),
    };
    let Some(cluster) = cluster else {
        return match task {
            None | Some(Value::Null) => Ok(None),
            Some(_) => Err(Problem::TaskWithoutCluster),
        };
    };
    let jobs = jobs(cluster)?;
    let (task_type, index) = task_of(task, &jobs)?;
    let mut members = Vec::new();
    for job in ["chief", "worker"] {
        for (i, address) in jobs.get(job).into_iter().flatten().enumerate() {
            members.push(Member { job: job.into(), index: i, address: address.clone() });
        }
    }
    let rank = members.iter().position(|m| m.job == task_type && m.index == index).expect("validated above");
    Ok(Some(ClusterConfig { members, rank, jobs }))
}

/// The `cluster` object's jobs and addresses, checked: known jobs, `host:port` strings, no address
/// twice, no `ps`, at most one chief.
fn jobs(cluster: &serde_json::Map<String, Value>) -> Result<BTreeMap<String, Vec<String>>, Problem> {
    let mut jobs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    for (job, list) in cluster {
        if !JOBS.contains(&job.as_str()) {
            return Err(Problem::UnknownJob { job: job.clone() });
        }
        let Value::Array(list) = list else { return Err(Problem::JobNotAList { job: job.clone(), got: brief(list) }) };
        let mut addresses = Vec::new();
        for (index, entry) in list.iter().enumerate() {
            let Value::String(address) = entry else {
                return Err(Problem::AddressNotAString { job: job.clone(), index, got: brief(entry) });
            };
            check_address(address).map_err(|why| Problem::BadAddress {
                job: job.clone(),
                index,
                address: address.clone(),
                why,
            })?;
            let name = format!("{job} {index}");
            if let Some(first) = seen.insert(address.clone(), name.clone()) {
                return Err(Problem::DuplicateAddress { address: address.clone(), first, second: name });
            }
            addresses.push(address.clone());
        }
        jobs.insert(job.clone(), addresses);
    }
    if jobs.get("ps").is_some_and(|p| !p.is_empty()) {
        return Err(Problem::ParameterServers);
    }
    let count = jobs.get("chief").map_or(0, Vec::len);
    if count > 1 {
        return Err(Problem::Chiefs { count });
    }
    Ok(jobs)
}

/// This process's `task`: its job (`chief` or `worker`) and index, checked against `jobs`.
fn task_of<'t>(task: Option<&'t Value>, jobs: &BTreeMap<String, Vec<String>>) -> Result<(&'t str, usize), Problem> {
    let task = match task {
        None | Some(Value::Null) => return Err(Problem::MissingTask),
        Some(Value::Object(t)) => t,
        Some(other) => return Err(Problem::TaskNotAnObject { got: brief(other) }),
    };
    let task_type = match task.get("type") {
        Some(Value::String(t)) => t.as_str(),
        None => return Err(Problem::MissingType),
        Some(other) => return Err(Problem::TypeNotAString { got: brief(other) }),
    };
    let index = match task.get("index") {
        None => 0, // TensorFlow's default
        Some(v) => v.as_u64().ok_or_else(|| Problem::BadIndex { got: brief(v) })? as usize,
    };
    match task_type {
        "evaluator" => return Err(Problem::Evaluator),
        "chief" | "worker" => {}
        "ps" => return Err(Problem::ParameterServerTask),
        other => return Err(Problem::UnknownTaskType { task_type: other.into() }),
    }
    let count = jobs.get(task_type).map_or(0, Vec::len);
    if index >= count {
        return Err(Problem::IndexOutOfRange { index, job: task_type.into(), count });
    }
    Ok((task_type, index))
}

/// `host:port` with a non-empty host (a name, IPv4, or bracketed IPv6) and a port 1-65535.
fn check_address(address: &str) -> Result<(), &'static str> {
    let (host, port) = address.rsplit_once(':').ok_or("no port")?;
    if host.is_empty() {
        return Err("empty host");
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err("an IPv6 host must be in brackets");
    }
    if host.chars().any(char::is_whitespace) {
        return Err("whitespace in host");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err("port must be 1-65535"),
    }
}

fn brief(v: &Value) -> String {
    let text = v.to_string();
    if text.len() > 60 {
        format!("{}...", &text[..text.char_indices().nth(57).map_or(text.len(), |(i, _)| i)])
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(text: &str) -> Result<Option<ClusterConfig>, TfConfigError> {
        parse(text, "TF_CONFIG")
    }

    #[test]
    fn tutorial_config() {
        let c = p(r#"{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 1}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(c.world_size(), 2);
        assert_eq!(c.rank, 1);
        assert_eq!(c.members[0], Member { job: "worker".into(), index: 0, address: "localhost:12345".into() });
        assert_eq!(c.me().to_string(), "worker 1 (localhost:23456)");
    }

    #[test]
    fn chief_task_is_rank_zero() {
        let c = p(
            r#"{"cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.members.iter().map(|m| m.address.as_str()).collect::<Vec<_>>(), ["h0:1", "h1:1", "h2:1"]);
        assert_eq!(c.rank, 1);
    }

    #[test]
    fn no_cluster_means_one_worker() {
        assert_eq!(p("").unwrap(), None);
        assert_eq!(p("{}").unwrap(), None);
        assert_eq!(p(r#"{"cluster": {}}"#).unwrap(), None);
    }

    #[test]
    fn errors_name_field_and_value() {
        let cases = [
            ("{\"cluster\": ", "TF_CONFIG: invalid JSON: EOF while parsing a value at line 1 column 12"),
            ("[1]", "TF_CONFIG: expected a JSON object with \"cluster\" and \"task\", got [1]"),
            (
                r#"{"cluster": {"worker": ["a:1"]}}"#,
                "TF_CONFIG: missing \"task\" (expected {\"type\": \"worker\", \"index\": N})",
            ),
            (
                r#"{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}}"#,
                "TF_CONFIG: task index 2 is out of range: cluster.worker has 2 tasks",
            ),
            (
                r#"{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}"#,
                "TF_CONFIG: address a:1 appears twice in \"cluster\" (worker 0 and worker 1)",
            ),
            (
                r#"{"cluster": {"worker": ["a:1", "localhost"]}, "task": {"type": "worker", "index": 0}}"#,
                "TF_CONFIG: cluster.worker[1]: \"localhost\" is not host:port (no port)",
            ),
            (
                r#"{"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}}"#,
                "TF_CONFIG: cluster.worker[0]: \"a:99999\" is not host:port (port must be 1-65535)",
            ),
            (
                r#"{"cluster": {"master": ["a:1"]}, "task": {"type": "master", "index": 0}}"#,
                "TF_CONFIG: unknown job type \"master\" in \"cluster\" (expected chief, worker, ps or evaluator)",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "boss", "index": 0}}"#,
                "TF_CONFIG: unknown task.type \"boss\" (expected \"chief\" or \"worker\")",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "worker", "index": 0}}"#,
                "TF_CONFIG: parameter-server training is not supported (\"cluster\" has a \"ps\" job); trainerd \
                 trains with synchronous all-reduce among chief and worker tasks",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"], "evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}}"#,
                "TF_CONFIG: task.type \"evaluator\" is not supported: every worker evaluates on the test split \
                 after each epoch, so no evaluator task is needed",
            ),
            (
                r#"{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}"#,
                "TF_CONFIG: cluster.chief has 2 tasks; a cluster has at most one chief",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}"#,
                "TF_CONFIG: task.index must be a non-negative integer, got -1",
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(p(text).unwrap_err().to_string(), expected, "{text}");
        }
    }

    #[test]
    fn evaluator_job_beside_workers_is_ignored_for_workers() {
        let c = p(r#"{"cluster": {"worker": ["a:1"], "evaluator": ["e:1"]}, "task": {"type": "worker", "index": 0}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(c.world_size(), 1);
    }

    fn arb_cluster() -> impl Strategy<Value = (bool, Vec<u16>, usize)> {
        (any::<bool>(), proptest::collection::btree_set(1u16..65535, 1..6)).prop_flat_map(|(chief, ports)| {
            let ports: Vec<u16> = ports.into_iter().collect();
            let n = ports.len();
            (Just(chief), Just(ports), 0..n)
        })
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in ".{0,200}") {
            let _ = parse(&text, "TF_CONFIG");
        }

        /// Any well-formed config parses, ranks the chief first, and finds this task.
        #[test]
        fn valid_configs_parse((with_chief, ports, pick) in arb_cluster()) {
            let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
            let (chief, workers) = if with_chief { (vec![addrs[0].clone()], addrs[1..].to_vec()) } else { (vec![], addrs.clone()) };
            let mut cluster = serde_json::Map::new();
            if with_chief { cluster.insert("chief".into(), serde_json::json!(chief)); }
            cluster.insert("worker".into(), serde_json::json!(workers));
            let (ty, index) = if with_chief && pick == 0 { ("chief", 0) } else { ("worker", pick - usize::from(with_chief)) };
            let text = serde_json::json!({"cluster": cluster, "task": {"type": ty, "index": index}}).to_string();
            let c = parse(&text, "TF_CONFIG").unwrap().unwrap();
            prop_assert_eq!(c.world_size(), addrs.len());
            prop_assert_eq!(&c.me().address, &addrs[pick]);
            prop_assert_eq!(c.members[0].job.as_str(), if with_chief { "chief" } else { "worker" });
            let members: Vec<String> = c.members.iter().map(|m| m.address.clone()).collect();
            prop_assert_eq!(members, addrs);
        }

        /// An index past the end is refused, naming the index and the job's size.
        #[test]
        fn out_of_range_index_is_refused(n in 1usize..5, extra in 0usize..3) {
            let addrs: Vec<String> = (0..n).map(|i| format!("h:{}", 1000 + i)).collect();
            let text = serde_json::json!({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": n + extra}}).to_string();
            let e = parse(&text, "TF_CONFIG").unwrap_err();
            let expected = format!("task index {} is out of range: cluster.worker has {n} task", n + extra);
            let problem = e.problem.to_string();
            prop_assert!(problem.starts_with(&expected), "{}", problem);
        }
    }
}
