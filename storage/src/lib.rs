//! Where trainerd's checkpoints live. This crate owns checkpoint *locations* and (next) the
//! commit protocol over them; the daemon decides *when* to commit.
//!
//! A location is written by operators on the command line, so parsing is strict and every
//! error names the text and what was expected.

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
