//! The CPU kernel set libtorch runs (its *capability*: plain, AVX2 or AVX-512 kernels on x86-64),
//! which decides the bits of every CPU computation: the same run rounds differently on AVX2 and
//! on plain kernels. libtorch resolves it once per process, at the first kernel, from
//! `ATEN_CPU_CAPABILITY` or else from the CPU. A run pins one for all its members (the highest
//! every member runs, recorded in the state and so in every commit); a process whose libtorch
//! resolved a higher one starts itself again with the variable set ([`restart_with`]), one that
//! cannot run the run's is refused (docs/fault-tolerance.md, "One kernel set per run").

use std::os::unix::process::CommandExt;

/// libtorch's variable.
pub(crate) const VARIABLE: &str = "ATEN_CPU_CAPABILITY";
/// Set by trainerd on the process it starts again with the run's capability.
const PINNED: &str = "TRAINERD_PINNED_CPU_CAPABILITY";

/// A CPU kernel set, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Capability {
    /// Plain (SSE) kernels.
    Default,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-512 (F, VL, BW, DQ) and FMA.
    Avx512,
}

impl Capability {
    const ALL: [Capability; 3] = [Capability::Default, Capability::Avx2, Capability::Avx512];

    /// libtorch's name (`torch.backends.cpu.get_cpu_capability()`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Capability::Default => "DEFAULT",
            Capability::Avx2 => "AVX2",
            Capability::Avx512 => "AVX512",
        }
    }

    /// The value of `ATEN_CPU_CAPABILITY` that selects it.
    pub(crate) fn variable(self) -> &'static str {
        match self {
            Capability::Default => "default",
            Capability::Avx2 => "avx2",
            Capability::Avx512 => "avx512",
        }
    }

    /// From libtorch's name or the variable's value.
    pub(crate) fn parse(s: &str) -> Option<Capability> {
        Capability::ALL.into_iter().find(|c| s.eq_ignore_ascii_case(c.name()))
    }

    /// A small number for an exchange (0 is left for "unknown").
    pub(crate) fn code(self) -> u8 {
        self as u8 + 1
    }

    /// The capability of [`Capability::code`].
    pub(crate) fn from_code(code: u8) -> Option<Capability> {
        Capability::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// The CPU features it needs, as `/proc/cpuinfo` names them.
    fn needs(self) -> &'static [&'static str] {
        match self {
            Capability::Default => &[],
            Capability::Avx2 => &["avx2", "fma"],
            Capability::Avx512 => &["avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"],
        }
    }
}

/// Whether this CPU has the feature `name`.
#[cfg(target_arch = "x86_64")]
fn has(name: &str) -> bool {
    match name {
        "avx2" => std::arch::is_x86_feature_detected!("avx2"),
        "fma" => std::arch::is_x86_feature_detected!("fma"),
        "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
        "avx512vl" => std::arch::is_x86_feature_detected!("avx512vl"),
        "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
        "avx512dq" => std::arch::is_x86_feature_detected!("avx512dq"),
        _ => false,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn has(_: &str) -> bool {
    false
}

/// Why a capability cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CpuError {
    /// The variable names no capability.
    #[error("{VARIABLE}={value}: expected default, avx2 or avx512")]
    Unknown {
        /// Its value.
        value: String,
    },
    /// The variable names kernels this CPU cannot run (libtorch would die of an illegal
    /// instruction).
    #[error("{VARIABLE}={value}: this CPU cannot run {} kernels (it lacks {missing}); the most it runs is {}", wanted.name(), most.name())]
    Unsupported {
        /// The variable's value.
        value: String,
        /// What it selects.
        wanted: Capability,
        /// The features missing.
        missing: String,
        /// The most this CPU runs.
        most: Capability,
    },
    /// libtorch could not say.
    #[error("libtorch did not say which CPU kernels it runs")]
    Unreadable,
    /// Started again with the run's capability, libtorch resolved another.
    #[error("started again with {VARIABLE}={}, libtorch still runs {} kernels", wanted.variable(), found.name())]
    NotTaken {
        /// The run's.
        wanted: Capability,
        /// libtorch's.
        found: Capability,
    },
    /// The process could not start itself again.
    #[error("starting this process again with {VARIABLE}={}: {source}", wanted.variable())]
    Exec {
        /// The run's.
        wanted: Capability,
        /// Why.
        source: std::io::Error,
    },
}

/// The most this CPU runs.
pub(crate) fn hardware() -> Capability {
    let runs = |c: &Capability| c.needs().iter().all(|f| has(f));
    Capability::ALL.into_iter().rev().find(runs).unwrap_or(Capability::Default)
}

/// Checks `ATEN_CPU_CAPABILITY` before libtorch reads it: a value it does not know, or kernels
/// this CPU cannot run, is an error naming both.
pub(crate) fn check_variable() -> Result<(), CpuError> {
    let Ok(value) = std::env::var(VARIABLE) else { return Ok(()) };
    let wanted = Capability::parse(&value).ok_or_else(|| CpuError::Unknown { value: value.clone() })?;
    let missing: Vec<&str> = wanted.needs().iter().copied().filter(|f| !has(f)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(CpuError::Unsupported { value, wanted, missing: missing.join(", "), most: hardware() })
}

unsafe extern "C" {
    fn trainerd_cpu_capability(out: *mut std::ffi::c_char, len: std::ffi::c_int) -> std::ffi::c_int;
}

/// The kernels libtorch runs in this process (resolving them if no kernel ran yet); `None` for
/// a kind trainerd does not know (another architecture's: nothing is pinned there).
pub(crate) fn resolved() -> Result<Option<Capability>, CpuError> {
    let mut out = [0 as std::ffi::c_char; 64];
    // SAFETY: the shim writes at most `out.len()` bytes, NUL-terminated.
    if unsafe { trainerd_cpu_capability(out.as_mut_ptr(), out.len() as std::ffi::c_int) } != 0 {
        return Err(CpuError::Unreadable);
    }
    // SAFETY: NUL-terminated by the shim.
    let name = unsafe { std::ffi::CStr::from_ptr(out.as_ptr()) }.to_string_lossy();
    Ok(Capability::parse(&name))
}

/// How the kernels were chosen, for the start-up line.
pub(crate) fn describe(resolved: Option<Capability>) -> String {
    let Some(c) = resolved else { return "CPU kernels: not pinned on this architecture".into() };
    let why = match (std::env::var(PINNED), std::env::var(VARIABLE)) {
        (Ok(_), _) => "the run's, pinned by trainerd".to_string(),
        (_, Ok(v)) => format!("{VARIABLE}={v}"),
        _ => "the most this CPU runs".to_string(),
    };
    format!("CPU kernels: {} ({why})", c.name())
}

/// How this process's kernels were chosen ("ATEN_CPU_CAPABILITY=default", "the most this CPU
/// runs"), and what would let it run `run`'s.
pub(crate) fn refusal(run: Capability) -> (String, String) {
    let why = match std::env::var(VARIABLE) {
        Ok(v) => format!("{VARIABLE}={v}"),
        Err(_) => "the most this CPU runs".to_string(),
    };
    let hint = if run <= hardware() {
        format!("This CPU runs them: unset {VARIABLE}, or set it to {}.", run.variable())
    } else {
        format!("Run it on a CPU that runs {} kernels.", run.name())
    };
    (why, hint)
}

/// Starts this process again (the same process id, arguments and environment) with libtorch's
/// kernels set to `wanted`; returns only on failure.
pub(crate) fn restart_with(wanted: Capability, found: Capability) -> CpuError {
    if std::env::var(PINNED).is_ok_and(|v| v == wanted.variable()) {
        return CpuError::NotTaken { wanted, found };
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(source) => return CpuError::Exec { wanted, source },
    };
    let source = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(VARIABLE, wanted.variable())
        .env(PINNED, wanted.variable())
        .exec();
    CpuError::Exec { wanted, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_codes_go_both_ways_in_order() {
        for c in Capability::ALL {
            assert_eq!(Capability::parse(c.name()), Some(c));
            assert_eq!(Capability::parse(c.variable()), Some(c));
            assert_eq!(Capability::from_code(c.code()), Some(c));
        }
        assert!(Capability::Default < Capability::Avx2 && Capability::Avx2 < Capability::Avx512);
        assert_eq!((Capability::parse("sve256"), Capability::from_code(0)), (None, None));
    }

    #[test]
    fn libtorch_resolves_what_this_cpu_runs_at_most() {
        // No test of this binary sets the variable: libtorch picks by the CPU, as we do.
        if std::env::var(VARIABLE).is_err() {
            assert_eq!(resolved().unwrap(), Some(hardware()));
        }
    }
}
