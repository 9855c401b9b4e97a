//! Where a dataset lives, as `--data` names it: a local directory (`/path`, `file:///path`) or an
//! S3-compatible prefix (`s3://bucket/prefix`, with the same S3 settings as checkpoints), and how
//! to tell a columnar dataset from a directory in a plugin's own format; and a file of it as
//! listed ([`FileRef`]).

use std::path::{Path, PathBuf};

use trainerd_storage::Location;

use crate::error::DataError;

/// A dataset's location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataLocation {
    /// A local directory.
    Local(PathBuf),
    /// A bucket and key prefix (no leading or trailing slash; possibly empty).
    S3 {
        /// Bucket.
        bucket: String,
        /// Prefix.
        prefix: String,
    },
}

impl std::str::FromStr for DataLocation {
    type Err = DataError;

    fn from_str(text: &str) -> Result<DataLocation, DataError> {
        let err = |reason: String| DataError::Location { location: format!("{text:?}"), reason };
        // The same grammar as checkpoint locations, so that both flags read alike.
        match text.parse::<Location>() {
            Ok(Location::Local(dir)) => Ok(DataLocation::Local(dir)),
            Ok(Location::S3 { bucket, prefix }) => Ok(DataLocation::S3 { bucket, prefix }),
            Ok(Location::Memory) => Err(err("expected a directory, file:///path or s3://bucket/prefix".into())),
            Err(e) => Err(err(e
                .reason
                .replace(", file:///path, s3://bucket/prefix or memory://", ", file:///path or s3://bucket/prefix"))),
        }
    }
}

impl std::fmt::Display for DataLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataLocation::Local(dir) => write!(f, "{}", dir.display()),
            DataLocation::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            DataLocation::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

impl DataLocation {
    /// The name of `file` (a name inside the location) as messages show it.
    pub fn file(&self, name: &str) -> String {
        match self {
            DataLocation::Local(dir) => dir.join(name).display().to_string(),
            _ => format!("{}/{name}", self.to_string().trim_end_matches('/')),
        }
    }

    /// Whether this location holds a columnar dataset: always for S3 (a plugin's own readers
    /// read only local directories), and for a directory that holds `.parquet` files.
    pub fn is_columnar(&self) -> bool {
        match self {
            DataLocation::S3 { .. } => true,
            DataLocation::Local(dir) => holds_parquet(dir),
        }
    }
}

fn holds_parquet(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .is_ok_and(|entries| entries.flatten().any(|e| e.file_name().to_string_lossy().ends_with(".parquet")))
}

/// A file of the dataset as it was when the run started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRef {
    /// Its name inside the location.
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its ETag, when the store gives one.
    pub etag: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_and_errors() {
        let parse = |s: &str| s.parse::<DataLocation>();
        assert_eq!(parse("/data/fm").unwrap(), DataLocation::Local("/data/fm".into()));
        assert_eq!(parse("file:///data/fm").unwrap(), DataLocation::Local("/data/fm".into()));
        assert_eq!(
            parse("s3://bucket/fashion-mnist/").unwrap(),
            DataLocation::S3 { bucket: "bucket".into(), prefix: "fashion-mnist".into() }
        );
        assert_eq!(parse("s3://bucket/fashion-mnist/").unwrap().to_string(), "s3://bucket/fashion-mnist");
        assert_eq!(
            parse("s3://bucket/fm").unwrap().file("train-00000-of-00001.parquet"),
            "s3://bucket/fm/train-00000-of-00001.parquet"
        );
        assert_eq!(
            parse("memory://").unwrap_err().to_string(),
            "data location \"memory://\": expected a directory, file:///path or s3://bucket/prefix"
        );
        assert_eq!(
            parse("gs://b/p").unwrap_err().to_string(),
            "data location \"gs://b/p\": unknown scheme \"gs\"; expected a directory, file:///path or \
             s3://bucket/prefix"
        );
    }

    #[test]
    fn a_directory_is_columnar_when_it_holds_parquet_files() {
        let dir = tempfile::tempdir().unwrap();
        let loc = DataLocation::Local(dir.path().into());
        assert!(!loc.is_columnar());
        std::fs::write(dir.path().join("train-images-idx3-ubyte.gz"), b"").unwrap();
        assert!(!loc.is_columnar());
        std::fs::write(dir.path().join("train-00000-of-00001.parquet"), b"").unwrap();
        assert!(loc.is_columnar());
        assert!(DataLocation::S3 { bucket: "b".into(), prefix: String::new() }.is_columnar());
    }
}
