//! An uploaded update staged on disk.
//!
//! A trainer's update is one model's worth of f32, and a node already holds its model and its
//! residual: kept in memory until it is distilled, the upload was the largest thing at a round's
//! peak (one model more: `kindred bench-model`, BENCHMARKS.md). The API checks each value as the
//! body arrives and writes it to a file in the node's data directory ([`StagedUpdate`]); the
//! distiller then reads it back one layer at a time into a buffer the size of the largest layer.
//! The kernel's page cache holds the file while memory allows, so this costs little I/O; none of
//! it counts against the node. The file is removed when the update is dropped, and any left by a
//! crash at the next start.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// An update of `len` f32 values, little-endian in model order, in a file of its own.
#[derive(Debug)]
pub struct StagedUpdate {
    path: PathBuf,
    file: File,
    len: usize,
}

impl StagedUpdate {
    /// A new staging file for `len` values in `dir` (created if missing), all zero until
    /// written.
    ///
    /// # Errors
    /// When the directory or the file cannot be created or sized.
    pub fn create(dir: &Path, len: usize) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let path = dir.join(format!("update-{:016x}.f32", rand::random::<u64>()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        let staged = Self { path, file, len };
        staged.file.set_len(byte_offset(len)?)?;
        Ok(staged)
    }

    /// Remove staging files a crash left in `dir` (none is ever used again).
    pub fn clear(dir: &Path) {
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                let _ = fs::remove_file(entry.path());
            }
        }
    }

    /// Values in the update.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Write little-endian f32 `bytes` (a whole number of values) from value `at` on.
    ///
    /// # Errors
    /// An I/O error, or values past the end.
    pub fn write_le(&self, at: usize, bytes: &[u8]) -> io::Result<()> {
        let end = at.checked_add(bytes.len() / 4);
        if !bytes.len().is_multiple_of(4) || end.is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "values past the staged update's end",
            ));
        }
        self.file.write_all_at(bytes, byte_offset(at)?)
    }

    /// Read values `start..start + out.len()` into `out`.
    ///
    /// # Errors
    /// An I/O error, or a range past the end.
    pub fn read(&self, start: usize, out: &mut [f32]) -> io::Result<()> {
        if start.checked_add(out.len()).is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a range past the staged update's end",
            ));
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        self.file.read_exact_at(bytes, byte_offset(start)?)?;
        if cfg!(target_endian = "big") {
            for v in out.iter_mut() {
                *v = f32::from_le_bytes(v.to_ne_bytes());
            }
        }
        Ok(())
    }

    /// The whole update in memory.
    ///
    /// # Errors
    /// An I/O error.
    pub fn to_vec(&self) -> io::Result<Vec<f32>> {
        let mut out = vec![0.0; self.len];
        self.read(0, &mut out)?;
        Ok(out)
    }
}

impl Drop for StagedUpdate {
    fn drop(&mut self) {
        if let Err(error) = fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "cannot remove a staged update");
        }
    }
}

fn byte_offset(values: usize) -> io::Result<u64> {
    values
        .checked_mul(4)
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "update too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_written_anywhere_read_back_and_the_file_goes_with_the_update() {
        let dir = std::env::temp_dir().join(format!("kindred-staged-{}", rand::random::<u64>()));
        let staged = StagedUpdate::create(&dir, 10).unwrap();
        let bytes: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        staged.write_le(7, &bytes).unwrap();
        assert!(staged.write_le(9, &bytes).is_err(), "past the end");
        let mut out = [9.0f32; 4];
        staged.read(6, &mut out).unwrap();
        assert_eq!(out, [0.0, 1.5, -2.0, 0.0]);
        assert!(staged.read(8, &mut out).is_err(), "past the end");
        assert_eq!(staged.to_vec().unwrap()[7], 1.5);
        drop(staged);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        StagedUpdate::clear(&dir);
        fs::remove_dir(&dir).unwrap();
    }
}
