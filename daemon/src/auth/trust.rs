//! Files the daemon trusts with its process: a plugin (code it runs) and the cluster secret.
//! Another user able to write one could run code as trainerd or join its cluster, so such files
//! are refused, with the command that fixes them.

use std::path::Path;

/// Refuses a file that another user could have written (or, with `private`, could read): the
/// owner must be this user or root, and group and others must not write it (`private`: nor
/// read it, beyond the group). The message says how to fix it.
pub fn check_file(path: &Path, meta: &std::fs::Metadata, private: bool) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let mode = meta.mode() & 0o7777;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(format!("owned by uid {}, neither this user (uid {me}) nor root", meta.uid()));
    }
    if mode & 0o022 != 0 {
        let who = if mode & 0o002 != 0 { "every user" } else { "its group" };
        return Err(format!("{who} can write it (mode {mode:04o}); run `chmod go-w {}`", path.display()));
    }
    if private && mode & 0o004 != 0 {
        return Err(format!("every user can read it (mode {mode:04o}); run `chmod 600 {}`", path.display()));
    }
    Ok(())
}

/// The trimmed contents of a secret file (surrounding white space, such as a trailing newline,
/// is not part of it): a regular file that passes [`check_file`] as private and holds at least
/// `min` bytes; `what` names it in the error, `hint` says how to make one.
pub fn read_secret(path: &Path, what: &str, min: usize, hint: &str) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    check_file(path, &meta, true)?;
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
    let secret = bytes.trim_ascii();
    if secret.len() < min {
        return Err(format!("holds {} byte(s); {what} needs at least {min}{hint}", secret.len()));
    }
    Ok(secret.to_vec())
}

/// [`check_file`] for a file that is code: also refuses it when its directory lets others
/// replace it (writable by group or others, without the sticky bit).
pub fn check_code(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    check_file(path, &meta, false)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dir_meta = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mode = dir_meta.mode() & 0o7777;
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "its directory {} lets other users replace it (mode {mode:04o}); move it, or run `chmod go-w {}`",
            dir.display(),
            dir.display()
        ));
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
        assert_eq!(check_code(&file), Ok(()));
        chmod(&file, 0o775);
        let f = file.display();
        assert_eq!(check_code(&file).unwrap_err(), format!("its group can write it (mode 0775); run `chmod go-w {f}`"));
        chmod(&file, 0o755);
        chmod(dir.path(), 0o777);
        let d = dir.path().display();
        assert_eq!(
            check_code(&file).unwrap_err(),
            format!("its directory {d} lets other users replace it (mode 0777); move it, or run `chmod go-w {d}`")
        );
        chmod(dir.path(), 0o1777);
        assert_eq!(check_code(&file), Ok(()), "a sticky directory (as /tmp) keeps others from replacing it");
        chmod(dir.path(), 0o700);
    }
}
