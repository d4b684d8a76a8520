//! An uploaded update staged on disk.
//!
//! A trainer's update is one model's worth of f32, and a node already holds its model and its
//! residual: kept in memory until it is distilled, the upload was the largest thing at a round's
//! peak (one model more: `kindred bench-model`, BENCHMARKS.md). The API checks each value as the
//! body arrives and writes it to a file in the node's data directory ([`StagedUpdate`]) in
//! aligned 2 MiB pieces, whatever the body's frames ([`StagedWriter`]): a file system with large
//! folios (ext4 and XFS on recent kernels) then caches it in 2 MiB folios. The distiller reads
//! it a layer at a time straight from the page cache through a read-only mapping
//! ([`StagedUpdate::layers`]), a folio per page fault: no copy and no buffer to fault in.
//! Reading each layer into a buffer cost the distill step about a quarter of its time
//! (`kindred bench-model --params 100000000`: 0.49-0.53 G elements/s per core mapped, 0.38-0.40
//! read; BENCHMARKS.md). Each layer's pages leave the node's resident set when the next layer
//! is read, so a pass holds one layer at a time. The kernel's page cache holds the file while
//! memory allows, so this costs little I/O; none of it counts against the node. What a host
//! short of memory drops while the update waits for its round is read back just before it
//! ([`StagedUpdate::prefetch`]). The file is
//! removed when the update is dropped, and any left by a crash at the next start.

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
            advised: 0,
            buffer: Vec::new(),
            _staged: std::marker::PhantomData,
        })
    }

    /// Read what the page cache dropped of the file back into it, on a thread of its own: the
    /// call returns at once.
    ///
    /// Why: an upload waits in the page cache from its arrival until its round starts, and a
    /// host short of memory drops part of it meanwhile. At 10^9 parameters (`kindred
    /// bench-model`, a member and its hub, 4 GB staged each) about 0.85 GB of the two files
    /// went in the minute and more between the uploads and the round, and each node's distill
    /// step read its share back from disk in 110-250 major faults (BENCHMARKS.md). Asked for
    /// shortly before the round (the node's round loop does), the reads run while the node
    /// waits.
    ///
    /// Each [`WRITE_PIECE`] not all cached is read with a plain read, which the kernel's
    /// read-ahead serves in large folios; advice (`POSIX_FADV_WILLNEED`) would bring it back
    /// in 4 KiB ones, which cost the distiller's mapping more page faults and CPU (`read_ahead`).
    /// A piece still cached is not read. A failed read is logged and costs the disk's latency
    /// later.
    pub fn prefetch(&self) {
        let Ok(len) = byte_offset(self.len) else {
            return;
        };
        let file = match self.file.try_clone() {
            Ok(file) => file,
            Err(error) => {
                tracing::debug!(%error, "no read-ahead of a staged update");
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("kindred-read-ahead".into())
            .spawn(move || {
                let read = read_ahead(&file, len);
                tracing::debug!(read, "staged update read back into the page cache");
            });
        if let Err(error) = spawned {
            tracing::debug!(%error, "no read-ahead of a staged update");
        }
    }

    /// The share of the file's pages in the page cache (`mincore` of a mapping), for tests.
    #[cfg(all(test, target_os = "linux"))]
    fn cached_share(&self) -> io::Result<f64> {
        let (_, pages) = resident_pages(&self.file, usize::MAX)?;
        Ok(pages.iter().filter(|&&b| b & 1 == 1).count() as f64 / pages.len().max(1) as f64)
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
    /// Bytes from the start already asked for ahead (`MADV_WILLNEED`).
    advised: usize,
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
            // Start reading back any of the layer's pages the page cache dropped, and the next
            // layer's meanwhile, so the distiller's first, random reads do not wait on the disk
            // a page at a time. The pages are mapped by the reads' own faults, a folio per
            // fault: mapping them in one call (`MADV_POPULATE_READ`) walks them 4 KiB at a time
            // and cost 2x the CPU of faulting (BENCHMARKS.md). Advice only: a refusal costs the
            // disk's latency. The kernel reads one read-ahead window per advice (a few MiB), so
            // this starts each layer early; the whole file is read back before the round
            // (`StagedUpdate::prefetch`).
            let from = start.max(self.advised).min(end);
            let ahead = (end - start).min(self.map.len().saturating_sub(end));
            for (at, len) in [(from, end - from), (end, ahead)] {
                if len > 0 {
                    let _ = self.map.advise_range(memmap2::Advice::WillNeed, at, len);
                }
            }
            self.advised = self.advised.max(end + ahead);
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

/// Bytes a [`StagedWriter`] gathers before a write: 2 MiB, the size of an x86-64 huge page.
/// The page cache sizes a written range's folios by the write, so aligned 2 MiB writes leave
/// 2 MiB folios, which the distiller's read maps a folio per fault rather than 64 KiB (a 2 GB
/// file written in 16 KiB pieces took 3x the CPU to map and read; BENCHMARKS.md).
pub const WRITE_PIECE: usize = 2 << 20;

/// An upload on its way into a [`StagedUpdate`]: contiguous values gathered and written in
/// pieces that end on [`WRITE_PIECE`] boundaries of the file, whatever sizes the body's frames
/// came in. [`StagedWriter::finish`] writes the rest and hands the update on.
#[derive(Debug)]
pub struct StagedWriter {
    staged: StagedUpdate,
    /// Little-endian values not written yet, from value `at` on.
    pending: Vec<u8>,
    at: usize,
    /// Each write's first value and length, for the tests to check the pieces.
    #[cfg(test)]
    writes: Vec<(usize, usize)>,
}

impl StagedWriter {
    /// A writer into `staged`, holding at most [`WRITE_PIECE`] bytes.
    pub fn new(staged: StagedUpdate) -> Self {
        Self {
            staged,
            pending: Vec::new(),
            at: 0,
            #[cfg(test)]
            writes: Vec::new(),
        }
    }

    /// Values in the update.
    pub fn len(&self) -> usize {
        self.staged.len
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.staged.len == 0
    }

    /// Store little-endian f32 `bytes` (a whole number of values) from value `at` on.
    ///
    /// # Errors
    /// Values past the end or a partial value, at once; a failed write of earlier values.
    pub fn write_le(&mut self, at: usize, mut bytes: &[u8]) -> io::Result<()> {
        let end = at.checked_add(bytes.len() / 4);
        if !bytes.len().is_multiple_of(4) || end.is_none_or(|e| e > self.staged.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "values past the staged update's end",
            ));
        }
        if self.pending.is_empty() {
            self.at = at;
        } else if self.at + self.pending.len() / 4 != at {
            self.flush()?;
            self.at = at;
        }
        while !bytes.is_empty() {
            // Byte offsets are multiples of 4, and so is the room up to the next boundary.
            let offset = self.at * 4 + self.pending.len();
            let room = WRITE_PIECE - offset % WRITE_PIECE;
            let (now, rest) = bytes.split_at(room.min(bytes.len()));
            if self.pending.capacity() == 0 {
                self.pending.reserve_exact(WRITE_PIECE);
            }
            self.pending.extend_from_slice(now);
            bytes = rest;
            if now.len() == room {
                self.flush()?;
            }
        }
        Ok(())
    }

    /// Write what is gathered and hand the update on.
    ///
    /// # Errors
    /// A failed write.
    pub fn finish(mut self) -> io::Result<StagedUpdate> {
        self.flush()?;
        Ok(self.staged)
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.pending.is_empty() {
            self.staged.write_le(self.at, &self.pending)?;
            #[cfg(test)]
            self.writes.push((self.at, self.pending.len() / 4));
            self.at += self.pending.len() / 4;
            self.pending.clear();
        }
        Ok(())
    }
}

/// Read back into the page cache the [`WRITE_PIECE`]s of `file`'s `len` bytes that are not all
/// cached ([`StagedUpdate::prefetch`]), with plain reads into one piece-sized buffer; returns
/// the bytes read. A no-op where the page cache cannot be asked (`mincore`).
///
/// Why reads, not advice: `POSIX_FADV_WILLNEED` (and `MADV_WILLNEED`) fill the gaps with small
/// folios, which the distiller's mapping then takes many more page faults to map than the
/// 2 MiB ones of the upload; reads in order let the kernel's read-ahead grow its folios. At
/// 10^9 parameters, a staged update dropped from the cache and read back by advice cost the
/// distill step 1.2-1.6 s of CPU against 0.8-0.9 s never dropped (BENCHMARKS.md). A piece
/// cached when this starts is not read (one `mincore` of the file says which).
fn read_ahead(file: &File, len: u64) -> u64 {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let page = page_size();
        // Which pages are cached, taken once before reading: a read's own read-ahead brings in
        // pieces after it, which are read all the same, so that a dropped stretch is read in
        // order and the read-ahead keeps growing its folios (skipping them, the next read
        // starts a new, small read-ahead).
        let (total, resident) =
            match resident_pages(file, usize::try_from(len).unwrap_or(usize::MAX)) {
                Ok(pages) => pages,
                Err(error) => {
                    tracing::debug!(%error, "no read-ahead of a staged update");
                    return 0;
                }
            };
        let mut buffer = vec![0u8; WRITE_PIECE];
        let mut read = 0u64;
        let per_piece = WRITE_PIECE / page.min(WRITE_PIECE);
        for (piece, flags) in resident.chunks(per_piece.max(1)).enumerate() {
            if flags.iter().all(|&f| f & 1 == 1) {
                continue;
            }
            let at = piece * WRITE_PIECE;
            let Some(buf) = buffer.get_mut(..WRITE_PIECE.min(total - at)) else {
                return read;
            };
            match file.read_exact_at(buf, at as u64) {
                Ok(()) => read += buf.len() as u64,
                Err(error) => {
                    tracing::debug!(%error, "read-ahead of a staged update stopped");
                    return read;
                }
            }
        }
        read
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = (file, len);
        0
    }
}

/// The bytes of `file` looked at (its first `len`, at most the file) and one byte per page of
/// them, bit 0 set where the page is in the page cache (`mincore` of a read-only mapping,
/// dropped before returning).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn resident_pages(file: &File, len: usize) -> io::Result<(usize, Vec<u8>)> {
    // SAFETY: a read-only shared mapping of a staged file, which nobody writes once it is
    // staged (`StagedUpdate::layers`); it is never read through, only passed to `mincore`.
    #[allow(unsafe_code)]
    let map = unsafe { memmap2::Mmap::map(file)? };
    let len = len.min(map.len());
    let mut resident = vec![0u8; len.div_ceil(page_size())];
    if len > 0 {
        // SAFETY: the mapping is at least `len` bytes long and outlives the call; `resident`
        // has a byte per page of them.
        #[allow(unsafe_code)]
        let code = unsafe {
            libc::mincore(
                map.as_ptr() as *mut libc::c_void,
                len,
                resident.as_mut_ptr(),
            )
        };
        if code != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok((len, resident))
}

/// The system's page size (4 KiB where it cannot be asked).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn page_size() -> usize {
    // SAFETY: `sysconf` takes no pointer.
    #[allow(unsafe_code)]
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page)
        .ok()
        .filter(|&p| p > 0)
        .unwrap_or(4096)
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

    /// Drop `count` bytes of `staged`'s file from `at` out of the page cache (0: to the end),
    /// as a host short of memory drops clean pages.
    #[cfg(target_os = "linux")]
    fn drop_from_cache(staged: &StagedUpdate, at: usize, count: usize) {
        use std::os::fd::AsRawFd;
        let (at, count) = (
            libc::off_t::try_from(at).unwrap(),
            libc::off_t::try_from(count).unwrap(),
        );
        // SAFETY: no memory is passed; the descriptor is open.
        #[allow(unsafe_code)]
        let code = unsafe {
            libc::posix_fadvise(
                staged.file.as_raw_fd(),
                at,
                count,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        assert_eq!(code, 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn prefetch_reads_a_dropped_update_back_into_the_page_cache() {
        let dir = std::env::temp_dir().join(format!("kindred-staged-{}", rand::random::<u64>()));
        // 40 MB and a part: several read-ahead windows (`read_ahead_kb`, 8 MiB on the host that
        // measured it); one piece of advice for the whole file read only the first.
        let values: Vec<f32> = (0..(10 << 20) + 1_234)
            .map(|i| (i % 977) as f32 - 488.0)
            .collect();
        let staged = StagedUpdate::create(&dir, values.len()).unwrap();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        staged.write_le(0, &bytes).unwrap();
        staged.file.sync_all().unwrap();
        let len = bytes.len() as u64;
        // Clean pages can be dropped, as a host short of memory drops them.
        let drop_cache = || {
            drop_from_cache(&staged, 0, 0);
            staged.cached_share().unwrap()
        };
        // A file system that keeps pages in memory only (tmpfs) drops nothing (the share
        // stays 1): there is nothing to read back, and nothing is read. On a disk-backed one
        // (ext4 here) nothing is left cached (0), and every piece is read, in order, those the
        // reads' own read-ahead brought in too.
        let dropped = drop_cache();
        let read = read_ahead(&staged.file, len);
        if dropped == 1.0 {
            assert_eq!(read, 0);
        } else if dropped == 0.0 {
            assert_eq!(read, len);
        } else {
            assert!(read > 0 && read <= len, "{read} of {len} bytes read");
        }
        assert_eq!(staged.cached_share().unwrap(), 1.0);
        // A file all cached is not read again.
        assert_eq!(read_ahead(&staged.file, len), 0);
        // The same on its thread, as the node calls it.
        let dropped = drop_cache();
        staged.prefetch();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut share = staged.cached_share().unwrap();
        while share < 1.0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
            share = staged.cached_share().unwrap();
        }
        assert_eq!(
            share, 1.0,
            "{share} of the file cached after read-ahead ({dropped} before)"
        );
        assert_eq!(staged.to_vec().unwrap(), values);
        drop(staged);
        fs::remove_dir(&dir).unwrap();
    }

    /// Only the pieces with a page missing are read, each whole.
    #[cfg(target_os = "linux")]
    #[test]
    fn read_ahead_reads_only_the_pieces_the_cache_dropped() {
        let dir = std::env::temp_dir().join(format!("kindred-staged-{}", rand::random::<u64>()));
        // Three pieces and a part.
        let len = 3 * WRITE_PIECE / 4 + 1_000;
        let staged = StagedUpdate::create(&dir, len).unwrap();
        let bytes = vec![7u8; len * 4];
        staged.write_le(0, &bytes).unwrap();
        staged.file.sync_all().unwrap();
        // The second piece and the last one's part (a page of a 2 MiB folio cannot be dropped
        // alone: the folio stays).
        for (at, count) in [(WRITE_PIECE, WRITE_PIECE), (3 * WRITE_PIECE, 4000)] {
            drop_from_cache(&staged, at, count);
        }
        let read = read_ahead(&staged.file, bytes.len() as u64);
        if staged.cached_share().unwrap() == 1.0 && read == 0 {
            // tmpfs: nothing was dropped.
            drop(staged);
            fs::remove_dir(&dir).unwrap();
            return;
        }
        // The second piece, and the last if its partial page could be dropped; never the first
        // or the third.
        assert!(
            (WRITE_PIECE as u64..=(WRITE_PIECE + 4_000) as u64).contains(&read),
            "{read}"
        );
        assert_eq!(staged.cached_share().unwrap(), 1.0);
        drop(staged);
        fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn a_writer_stores_frames_of_any_size_in_any_order_and_refuses_what_does_not_fit() {
        let dir = std::env::temp_dir().join(format!("kindred-staged-{}", rand::random::<u64>()));
        // Three pieces and a part, in two segments written out of order (as a file's tensors
        // may be), each in frames of sizes that straddle the pieces' boundaries.
        let len = 3 * WRITE_PIECE / 4 + 1_234;
        let values: Vec<f32> = (0..len).map(|i| i as f32 * 0.25 - 3.0).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut writer = StagedWriter::new(StagedUpdate::create(&dir, len).unwrap());
        assert_eq!(writer.len(), len);
        let split = WRITE_PIECE / 4 + 777;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for (from, to) in [(split, len), (0, split)] {
            let mut at = from;
            while at < to {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let n = (1 + (rng % 200_000) as usize).min(to - at);
                writer.write_le(at, &bytes[at * 4..(at + n) * 4]).unwrap();
                at += n;
            }
        }
        assert!(
            writer.write_le(len - 1, &bytes[..8]).is_err(),
            "past the end"
        );
        assert!(writer.write_le(0, &bytes[..6]).is_err(), "a partial value");
        writer.flush().unwrap();
        // Every write ends on a piece boundary but the last of each segment, and starts on one
        // but the first of each: 2 MiB-aligned pieces wherever the segments allow.
        let piece = WRITE_PIECE / 4;
        let writes = writer.writes.clone();
        assert_eq!(writes.iter().map(|w| w.1).sum::<usize>(), len);
        for &(at, n) in &writes {
            assert!(n <= piece, "{at} {n}");
            assert!(at % piece == 0 || at == split || at == 0, "starts at {at}");
            let end = at + n;
            assert!(
                end % piece == 0 || end == len || end == split,
                "ends at {end}"
            );
        }
        // The whole pieces no segment boundary splits were written whole.
        for whole in [(0, piece), (2 * piece, piece)] {
            assert!(writes.contains(&whole), "{writes:?}");
        }
        let staged = writer.finish().unwrap();
        assert_eq!(staged.to_vec().unwrap(), values);
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
