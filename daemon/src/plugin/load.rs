//! Loading a plugin library and checking its header before anything in it is called.
//!
//! The order matters: the file must exist, load as a shared library, export the entry symbol,
//! and carry a header whose stable prefix (magic, ABI version, size) and build facts (sdk, tch,
//! libtorch, target, panic strategy) match this daemon's. Only then is the vtable trusted.
//! A loaded library is never unloaded: tensors and static data from it may outlive any handle.

use std::path::{Path, PathBuf};

use trainerd_sdk::abi::{
    EntryFn, PluginHeader, PluginVTable, StrRef, ABI_VERSION, ENTRY_SYMBOL, LIBTORCH_VERSION, MAGIC, SDK_VERSION,
    TARGET, TCH_VERSION,
};

/// Why a plugin was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoadError {
    /// Nothing at the path.
    #[error("plugin {path}: no such file")]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// Another user could have written the file (or replaced it).
    #[error("plugin {path}: refused: {why} (whoever can write a plugin runs code as trainerd)")]
    Untrusted {
        /// The path given.
        path: PathBuf,
        /// Who can write it, and the fix.
        #[source]
        why: crate::auth::trust::TrustError,
    },
    /// The dynamic loader refused the file.
    #[error("plugin {path}: not a loadable shared library: {reason}")]
    NotALibrary {
        /// The path given.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// A shared library without the entry symbol.
    #[error(
        "plugin {path}: not a trainerd plugin (it exports no `{ENTRY_SYMBOL}` symbol); build the model crate \
         as a cdylib that calls trainerd_sdk::export_plugin!"
    )]
    NotAPlugin {
        /// The path given.
        path: PathBuf,
    },
    /// A build fact differs from this daemon's.
    #[error(
        "plugin {path}: {field} is {found}, this trainerd expects {expected}; rebuild the plugin against \
         trainerd-sdk {SDK_VERSION} (tch {TCH_VERSION}, libtorch {LIBTORCH_VERSION}, target {TARGET})"
    )]
    Mismatch {
        /// The path given.
        path: PathBuf,
        /// Which fact.
        field: &'static str,
        /// The plugin's value.
        found: String,
        /// This daemon's value.
        expected: String,
    },
    /// A plugin that would abort the daemon on any panic.
    #[error(
        "plugin {path}: built with panic = \"abort\"; trainerd needs panic = \"unwind\" so that a panic in the \
         plugin becomes an error instead of killing the daemon: remove `panic = \"abort\"` from the plugin's \
         Cargo profile and rebuild"
    )]
    PanicAbort {
        /// The path given.
        path: PathBuf,
    },
    /// The plugin refused its arguments (an unknown key, a bad value, a file it cannot use).
    #[error("plugin {path}: {message}")]
    Refused {
        /// The path given.
        path: PathBuf,
        /// The plugin's reason.
        message: String,
    },
    /// A header without its table of functions.
    #[error("plugin {path}: header has no vtable")]
    NoVtable {
        /// The path given.
        path: PathBuf,
    },
    /// An argument the plugin does not take.
    #[error("plugin {path}: {source}")]
    Arguments {
        /// The path given.
        path: PathBuf,
        /// Which, and the keys it takes.
        source: trainerd_sdk::ArgError,
    },
    /// The plugin's self-description (info, arguments) is not JSON of the SDK's.
    #[error("plugin {path}: {what} not valid: {source}: {json}")]
    BadJson {
        /// The path given.
        path: PathBuf,
        /// "info is", "its arguments are".
        what: &'static str,
        /// Why it does not read.
        source: serde_json::Error,
        /// What the plugin said.
        json: String,
    },
    /// The plugin failed to say which arguments it takes.
    #[error("plugin {path}: arguments failed: {message}")]
    NoArguments {
        /// The path given.
        path: PathBuf,
        /// The plugin's reason.
        message: String,
    },
    /// A column the plugin declares makes no sense.
    #[error("plugin {path}: its column `{column}` is declared wrongly: {source}")]
    BadColumn {
        /// The path given.
        path: PathBuf,
        /// The column.
        column: String,
        /// What is wrong with it.
        source: trainerd_sdk::DeclarationError,
    },
}

/// The build facts a header carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BuildFacts {
    /// ABI version.
    pub(crate) abi_version: u32,
    /// trainerd-sdk version.
    pub(crate) sdk_version: String,
    /// tch version.
    pub(crate) tch_version: String,
    /// libtorch version.
    pub(crate) libtorch_version: String,
    /// Target triple.
    pub(crate) target: String,
    /// `unwind` or `abort`.
    pub(crate) panic_strategy: String,
}

/// Loads the library at `path`, checks its header, and returns its vtable and build facts.
pub(super) fn open(path: &Path) -> Result<(&'static PluginVTable, BuildFacts), LoadError> {
    let path_buf = || path.to_path_buf();
    if !path.exists() {
        return Err(LoadError::NotFound { path: path_buf() });
    }
    crate::auth::trust::check_code(path).map_err(|why| LoadError::Untrusted { path: path_buf(), why })?;
    // SAFETY: loading runs the library's initialisers; a plugin is code the operator chose to
    // run. `plugin check` does this in a child process for untrusted files.
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|e| LoadError::NotALibrary { path: path_buf(), reason: loader_reason(&e) })?;
    // Never unloaded: see the module docs.
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    // SAFETY: the symbol's type is fixed by the ABI; a library that exports the name with
    // another type is not a trainerd plugin and is on its own.
    let entry = unsafe { lib.get::<EntryFn>(ENTRY_SYMBOL.as_bytes()) }
        .map_err(|_| LoadError::NotAPlugin { path: path_buf() })?;
    // SAFETY: calling the entry point as the ABI defines it.
    let header: *const PluginHeader = unsafe { entry() };
    if header.is_null() {
        return Err(LoadError::NotAPlugin { path: path_buf() });
    }
    // SAFETY: a non-null header returned by the plugin's entry point, static data of the (never
    // unloaded) plugin.
    let header = unsafe { checked_header(header, path)? };
    let facts = check_facts(header, path)?;
    if header.vtable.is_null() {
        return Err(LoadError::NoVtable { path: path_buf() });
    }
    // SAFETY: checked non-null; static data of the plugin.
    Ok((unsafe { &*header.vtable }, facts))
}

fn mismatch(path: &Path, field: &'static str, found: String, expected: String) -> LoadError {
    LoadError::Mismatch { path: path.to_path_buf(), field, found, expected }
}

/// The header, once its magic, ABI version and size say it has this daemon's layout.
///
/// # Safety
/// `header` must point to a plugin's static header, valid for as long as the process lives.
unsafe fn checked_header(header: *const PluginHeader, path: &Path) -> Result<&'static PluginHeader, LoadError> {
    // SAFETY: the prefix (magic, abi_version, header_size) has the same layout in every ABI
    // version, so it can be read before the version is known.
    let (magic, abi_version, header_size) = unsafe { ((*header).magic, (*header).abi_version, (*header).header_size) };
    if magic != MAGIC {
        let show = |m: &[u8]| format!("{:?}", String::from_utf8_lossy(m));
        return Err(mismatch(path, "header magic", show(&magic), show(&MAGIC)));
    }
    if abi_version != ABI_VERSION {
        return Err(mismatch(path, "ABI version", abi_version.to_string(), ABI_VERSION.to_string()));
    }
    let expected_size = std::mem::size_of::<PluginHeader>() as u32;
    if header_size != expected_size {
        return Err(mismatch(path, "header size", header_size.to_string(), expected_size.to_string()));
    }
    // SAFETY: magic, ABI version and size match, so the whole header has this layout.
    Ok(unsafe { &*header })
}

/// The header's build facts, checked against this daemon's: the SDK (Cargo's compatibility
/// rule), tch, libtorch and the target must match, and panics must unwind.
fn check_facts(header: &'static PluginHeader, path: &Path) -> Result<BuildFacts, LoadError> {
    // SAFETY: the header's strings are static data of the (never unloaded) plugin.
    let text = |s: StrRef| unsafe { s.to_string_lossy() };
    let facts = BuildFacts {
        abi_version: header.abi_version,
        sdk_version: text(header.sdk_version),
        tch_version: text(header.tch_version),
        libtorch_version: text(header.libtorch_version),
        target: text(header.target),
        panic_strategy: text(header.panic_strategy),
    };
    if !sdk_compatible(&facts.sdk_version, SDK_VERSION) {
        return Err(mismatch(path, "trainerd-sdk version", facts.sdk_version, SDK_VERSION.into()));
    }
    for (field, found, expected) in [
        ("tch version", &facts.tch_version, TCH_VERSION),
        ("libtorch version", &facts.libtorch_version, LIBTORCH_VERSION),
        ("target", &facts.target, TARGET),
    ] {
        if found != expected {
            return Err(mismatch(path, field, found.clone(), expected.into()));
        }
    }
    if facts.panic_strategy != "unwind" {
        return Err(LoadError::PanicAbort { path: path.to_path_buf() });
    }
    Ok(facts)
}

/// Cargo's rule: same major version, and for 0.x the same minor version.
fn sdk_compatible(found: &str, expected: &str) -> bool {
    let key = |v: &str| {
        let mut parts = v.split('.');
        let major = parts.next().unwrap_or("").to_string();
        let minor = parts.next().unwrap_or("").to_string();
        if major == "0" {
            (major, minor)
        } else {
            (major, String::new())
        }
    };
    key(found) == key(expected)
}

/// libloading's message, without the repeated path that dlerror puts in front.
fn loader_reason(e: &libloading::Error) -> String {
    let text = match e {
        libloading::Error::DlOpen { desc } => format!("{desc:?}"),
        other => other.to_string(),
    };
    let text = text.trim_matches('"').to_string();
    match text.split_once(": ") {
        Some((first, rest)) if first.contains('/') => rest.to_string(),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdk_versions_follow_cargo_compatibility() {
        assert!(sdk_compatible("0.1.0", "0.1.7"));
        assert!(!sdk_compatible("0.2.0", "0.1.0"));
        assert!(sdk_compatible("1.2.0", "1.0.0"));
        assert!(!sdk_compatible("2.0.0", "1.0.0"));
    }
}
