//! An uploaded update staged on disk.
//!
//! A trainer's update is one model's worth of f32, and a node already holds its model and its
//! residual: kept in memory until it is distilled, the upload was the largest thing at a round's
//! peak (one model more: `kindred bench-model`, BENCHMARKS.md). The API checks each value as the
//! body arrives and writes it to a file in the node's data directory ([`StagedUpdate`]); the
//! distiller then reads it a layer at a time straight from the page cache through a read-only
//! mapping ([`StagedUpdate::layers`]): no copy and no buffer to fault in. Reading each layer
//! into a buffer cost the distill step about a quarter of its time (`kindred bench-model
//! --params 100000000`: 0.49-0.53 G elements/s per core mapped, 0.38-0.40 read; BENCHMARKS.md).
//! Each layer's pages leave the node's resident set when the next layer is read, so a pass
//! holds one layer at a time. The kernel's page cache holds the file while memory allows, so
//! this costs little I/O; none of it counts against the node. The file is removed when the
//! update is dropped, and any left by a crash at the next start.

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

    /// The values mapped read-only, to be read a layer at a time in model order without a copy
    /// ([`MappedLayers`]).
    ///
    /// # Errors
    /// When the file cannot be mapped.
    pub fn layers(&self) -> io::Result<MappedLayers<'_>> {
        // SAFETY: the file is this node's own, created by `create` in its staging directory and
        // written only through `write_le` while the upload arrives, before the update is handed
        // on; nothing writes it while it is mapped, and the mapping lives no longer than `self`.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&self.file)? };
        let _ = map.advise(memmap2::Advice::Sequential);
        Ok(MappedLayers {
            map,
            len: self.len,
            released: 0,
            buffer: Vec::new(),
            _staged: std::marker::PhantomData,
        })
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

/// A staged update read through a read-only mapping ([`StagedUpdate::layers`]): each layer is
/// a view of the page cache, and reading one releases the pages of the layers before it from
/// the node's resident set (they stay cached; read again, they are mapped again).
#[derive(Debug)]
pub struct MappedLayers<'a> {
    map: memmap2::Mmap,
    len: usize,
    /// Bytes from the start whose pages were released.
    released: usize,
    /// Converted values on a big-endian host (the file is little-endian).
    buffer: Vec<f32>,
    _staged: std::marker::PhantomData<&'a StagedUpdate>,
}

impl kindred_distill::LayerSource for MappedLayers<'_> {
    fn layer(&mut self, range: std::ops::Range<usize>) -> &[f32] {
        if range.end > self.len || range.start > range.end {
            return &[];
        }
        let (start, end) = (range.start * 4, range.end * 4);
        if start > self.released {
            // SAFETY: a read-only shared mapping of a file nobody writes (`layers`): the
            // released pages read back the same values from the page cache when touched again,
            // and no slice of them is alive (each `layer` borrow ends before the next call).
            #[allow(unsafe_code)]
            let _ = unsafe {
                self.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    self.released,
                    start - self.released,
                )
            };
            self.released = start;
        }
        if end > start {
            // Map the layer's pages in one call (reading back any the page cache dropped)
            // rather than a fault per 64 KiB at the distiller's first, random reads, and start
            // reading the next layer's meanwhile. Advice only: a refusal costs the faults.
            #[cfg(target_os = "linux")]
            let _ = self
                .map
                .advise_range(memmap2::Advice::PopulateRead, start, end - start);
            let ahead = (end - start).min(self.map.len().saturating_sub(end));
            if ahead > 0 {
                let _ = self.map.advise_range(memmap2::Advice::WillNeed, end, ahead);
            }
        }
        let bytes = self.map.get(start..end).unwrap_or_default();
        if cfg!(target_endian = "big") {
            self.buffer.clear();
            self.buffer.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| <[u8; 4]>::try_from(b).map_or(0.0, f32::from_le_bytes)),
            );
            return &self.buffer;
        }
        // The mapping is page-aligned and every offset a multiple of 4.
        bytemuck::try_cast_slice(bytes).unwrap_or_default()
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
    fn mapped_layers_read_what_was_written_in_any_order_and_nothing_past_the_end() {
        use kindred_distill::LayerSource;
        let dir = std::env::temp_dir().join(format!("kindred-staged-{}", rand::random::<u64>()));
        // Layers that straddle pages (4 KiB = 1,024 values), as a model's do.
        let values: Vec<f32> = (0..5_000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let staged = StagedUpdate::create(&dir, values.len()).unwrap();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        staged.write_le(0, &bytes).unwrap();
        let mut layers = staged.layers().unwrap();
        for range in [0..3, 3..1_500, 1_500..1_501, 1_501..4_100, 4_100..5_000] {
            assert_eq!(layers.layer(range.clone()), &values[range]);
        }
        // Released pages read back the same values; a range past the end reads as empty.
        assert_eq!(layers.layer(10..2_000), &values[10..2_000]);
        assert!(layers.layer(4_990..5_001).is_empty());
        assert!(layers.layer(0..0).is_empty());
        drop(layers);
        drop(staged);
        fs::remove_dir(&dir).unwrap();
    }

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
