//! The SDK's errors: [`PluginError`], what plugin code raises, and [`DataError`], a problem with an
//! MNIST-format data file ([`crate::mnist`]). They depend on nothing else of the SDK's, so that
//! every part of it can raise them.

use std::path::PathBuf;

/// An error raised by plugin code; its message reaches the operator as it is, so it should name
/// the thing that is wrong (a file, a shape) and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// A data file problem (see [`DataError`]).
    #[error(transparent)]
    Data(#[from] DataError),
    /// A libtorch error.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// Anything else, as a message.
    #[error("{0}")]
    Other(String),
}

/// A problem with a data file.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// Neither the plain nor the gzipped file exists.
    #[error("data directory {dir}: missing {name} (or {name}.gz)")]
    MissingFile {
        /// The data directory.
        dir: PathBuf,
        /// The file's base name.
        name: String,
    },
    /// The file could not be read or decompressed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The header's magic number is not the one for this kind of file.
    #[error("{path}: wrong magic number 0x{found:08x}, expected 0x{expected:08x} ({what})")]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// Magic found.
        found: u32,
        /// Magic expected.
        expected: u32,
        /// What kind of file was expected.
        what: &'static str,
    },
    /// The file is shorter than its header says.
    #[error("{path}: truncated: the header promises {expected} bytes of data, the file has {found}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Data bytes the header promises.
        expected: u64,
        /// Data bytes present.
        found: u64,
    },
    /// Images and labels disagree on the number of examples.
    #[error("{images}: {n_images} images, but {labels}: {n_labels} labels")]
    CountMismatch {
        /// Images file.
        images: PathBuf,
        /// Image count.
        n_images: u32,
        /// Labels file.
        labels: PathBuf,
        /// Label count.
        n_labels: u32,
    },
}
