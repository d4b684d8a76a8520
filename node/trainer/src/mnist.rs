//! The MNIST digits, read from the canonical gzip'd IDX files.
//!
//! Kindred's built-in trainer and every experiment learn from real data: the MNIST test set (10,000
//! digits). The files are looked up in `KINDRED_DATA`, then `../shared/data/mnist` (relative to
//! the working directory and to the workspace), and checked against `MD5SUMS` when it is present.
//! Users elsewhere download the files from [`CANONICAL_URL`]; the error for missing files says so.
//!
//! The parser treats the files as untrusted: it bounds the decompressed size before reading,
//! checks magic numbers, dimensions and label range, and never panics.

use std::io::Read;
use std::path::{Path, PathBuf};

use md5::{Digest, Md5};

/// Where the canonical MNIST files can be downloaded (the mirror torchvision uses).
pub const CANONICAL_URL: &str = "https://ossci-datasets.s3.amazonaws.com/mnist/";

/// The image file of the 10k test set.
pub const TEST_IMAGES: &str = "t10k-images-idx3-ubyte.gz";
/// The label file of the 10k test set.
pub const TEST_LABELS: &str = "t10k-labels-idx1-ubyte.gz";

/// Pixels per image (28 × 28).
pub const PIXELS: usize = 28 * 28;
/// Number of classes.
pub const CLASSES: usize = 10;

/// Most images accepted from one file (the training set has 60,000).
const MAX_IMAGES: usize = 100_000;

/// Why the MNIST files could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file is not where it was looked for.
    #[error(
        "MNIST file {} not found (looked in {searched}). Set KINDRED_DATA to a folder holding \
         {TEST_IMAGES} and {TEST_LABELS}, downloadable from {CANONICAL_URL}",
        path.display()
    )]
    Missing {
        /// The file that was looked for.
        path: PathBuf,
        /// Every folder that was searched.
        searched: String,
    },
    /// Reading a file failed.
    #[error("reading {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file's MD5 differs from `MD5SUMS`.
    #[error("{} has MD5 {found}, MD5SUMS says {expected}: the file is corrupt or not MNIST", path.display())]
    Checksum {
        /// The file.
        path: PathBuf,
        /// MD5 listed in MD5SUMS.
        expected: String,
        /// MD5 of the file.
        found: String,
    },
    /// A file is not a well-formed IDX file of the expected kind.
    #[error("{}: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// A set of MNIST digits: pixels scaled to `[0, 1]`, labels `0..10`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mnist {
    images: Vec<f32>,
    labels: Vec<u8>,
}

impl Mnist {
    /// Load the 10k test set from the first folder [`Mnist::search_dirs`] finds it in.
    ///
    /// # Errors
    /// [`DataError::Missing`] naming the folders searched and where to download the files, or
    /// any other [`DataError`] from [`Mnist::load_dir`].
    pub fn load() -> Result<Self, DataError> {
        let dirs = Self::search_dirs();
        match dirs.iter().find(|d| d.join(TEST_IMAGES).is_file()) {
            Some(dir) => Self::load_dir(dir),
            None => Err(DataError::Missing {
                path: PathBuf::from(TEST_IMAGES),
                searched: dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// The folders [`Mnist::load`] looks in, in order: `$KINDRED_DATA`, `../shared/data/mnist`
    /// and `shared/data/mnist` from the working directory, and the workspace's
    /// `../shared/data/mnist`.
    pub fn search_dirs() -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        if let Some(dir) = std::env::var_os("KINDRED_DATA") {
            dirs.push(PathBuf::from(dir));
        }
        dirs.push(PathBuf::from("../shared/data/mnist"));
        dirs.push(PathBuf::from("shared/data/mnist"));
        dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/mnist"));
        dirs
    }

    /// Load the 10k test set from `dir`, verifying `MD5SUMS` if the folder has one.
    ///
    /// # Errors
    /// [`DataError`] when a file is missing, unreadable, fails its checksum or is malformed.
    pub fn load_dir(dir: &Path) -> Result<Self, DataError> {
        let sums = std::fs::read_to_string(dir.join("MD5SUMS")).ok();
        let images = read_gz(
            &dir.join(TEST_IMAGES),
            sums.as_deref(),
            16 + MAX_IMAGES * PIXELS,
        )?;
        let labels = read_gz(&dir.join(TEST_LABELS), sums.as_deref(), 8 + MAX_IMAGES)?;
        let mnist = Self::parse(&images, &labels).map_err(|reason| DataError::Format {
            path: dir.to_path_buf(),
            reason,
        })?;
        tracing::debug!(dir = %dir.display(), images = mnist.len(), "loaded MNIST");
        Ok(mnist)
    }

    /// Parse decompressed IDX image and label files.
    ///
    /// # Errors
    /// A description of the first defect found.
    pub fn parse(images: &[u8], labels: &[u8]) -> Result<Self, String> {
        let be = |b: &[u8], at: usize| -> Result<usize, String> {
            b.get(at..at + 4)
                .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
                .ok_or_else(|| "file shorter than its IDX header".to_string())
        };
        if be(images, 0)? != 0x0803 {
            return Err("image file does not start with IDX magic 0x00000803".into());
        }
        if be(labels, 0)? != 0x0801 {
            return Err("label file does not start with IDX magic 0x00000801".into());
        }
        let (n, rows, cols) = (be(images, 4)?, be(images, 8)?, be(images, 12)?);
        if (rows, cols) != (28, 28) {
            return Err(format!("images are {rows}x{cols}, expected 28x28"));
        }
        if n > MAX_IMAGES || be(labels, 4)? != n {
            return Err(format!(
                "{n} images but {} labels (at most {MAX_IMAGES})",
                be(labels, 4)?
            ));
        }
        let pixels = images.get(16..).unwrap_or_default();
        let label_bytes = labels.get(8..).unwrap_or_default();
        if pixels.len() != n * PIXELS || label_bytes.len() != n {
            return Err("file length does not match the count in its header".into());
        }
        if let Some(bad) = label_bytes.iter().find(|&&l| usize::from(l) >= CLASSES) {
            return Err(format!("label {bad} is not a digit"));
        }
        Ok(Self {
            images: pixels.iter().map(|&p| f32::from(p) / 255.0).collect(),
            labels: label_bytes.to_vec(),
        })
    }

    /// Number of digits.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Pixels of digit `i` (784 values in `[0, 1]`), or `None` past the end.
    pub fn image(&self, i: usize) -> Option<&[f32]> {
        self.images.get(i * PIXELS..(i + 1) * PIXELS)
    }

    /// Label of digit `i`, or `None` past the end.
    pub fn label(&self, i: usize) -> Option<u8> {
        self.labels.get(i).copied()
    }
}

/// Read and gunzip `path`, refusing more than `limit` decompressed bytes, and check its MD5
/// against the `MD5SUMS` text when one is given and lists the file.
fn read_gz(path: &Path, sums: Option<&str>, limit: usize) -> Result<Vec<u8>, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let compressed = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(DataError::Missing {
                path: path.to_path_buf(),
                searched: path
                    .parent()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            });
        }
        Err(e) => return Err(io(e)),
    };
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if let Some(expected) = sums.and_then(|s| md5_for(s, name)) {
        let found = hex::encode(Md5::digest(&compressed));
        if !found.eq_ignore_ascii_case(expected) {
            return Err(DataError::Checksum {
                path: path.to_path_buf(),
                expected: expected.to_string(),
                found,
            });
        }
    }
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(compressed.as_slice())
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(io)?;
    if out.len() > limit {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!("decompresses to more than {limit} bytes"),
        });
    }
    Ok(out)
}

/// The MD5 that an `md5sum`-style listing gives for `name`.
fn md5_for<'a>(sums: &'a str, name: &str) -> Option<&'a str> {
    sums.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let sum = parts.next()?;
        (parts.next()?.trim_start_matches('*') == name).then_some(sum)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(magic: u32, dims: &[u32], body: &[u8]) -> Vec<u8> {
        let mut v = magic.to_be_bytes().to_vec();
        for d in dims {
            v.extend_from_slice(&d.to_be_bytes());
        }
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn parses_well_formed_files() {
        let images = idx(0x803, &[2, 28, 28], &[255u8; 2 * PIXELS]);
        let labels = idx(0x801, &[2], &[3, 9]);
        let m = Mnist::parse(&images, &labels).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m.label(1), Some(9));
        assert_eq!(m.image(0).unwrap()[0], 1.0);
        assert!(m.image(2).is_none());
    }

    #[test]
    fn rejects_malformed_files() {
        let images = idx(0x803, &[2, 28, 28], &[0u8; 2 * PIXELS]);
        let labels = idx(0x801, &[2], &[3, 9]);
        assert!(Mnist::parse(&images[..20], &labels).is_err());
        assert!(Mnist::parse(&idx(0x804, &[2, 28, 28], &[0; 2 * PIXELS]), &labels).is_err());
        assert!(Mnist::parse(&idx(0x803, &[2, 27, 28], &[0; 2 * 756]), &labels).is_err());
        assert!(Mnist::parse(&images, &idx(0x801, &[2], &[3, 10])).is_err());
        assert!(Mnist::parse(&images, &idx(0x801, &[3], &[3, 1, 2])).is_err());
        assert!(Mnist::parse(&idx(0x803, &[u32::MAX, 28, 28], &[]), &labels).is_err());
    }

    #[test]
    fn md5sums_lookup() {
        let sums = "abc  t10k-images-idx3-ubyte.gz\ndef *t10k-labels-idx1-ubyte.gz\n";
        assert_eq!(md5_for(sums, TEST_IMAGES), Some("abc"));
        assert_eq!(md5_for(sums, TEST_LABELS), Some("def"));
        assert_eq!(md5_for(sums, "other"), None);
    }

    #[test]
    fn loads_the_real_test_set() {
        let m = Mnist::load().unwrap();
        assert_eq!(m.len(), 10_000);
        // The first test digit is a 7.
        assert_eq!(m.label(0), Some(7));
    }

    #[test]
    fn missing_files_name_the_download_location() {
        let err = Mnist::load_dir(Path::new("/nonexistent-kindred-data")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(CANONICAL_URL) && msg.contains("KINDRED_DATA"),
            "{msg}"
        );
    }
}
