//! Files the daemon trusts with its process: a plugin (code it runs) and the cluster secret.
//! Another user able to write one could run code as trainerd or join its cluster, so such files
//! are refused, with the command that fixes them.

use std::path::{Path, PathBuf};

/// Why a file is not trusted, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TrustError {
    /// Another user owns it.
    #[error("owned by uid {owner}, neither this user (uid {me}) nor root")]
    Owner {
        /// Its owner.
        owner: u32,
        /// This process's user.
        me: u32,
    },
    /// Others can write it.
    #[error("{who} can write it (mode {mode:04o}); run `chmod go-w {}`", path.display())]
    Writable {
        /// "every user" or "its group".
        who: &'static str,
        /// Its mode.
        mode: u32,
        /// The file.
        path: PathBuf,
    },
    /// Every user can read a file that must stay private.
    #[error("every user can read it (mode {mode:04o}); run `chmod 600 {}`", path.display())]
    Readable {
        /// Its mode.
        mode: u32,
        /// The file.
        path: PathBuf,
    },
    /// Its directory lets others replace it.
    #[error(
        "its directory {} lets other users replace it (mode {mode:04o}); move it, or run `chmod go-w {}`",
        dir.display(),
        dir.display()
    )]
    ReplaceableDir {
        /// The directory.
        dir: PathBuf,
        /// Its mode.
        mode: u32,
    },
    /// It cannot be read.
    #[error("cannot read it: {0}")]
    Unreadable(#[source] std::io::Error),
    /// Its metadata cannot be read.
    #[error("{0}")]
    Metadata(#[source] std::io::Error),
    /// Its directory's metadata cannot be read.
    #[error("{}: {source}", dir.display())]
    DirMetadata {
        /// The directory.
        dir: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// A secret that is not a regular file.
    #[error("not a regular file")]
    NotAFile,
    /// A secret too short to be one.
    #[error("holds {len} byte(s); {what} needs at least {min}{hint}")]
    Short {
        /// Its bytes.
        len: usize,
        /// What it is ("a cluster secret").
        what: &'static str,
        /// The bytes it needs.
        min: usize,
        /// How to make one.
        hint: &'static str,
    },
}

/// Refuses a file that another user could have written (or, with `private`, could read): the
/// owner must be this user or root, and group and others must not write it (`private`: nor
/// read it, beyond the group). The error says how to fix it.
pub(crate) fn check_file(path: &Path, meta: &std::fs::Metadata, private: bool) -> Result<(), TrustError> {
    use std::os::unix::fs::MetadataExt;
    let mode = meta.mode() & 0o7777;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(TrustError::Owner { owner: meta.uid(), me });
    }
    if mode & 0o022 != 0 {
        let who = if mode & 0o002 != 0 { "every user" } else { "its group" };
        return Err(TrustError::Writable { who, mode, path: path.to_path_buf() });
    }
    if private && mode & 0o004 != 0 {
        return Err(TrustError::Readable { mode, path: path.to_path_buf() });
    }
    Ok(())
}

/// The trimmed contents of a secret file (surrounding white space, such as a trailing newline,
/// is not part of it): a regular file that passes [`check_file`] as private and holds at least
/// `min` bytes; `what` names it in the error, `hint` says how to make one.
pub(crate) fn read_secret(
    path: &Path,
    what: &'static str,
    min: usize,
    hint: &'static str,
) -> Result<Vec<u8>, TrustError> {
    let meta = std::fs::metadata(path).map_err(TrustError::Unreadable)?;
    if !meta.is_file() {
        return Err(TrustError::NotAFile);
    }
    check_file(path, &meta, true)?;
    let bytes = std::fs::read(path).map_err(TrustError::Unreadable)?;
    let secret = bytes.trim_ascii();
    if secret.len() < min {
        return Err(TrustError::Short { len: secret.len(), what, min, hint });
    }
    Ok(secret.to_vec())
}

/// [`check_file`] for a file that is code: also refuses it when its directory lets others
/// replace it (writable by group or others, without the sticky bit).
pub(crate) fn check_code(path: &Path) -> Result<(), TrustError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(TrustError::Metadata)?;
    check_file(path, &meta, false)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dir_meta =
        std::fs::metadata(dir).map_err(|source| TrustError::DirMetadata { dir: dir.to_path_buf(), source })?;
    let mode = dir_meta.mode() & 0o7777;
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(TrustError::ReplaceableDir { dir: dir.to_path_buf(), mode });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn code_others_can_write_or_replace_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("libp.so");
        std::fs::write(&file, b"x").unwrap();
        let chmod = |p: &Path, mode| std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        chmod(&file, 0o755);
        check_code(&file).unwrap();
        chmod(&file, 0o775);
        let f = file.display();
        assert_eq!(
            check_code(&file).unwrap_err().to_string(),
            format!("its group can write it (mode 0775); run `chmod go-w {f}`")
        );
        chmod(&file, 0o755);
        chmod(dir.path(), 0o777);
        let d = dir.path().display();
        assert_eq!(
            check_code(&file).unwrap_err().to_string(),
            format!("its directory {d} lets other users replace it (mode 0777); move it, or run `chmod go-w {d}`")
        );
        chmod(dir.path(), 0o1777);
        check_code(&file).expect("a sticky directory (as /tmp) keeps others from replacing it");
        chmod(dir.path(), 0o700);
    }
}
