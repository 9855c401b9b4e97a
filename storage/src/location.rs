//! Checkpoint locations: a local directory, an S3-compatible bucket, or memory, as the operator
//! writes them (`/path`, `file:///path`, `s3://bucket/prefix`, `memory://`), and opening them
//! as a [`CheckpointStore`].
//!
//! S3 settings come from the standard AWS variables (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`...), overridable by [`S3Options`];
//! plain http is allowed for an endpoint on loopback or when asked for.

use std::sync::Arc;

use object_store::path::Path as StorePath;

use crate::store::CheckpointStore;

use std::path::PathBuf;

/// A checkpoint location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A local directory (`/path`, `relative/path` or `file:///path`).
    Local(PathBuf),
    /// An S3-compatible bucket and key prefix (`s3://bucket/prefix`), no leading or trailing
    /// slash on the prefix.
    S3 {
        /// Bucket name.
        bucket: String,
        /// Key prefix, possibly empty.
        prefix: String,
    },
    /// Process memory (`memory://`), for tests.
    Memory,
}

/// A location that could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("checkpoint location {text:?}: {reason}")]
pub struct LocationError {
    /// The text given.
    pub text: String,
    /// What was expected.
    pub reason: String,
}

impl std::str::FromStr for Location {
    type Err = LocationError;

    fn from_str(text: &str) -> Result<Location, LocationError> {
        let err = |reason: &str| LocationError { text: text.to_string(), reason: reason.to_string() };
        if text.is_empty() {
            return Err(err("empty; expected a directory, file:///path, s3://bucket/prefix or memory://"));
        }
        match text.split_once("://") {
            None => Ok(Location::Local(PathBuf::from(text))),
            Some(("file", path)) if path.starts_with('/') => Ok(Location::Local(PathBuf::from(path))),
            Some(("file", _)) => Err(err("a file:// URL needs an absolute path (file:///path)")),
            Some(("memory", "")) => Ok(Location::Memory),
            Some(("memory", _)) => Err(err("memory:// takes no path")),
            Some(("s3", rest)) => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if !valid_bucket(bucket) {
                    return Err(err(
                        "the bucket name must be 3-63 characters of lower-case letters, digits, '.' and '-'",
                    ));
                }
                let prefix = prefix.trim_matches('/');
                if prefix.split('/').any(|part| part == "." || part == "..") || prefix.contains("//") {
                    return Err(err("the key prefix must not contain empty, '.' or '..' segments"));
                }
                Ok(Location::S3 { bucket: bucket.to_string(), prefix: prefix.to_string() })
            }
            Some((scheme, _)) => Err(err(&format!(
                "unknown scheme {scheme:?}; expected a directory, file:///path, s3://bucket/prefix or memory://"
            ))),
        }
    }
}

/// S3's bucket naming rules (the subset that matters for parsing).
fn valid_bucket(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

/// S3 settings beyond the standard AWS variables.
#[derive(Clone, Debug, Default)]
pub struct S3Options {
    /// Endpoint URL (for MinIO, SeaweedFS, R2...); default: `AWS_ENDPOINT_URL` or AWS.
    pub endpoint: Option<String>,
    /// Region; default: `AWS_REGION` or `us-east-1`.
    pub region: Option<String>,
    /// Allow plain http (always allowed for a loopback endpoint).
    pub allow_http: bool,
    /// Do not prove that the server honours create-if-absent before committing.
    pub skip_probe: bool,
}

impl S3Options {
    /// The endpoint requests go to, as messages name it.
    pub fn endpoint_name(&self) -> String {
        self.endpoint.clone().or_else(|| std::env::var("AWS_ENDPOINT_URL").ok()).unwrap_or_else(|| "AWS S3".to_string())
    }
}

/// Why a location could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Its directory could not be created.
    #[error("checkpoint location {location}: cannot create the directory: {source}")]
    CreateDir {
        /// The location.
        location: String,
        /// Why.
        source: std::io::Error,
    },
    /// Its store could not be made (a bad directory, S3 settings).
    #[error("checkpoint location {location}: {source}")]
    Store {
        /// The location.
        location: String,
        /// The store's error.
        source: object_store::Error,
    },
}

/// The local backend as checkpoints use it: every write fsynced (file and directory), and
/// directories emptied by deletes removed (so collected checkpoints leave nothing behind).
pub fn local_store(dir: &std::path::Path) -> object_store::Result<object_store::local::LocalFileSystem> {
    Ok(object_store::local::LocalFileSystem::new_with_prefix(dir)?.with_fsync(true).with_automatic_cleanup(true))
}

impl Location {
    /// Opens the location. A local directory is created if missing; its writes are fsynced
    /// (file and directory).
    pub fn open(&self, s3: &S3Options) -> Result<CheckpointStore, OpenError> {
        let name = self.to_string();
        let store = |source| OpenError::Store { location: name.clone(), source };
        match self {
            Location::Local(dir) => {
                std::fs::create_dir_all(dir)
                    .map_err(|source| OpenError::CreateDir { location: name.clone(), source })?;
                let fs = local_store(dir).map_err(store)?;
                Ok(CheckpointStore::new(Arc::new(fs), StorePath::default(), name))
            }
            Location::Memory => {
                Ok(CheckpointStore::new(Arc::new(object_store::memory::InMemory::new()), StorePath::default(), name))
            }
            Location::S3 { bucket, prefix } => {
                let store = s3_store(bucket, s3).map_err(store)?;
                Ok(CheckpointStore::new(Arc::new(store), StorePath::from(prefix.as_str()), name))
            }
        }
    }
}

/// A client for `bucket` on the S3-compatible service `s3` names (the AWS variables underneath),
/// without object_store's own retries: its callers retry, count and log each failure themselves
/// (checkpoints through [`crate::Retry`], datasets within their wait bound).
pub fn s3_store(bucket: &str, s3: &S3Options) -> object_store::Result<object_store::aws::AmazonS3> {
    crate::tls::install_crypto_provider();
    let mut builder = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
    let endpoint = s3.endpoint.clone().or_else(|| std::env::var("AWS_ENDPOINT_URL").ok());
    let loopback = endpoint.as_deref().is_some_and(|e| {
        let host = e.split("://").nth(1).unwrap_or(e);
        host.starts_with("127.") || host.starts_with("localhost") || host.starts_with("[::1]")
    });
    if let Some(endpoint) = &endpoint {
        builder = builder.with_endpoint(endpoint).with_virtual_hosted_style_request(false);
    }
    let region = s3.region.clone().or_else(|| std::env::var("AWS_REGION").ok());
    builder = builder.with_region(region.unwrap_or_else(|| "us-east-1".into()));
    // Set last: with_client_options() would reset it.
    builder = builder.with_allow_http(s3.allow_http || loopback);
    // object_store's own retries would hold one request for up to 3 minutes, out of sight.
    builder = builder.with_retry(object_store::RetryConfig { max_retries: 0, ..Default::default() });
    builder.build()
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(dir) => write!(f, "{}", dir.display()),
            Location::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Location::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
            Location::Memory => write!(f, "memory://"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Result<Location, LocationError> {
        s.parse()
    }

    #[test]
    fn forms() {
        assert_eq!(parse("/var/lib/ckpt"), Ok(Location::Local("/var/lib/ckpt".into())));
        assert_eq!(parse("runs/a"), Ok(Location::Local("runs/a".into())));
        assert_eq!(parse("file:///var/lib/ckpt"), Ok(Location::Local("/var/lib/ckpt".into())));
        assert_eq!(parse("memory://"), Ok(Location::Memory));
        assert_eq!(parse("s3://ckpt"), Ok(Location::S3 { bucket: "ckpt".into(), prefix: String::new() }));
        assert_eq!(parse("s3://ckpt/run-7/"), Ok(Location::S3 { bucket: "ckpt".into(), prefix: "run-7".into() }));
    }

    #[test]
    fn errors_name_the_text() {
        assert_eq!(
            parse("gs://b/p").unwrap_err().to_string(),
            "checkpoint location \"gs://b/p\": unknown scheme \"gs\"; expected a directory, file:///path, \
             s3://bucket/prefix or memory://"
        );
        assert_eq!(
            parse("s3://My_Bucket/x").unwrap_err().to_string(),
            "checkpoint location \"s3://My_Bucket/x\": the bucket name must be 3-63 characters of lower-case \
             letters, digits, '.' and '-'"
        );
        assert_eq!(
            parse("file://relative").unwrap_err().to_string(),
            "checkpoint location \"file://relative\": a file:// URL needs an absolute path (file:///path)"
        );
        assert!(parse("s3://bucket/a/../b").is_err());
    }

    proptest! {
        #[test]
        fn never_panics(text in ".*") {
            let _ = parse(&text);
        }

        #[test]
        fn s3_round_trips(bucket in "[a-z0-9][a-z0-9.-]{1,20}[a-z0-9]", prefix in "([a-z0-9_-]{1,8}/){0,3}[a-z0-9_-]{1,8}") {
            prop_assert_eq!(parse(&format!("s3://{bucket}/{prefix}")), Ok(Location::S3 { bucket, prefix }));
        }
    }
}
