//! The node's durable state: sled for small records, content-addressed files for large blobs.
//!
//! A node may be killed at any instant (`kill -9`, power loss) and must restart with its identity,
//! round counter, residuals and last checkpoint, and nothing corrupted. The rules that give this:
//!
//! 1. **Blobs are immutable and content-addressed.** A blob (packet body, residual state,
//!    checkpoint) is written to `blobs/tmp/`, fsynced, renamed to `blobs/<blake3 hex>`, and the
//!    folder fsynced. A blob file therefore either does not exist or is complete; reading it checks
//!    its hash, so bit rot is reported rather than trained on.
//! 2. **A round commits with one atomic sled batch** naming the round and the blobs of its
//!    checkpoint and residuals, then flushes sled. Blobs are durable before the batch that
//!    references them, so a committed round never points at a missing blob.
//! 3. **Nothing is updated in place.** A crash between steps leaves either the previous round's
//!    state or the new one; unreferenced blobs and temp files are swept at the next open.
//!
//! sled holds the identity, the committed round, the index of our own packets, and what routing
//! needs back after a restart (replay marks, the peers to rejoin through).

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use kindred_proto::{ModelId, PacketId};
use kindred_routing::ReplayMark;
use libp2p::{Multiaddr, PeerId};
use libp2p_identity::ed25519;
use rand::RngCore;

const STATE: &str = "state";
const HEADERS: &str = "headers";
const BODIES: &str = "bodies";

const KEY_IDENTITY: &[u8] = b"identity";
const KEY_ROUND: &[u8] = b"round";
const KEY_REPLAY: &[u8] = b"replay_marks";
const KEY_EXCHANGE: &[u8] = b"exchange";
const KEY_KNOWN_PEERS: &[u8] = b"known_peers";
/// The hub exchange's persisted record and the blob it names ([`Store::exchange`]).
pub type ExchangeRecord = (Vec<u8>, Option<BlobId>);
const KEY_EXCHANGE_BLOB: &[u8] = b"exchange_blob";
/// Most bytes of the exchange record ([`Store::put_exchange`]): a cohort view of 1,024 peers
/// is about 60 KB.
pub const MAX_EXCHANGE_RECORD: usize = 1 << 20;

/// Most replay marks persisted (one per sender and model); a larger record is corrupt.
pub const MAX_REPLAY_MARKS: usize = 1 << 16;
/// Most peers persisted for rejoining after a restart ([`Store::put_known_peers`]).
pub const MAX_KNOWN_PEERS: usize = 32;
/// Longest encoded address accepted in the known-peer record (a DNS name is at most 253 bytes;
/// a `/dns4/<name>/tcp/<port>/p2p/<ed25519 id>` address encodes in at most 300).
const MAX_ADDR_LEN: usize = 512;
/// Longest encoded `PeerId` accepted in a replay record (an ed25519 one is 38 bytes).
const MAX_PEER_ID_LEN: usize = 64;

/// blake3 of a blob's bytes: its name on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobId(pub [u8; 32]);

impl BlobId {
    /// The id of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    fn file_name(&self) -> String {
        hex::encode(self.0)
    }
}

/// What a committed round left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundState {
    /// The last completed round.
    pub round: u64,
    /// Model parameters after that round.
    pub checkpoint: BlobId,
    /// Distiller state (residuals, running mean) after that round.
    pub residuals: BlobId,
}

impl RoundState {
    const LEN: usize = 8 + 32 + 32;

    fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..8].copy_from_slice(&self.round.to_be_bytes());
        out[8..40].copy_from_slice(&self.checkpoint.0);
        out[40..].copy_from_slice(&self.residuals.0);
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; Self::LEN] = bytes.try_into().ok()?;
        let (round, rest) = bytes.split_first_chunk::<8>()?;
        let (checkpoint, residuals) = rest.split_first_chunk::<32>()?;
        Some(Self {
            round: u64::from_be_bytes(*round),
            checkpoint: BlobId(*checkpoint),
            residuals: BlobId(residuals.try_into().ok()?),
        })
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The metadata database failed.
    #[error("store database at {}: {source}", path.display())]
    Db {
        /// The database folder.
        path: PathBuf,
        /// sled's error.
        source: sled::Error,
    },
    /// A blob file could not be read or written.
    #[error("blob file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Stored data does not match what was written (hash mismatch, bad record length).
    #[error("store is corrupt: {0}")]
    Corrupt(String),
    /// A blob the committed state refers to is missing.
    #[error("blob {0} referenced by the store is missing")]
    MissingBlob(String),
}

/// The node's on-disk store. Cheap to clone; all clones share one database.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    db: sled::Db,
    state: sled::Tree,
    headers: sled::Tree,
    bodies: sled::Tree,
}

impl Store {
    /// Open (or create) the store in `dir`, sweeping temp files a crash may have left.
    ///
    /// # Errors
    /// [`StoreError`] when the folder or the database cannot be opened.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, source }
        };
        let tmp = dir.join("blobs").join("tmp");
        fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        for entry in fs::read_dir(&tmp).map_err(io(&tmp))?.flatten() {
            // Incomplete writes from a crash; never referenced by anything.
            let _ = fs::remove_file(entry.path());
        }
        let db_path = dir.join("db");
        let db_err = |source| StoreError::Db {
            path: db_path.clone(),
            source,
        };
        let db = sled::Config::new().path(&db_path).open().map_err(db_err)?;
        let tree = |name: &str| db.open_tree(name).map_err(db_err);
        Ok(Self {
            root: dir.to_path_buf(),
            state: tree(STATE)?,
            headers: tree(HEADERS)?,
            bodies: tree(BODIES)?,
            db,
        })
    }

    /// The folder the store lives in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where model-sized values too large to keep in memory are staged on their way
    /// ([`crate::staged::StagedUpdate`]: a trainer's upload, the change an adoption makes):
    /// never committed state, cleared when the node starts.
    pub fn staging_dir(&self) -> PathBuf {
        self.root.join("staging")
    }

    fn db_err(&self, source: sled::Error) -> StoreError {
        StoreError::Db {
            path: self.root.join("db"),
            source,
        }
    }

    /// The node's identity, if one was created.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] if the stored key is malformed.
    pub fn identity(&self) -> Result<Option<ed25519::Keypair>, StoreError> {
        let Some(bytes) = self.state.get(KEY_IDENTITY).map_err(|e| self.db_err(e))? else {
            return Ok(None);
        };
        let mut bytes = bytes.to_vec();
        ed25519::Keypair::try_from_bytes(&mut bytes)
            .map(Some)
            .map_err(|e| StoreError::Corrupt(format!("identity key: {e}")))
    }

    /// The node's identity, created (from the OS random generator) and flushed on first use.
    ///
    /// # Errors
    /// As [`Store::identity`], or a database error.
    pub fn identity_or_create(&self) -> Result<ed25519::Keypair, StoreError> {
        if let Some(key) = self.identity()? {
            return Ok(key);
        }
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let key = ed25519::Keypair::from(
            ed25519::SecretKey::try_from_bytes(&mut secret)
                .map_err(|e| StoreError::Corrupt(format!("generated key: {e}")))?,
        );
        self.state
            .insert(KEY_IDENTITY, key.to_bytes().to_vec())
            .map_err(|e| self.db_err(e))?;
        self.flush()?;
        Ok(key)
    }

    /// Write `bytes` as a blob (atomically, durably) and return its id. Writing an existing blob
    /// is a no-op.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the file cannot be written, synced or renamed.
    pub fn put_blob(&self, bytes: &[u8]) -> Result<BlobId, StoreError> {
        self.write_blob(&[bytes], false)
    }

    /// [`Store::put_blob`] of `parts` concatenated, written one after another (a large blob is
    /// never assembled in memory), for state read back only at a restart (checkpoints): once
    /// synced, its pages leave the page cache. A 10^9-parameter node checkpoints 6 GB a round,
    /// which would otherwise compete for memory with what it reads next: the trainer's staged
    /// update, whose pages read back from disk cost the distill step its page faults.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the file cannot be written, synced or renamed.
    pub fn put_blob_parts(&self, parts: &[&[u8]]) -> Result<BlobId, StoreError> {
        self.write_blob(parts, true)
    }

    fn write_blob(&self, parts: &[&[u8]], cold: bool) -> Result<BlobId, StoreError> {
        let mut hasher = blake3::Hasher::new();
        for part in parts {
            hasher.update(part);
        }
        let id = BlobId(*hasher.finalize().as_bytes());
        let dir = self.root.join("blobs");
        let path = dir.join(id.file_name());
        if path.is_file() {
            return Ok(id);
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, source }
        };
        let tmp =
            dir.join("tmp")
                .join(format!("{}.{:016x}", id.file_name(), rand::random::<u64>()));
        let mut file = File::create(&tmp).map_err(io(&tmp))?;
        for part in parts {
            file.write_all(part).map_err(io(&tmp))?;
        }
        file.sync_all().map_err(io(&tmp))?;
        if cold {
            drop_cached_pages(&file);
        }
        drop(file);
        fs::rename(&tmp, &path).map_err(io(&path))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))?;
        Ok(id)
    }

    /// Read blob `id`, checking its hash.
    ///
    /// # Errors
    /// [`StoreError::MissingBlob`], [`StoreError::Io`], or [`StoreError::Corrupt`] when the
    /// bytes no longer hash to `id`.
    pub fn get_blob(&self, id: &BlobId) -> Result<Vec<u8>, StoreError> {
        let path = self.root.join("blobs").join(id.file_name());
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::MissingBlob(id.file_name()));
            }
            Err(source) => return Err(StoreError::Io { path, source }),
        };
        if BlobId::of(&bytes) != *id {
            return Err(StoreError::Corrupt(format!(
                "blob {} fails its hash",
                id.file_name()
            )));
        }
        Ok(bytes)
    }

    /// The last committed round, if any, with its blobs verified present and intact.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] or [`StoreError::MissingBlob`] if the committed state is damaged.
    pub fn round_state(&self) -> Result<Option<RoundState>, StoreError> {
        let Some(bytes) = self.state.get(KEY_ROUND).map_err(|e| self.db_err(e))? else {
            return Ok(None);
        };
        let state = RoundState::decode(&bytes)
            .ok_or_else(|| StoreError::Corrupt("round record has the wrong length".into()))?;
        Ok(Some(state))
    }

    /// Commit a completed round: one atomic record naming the round and its (already durable)
    /// blobs, flushed before returning. Blobs of older rounds are then swept.
    ///
    /// # Errors
    /// [`StoreError::MissingBlob`] if a named blob was never written, or a database error.
    pub fn commit_round(&self, state: RoundState) -> Result<(), StoreError> {
        for id in [state.checkpoint, state.residuals] {
            if !self.root.join("blobs").join(id.file_name()).is_file() {
                return Err(StoreError::MissingBlob(id.file_name()));
            }
        }
        self.state
            .insert(KEY_ROUND, &state.encode()[..])
            .map_err(|e| self.db_err(e))?;
        self.flush()
    }

    /// Persist the hub exchange's state (the core's snapshot, `record`) and the blob of the
    /// hub's merge distiller, written with the round record's durability: call before
    /// [`Store::commit_round`], which flushes. The blob stays until another replaces it.
    ///
    /// # Errors
    /// A database error, a record over [`MAX_EXCHANGE_RECORD`], or a blob not in the store.
    pub fn put_exchange(&self, record: &[u8], blob: Option<BlobId>) -> Result<(), StoreError> {
        if record.len() > MAX_EXCHANGE_RECORD {
            return Err(StoreError::Corrupt(format!(
                "exchange record of {} bytes is over {MAX_EXCHANGE_RECORD}",
                record.len()
            )));
        }
        if let Some(id) = blob
            && !self.root.join("blobs").join(id.file_name()).is_file()
        {
            return Err(StoreError::MissingBlob(id.file_name()));
        }
        let mut batch = sled::Batch::default();
        batch.insert(KEY_EXCHANGE, record);
        match blob {
            Some(id) => batch.insert(KEY_EXCHANGE_BLOB, &id.0[..]),
            None => batch.remove(KEY_EXCHANGE_BLOB),
        }
        self.state.apply_batch(batch).map_err(|e| self.db_err(e))
    }

    /// The exchange record and its blob ([`Store::put_exchange`]), if one was written.
    ///
    /// # Errors
    /// A database error, a record over its limit, or a blob id that is not 32 bytes.
    pub fn exchange(&self) -> Result<Option<ExchangeRecord>, StoreError> {
        let Some(record) = self.state.get(KEY_EXCHANGE).map_err(|e| self.db_err(e))? else {
            return Ok(None);
        };
        if record.len() > MAX_EXCHANGE_RECORD {
            return Err(StoreError::Corrupt("exchange record over its limit".into()));
        }
        Ok(Some((record.to_vec(), self.exchange_blob()?)))
    }

    fn exchange_blob(&self) -> Result<Option<BlobId>, StoreError> {
        match self
            .state
            .get(KEY_EXCHANGE_BLOB)
            .map_err(|e| self.db_err(e))?
        {
            None => Ok(None),
            Some(id) => {
                let id: [u8; 32] = id[..]
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("exchange blob id is not 32 bytes".into()))?;
                Ok(Some(BlobId(id)))
            }
        }
    }

    /// Persist the routing replay marks (the highest round accepted per sender and model), so
    /// a restarted node still refuses packets it had already seen superseded. Written with the
    /// round record's durability: call before [`Store::commit_round`], which flushes.
    ///
    /// # Errors
    /// A database error.
    pub fn put_replay_marks(&self, marks: &[ReplayMark]) -> Result<(), StoreError> {
        // Only marks whose sender id the decoder accepts, and the count of exactly those: a
        // record must always read back (ed25519 ids are 38 bytes; none from libp2p exceeds 64).
        let kept: Vec<(Vec<u8>, &ReplayMark)> = marks
            .iter()
            .map(|m| (m.sender.to_bytes(), m))
            .filter(|(peer, _)| peer.len() <= MAX_PEER_ID_LEN)
            .take(MAX_REPLAY_MARKS)
            .collect();
        let mut out = Vec::with_capacity(4 + kept.len() * (1 + 38 + 32 + 8 + 32));
        out.extend_from_slice(&(kept.len() as u32).to_le_bytes());
        for (peer, m) in &kept {
            out.push(peer.len() as u8);
            out.extend_from_slice(peer);
            out.extend_from_slice(&m.model.0);
            out.extend_from_slice(&m.round.to_le_bytes());
            out.extend_from_slice(&m.packet.0);
        }
        self.state
            .insert(KEY_REPLAY, out)
            .map_err(|e| self.db_err(e))?;
        Ok(())
    }

    /// The persisted replay marks (empty before the first round).
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the record does not decode.
    pub fn replay_marks(&self) -> Result<Vec<ReplayMark>, StoreError> {
        let Some(bytes) = self.state.get(KEY_REPLAY).map_err(|e| self.db_err(e))? else {
            return Ok(Vec::new());
        };
        decode_replay_marks(&bytes)
            .ok_or_else(|| StoreError::Corrupt("replay-mark record does not decode".into()))
    }

    /// Persist the peers to dial when the node starts again (at most [`MAX_KNOWN_PEERS`]; an
    /// address longer than the decoder accepts is left out). Written with the round record's
    /// durability, like [`Store::put_replay_marks`].
    ///
    /// # Errors
    /// A database error.
    pub fn put_known_peers(&self, addrs: &[Multiaddr]) -> Result<(), StoreError> {
        let out = encode_known_peers(addrs);
        self.state
            .insert(KEY_KNOWN_PEERS, out)
            .map_err(|e| self.db_err(e))?;
        Ok(())
    }

    /// The peers persisted by [`Store::put_known_peers`] (empty before the first round).
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the record does not decode.
    pub fn known_peers(&self) -> Result<Vec<Multiaddr>, StoreError> {
        let Some(bytes) = self
            .state
            .get(KEY_KNOWN_PEERS)
            .map_err(|e| self.db_err(e))?
        else {
            return Ok(Vec::new());
        };
        decode_known_peers(&bytes)
            .ok_or_else(|| StoreError::Corrupt("known-peer record does not decode".into()))
    }

    /// Store one of our own packets: the body as a blob, the header in sled.
    ///
    /// # Errors
    /// As [`Store::put_blob`], or a database error.
    pub fn put_packet(&self, id: PacketId, header: &[u8], body: &[u8]) -> Result<(), StoreError> {
        let blob = self.put_blob(body)?;
        self.bodies
            .insert(id.0, &blob.0[..])
            .map_err(|e| self.db_err(e))?;
        self.headers
            .insert(id.0, header)
            .map_err(|e| self.db_err(e))?;
        Ok(())
    }

    /// The encoded header of stored packet `id`.
    ///
    /// # Errors
    /// A database error.
    pub fn packet_header(&self, id: &PacketId) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .headers
            .get(id.0)
            .map_err(|e| self.db_err(e))?
            .map(|v| v.to_vec()))
    }

    /// The encoded body of stored packet `id`.
    ///
    /// # Errors
    /// A database error, or the blob errors of [`Store::get_blob`].
    pub fn packet_body(&self, id: &PacketId) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(blob) = self.bodies.get(id.0).map_err(|e| self.db_err(e))? else {
            return Ok(None);
        };
        let blob: [u8; 32] = blob
            .as_ref()
            .try_into()
            .map_err(|_| StoreError::Corrupt("body index entry has the wrong length".into()))?;
        self.get_blob(&BlobId(blob)).map(Some)
    }

    /// Delete our stored packets whose encoded header `keep` rejects, then every blob referenced
    /// neither by the committed round nor by a kept packet. Returns the number of blobs removed.
    ///
    /// # Errors
    /// A database or I/O error.
    pub fn sweep(&self, keep: impl Fn(&[u8]) -> bool) -> Result<usize, StoreError> {
        let mut referenced = std::collections::HashSet::new();
        if let Some(state) = self.round_state()? {
            referenced.insert(state.checkpoint.file_name());
            referenced.insert(state.residuals.file_name());
        }
        if let Some(blob) = self.exchange_blob()? {
            referenced.insert(blob.file_name());
        }
        for entry in self.headers.iter() {
            let (id, header) = entry.map_err(|e| self.db_err(e))?;
            if keep(&header) {
                if let Some(blob) = self.bodies.get(&id).map_err(|e| self.db_err(e))? {
                    referenced.insert(hex::encode(&blob));
                }
            } else {
                self.headers.remove(&id).map_err(|e| self.db_err(e))?;
                self.bodies.remove(&id).map_err(|e| self.db_err(e))?;
            }
        }
        let dir = self.root.join("blobs");
        let mut removed = 0;
        let entries = fs::read_dir(&dir).map_err(|source| StoreError::Io {
            path: dir.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.len() == 64
                && !referenced.contains(&name)
                && fs::remove_file(entry.path()).is_ok()
            {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Make everything written so far durable.
    ///
    /// # Errors
    /// A database error.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush().map(|_| ()).map_err(|e| self.db_err(e))
    }
}

/// Decode a replay-mark record; `None` on any inconsistency (count bounded before allocating).
/// Ask the kernel to drop a synced file's pages from the page cache (advice only: nothing to do
/// where the platform has no such call, or when it refuses).
fn drop_cached_pages(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: `posix_fadvise` reads no memory of ours; the descriptor is open for the
        // duration of the call (borrowed from `file`).
        #[allow(unsafe_code)]
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            tracing::debug!(rc, "posix_fadvise(DONTNEED) refused");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

fn decode_replay_marks(bytes: &[u8]) -> Option<Vec<ReplayMark>> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = b.split_at_checked(n)?;
        *b = rest;
        Some(head)
    }
    fn array<const N: usize>(b: &mut &[u8]) -> Option<[u8; N]> {
        take(b, N)?.try_into().ok()
    }
    let mut b = bytes;
    let count = u32::from_le_bytes(array(&mut b)?) as usize;
    if count > MAX_REPLAY_MARKS {
        return None;
    }
    let mut marks = Vec::with_capacity(count.min(b.len() / (1 + 32 + 8 + 32)));
    for _ in 0..count {
        let len = usize::from(*take(&mut b, 1)?.first()?);
        if len > MAX_PEER_ID_LEN {
            return None;
        }
        let sender = PeerId::from_bytes(take(&mut b, len)?).ok()?;
        let model = ModelId(array(&mut b)?);
        let round = u64::from_le_bytes(array(&mut b)?);
        let packet = PacketId(array(&mut b)?);
        marks.push(ReplayMark {
            sender,
            model,
            round,
            packet,
        });
    }
    b.is_empty().then_some(marks)
}

/// The known-peer record: a count byte, then per address a `u16` length and its bytes. At
/// most [`MAX_KNOWN_PEERS`] addresses, those longer than the decoder accepts left out.
fn encode_known_peers(addrs: &[Multiaddr]) -> Vec<u8> {
    let kept: Vec<Vec<u8>> = addrs
        .iter()
        .map(Multiaddr::to_vec)
        .filter(|a| a.len() <= MAX_ADDR_LEN)
        .take(MAX_KNOWN_PEERS)
        .collect();
    let mut out = Vec::with_capacity(1 + kept.iter().map(|a| 2 + a.len()).sum::<usize>());
    out.push(kept.len() as u8);
    for a in &kept {
        out.extend_from_slice(&(a.len() as u16).to_le_bytes());
        out.extend_from_slice(a);
    }
    out
}

/// Decode [`encode_known_peers`]'s record; `None` unless it is exactly one.
fn decode_known_peers(bytes: &[u8]) -> Option<Vec<Multiaddr>> {
    let (&count, mut b) = bytes.split_first()?;
    let count = usize::from(count);
    if count > MAX_KNOWN_PEERS {
        return None;
    }
    let mut addrs = Vec::with_capacity(count);
    for _ in 0..count {
        let (len, rest) = b.split_at_checked(2)?;
        let len = usize::from(u16::from_le_bytes(len.try_into().ok()?));
        if len > MAX_ADDR_LEN {
            return None;
        }
        let (addr, rest) = rest.split_at_checked(len)?;
        addrs.push(Multiaddr::try_from(addr.to_vec()).ok()?);
        b = rest;
    }
    b.is_empty().then_some(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Open the store in `dir` again after dropping it: sled 0.34 releases the database's file
    /// lock only when the dropped store's flusher thread has ended, which on a loaded machine
    /// can be a moment after the drop returns. Retries for up to 5 s.
    fn reopen(dir: &Path) -> Store {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match Store::open(dir) {
                Ok(store) => return store,
                Err(e) if std::time::Instant::now() >= deadline => panic!("{e}"),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
    }

    fn tempdir() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kindred-store-{:016x}", rand::random::<u64>()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `decode` takes the record `good` and refuses every truncation of it and it with a
    /// trailing byte.
    fn assert_only_whole_records_decode<T>(good: &[u8], decode: impl Fn(&[u8]) -> Option<T>) {
        assert!(decode(good).is_some());
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_none(), "cut {cut}");
        }
        let mut long = good.to_vec();
        long.push(0);
        assert!(decode(&long).is_none());
    }

    #[test]
    fn replay_marks_survive_reopen_and_bad_records_are_corrupt() {
        let dir = tempdir();
        let marks: Vec<ReplayMark> = (0..3u8)
            .map(|i| ReplayMark {
                sender: libp2p::identity::Keypair::generate_ed25519()
                    .public()
                    .to_peer_id(),
                model: ModelId([i; 32]),
                round: 7 + u64::from(i),
                packet: PacketId([i + 1; 32]),
            })
            .collect();
        {
            let store = Store::open(&dir).unwrap();
            assert!(store.replay_marks().unwrap().is_empty());
            store.put_replay_marks(&marks).unwrap();
            store.flush().unwrap();
        }
        let store = reopen(&dir);
        assert_eq!(store.replay_marks().unwrap(), marks);
        // Every truncation, a trailing byte and an absurd count are rejected, never a panic.
        let good = store.state.get(KEY_REPLAY).unwrap().unwrap().to_vec();
        assert_only_whole_records_decode(&good, decode_replay_marks);
        assert!(decode_replay_marks(&u32::MAX.to_le_bytes()).is_none());
        store.state.insert(KEY_REPLAY, &good[..5]).unwrap();
        assert!(matches!(store.replay_marks(), Err(StoreError::Corrupt(_))));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn known_peers_survive_reopen_and_bad_records_are_corrupt() {
        let dir = tempdir();
        let addrs: Vec<Multiaddr> = (0..3u16)
            .map(|i| {
                let peer = libp2p::identity::Keypair::generate_ed25519()
                    .public()
                    .to_peer_id();
                format!("/ip4/127.0.0.{i}/tcp/{}/p2p/{peer}", 4000 + i)
                    .parse()
                    .unwrap()
            })
            .collect();
        {
            let store = Store::open(&dir).unwrap();
            assert!(store.known_peers().unwrap().is_empty());
            store.put_known_peers(&addrs).unwrap();
            store.flush().unwrap();
        }
        let store = reopen(&dir);
        assert_eq!(store.known_peers().unwrap(), addrs);
        let good = store.state.get(KEY_KNOWN_PEERS).unwrap().unwrap().to_vec();
        assert_only_whole_records_decode(&good, decode_known_peers);
        assert!(decode_known_peers(&[u8::MAX]).is_none());
        // More than the cap are cut to it.
        let many: Vec<Multiaddr> = (0..MAX_KNOWN_PEERS as u16 + 5)
            .map(|i| format!("/ip4/10.0.0.1/tcp/{i}").parse().unwrap())
            .collect();
        store.put_known_peers(&many).unwrap();
        assert_eq!(store.known_peers().unwrap(), many[..MAX_KNOWN_PEERS]);
        store.state.insert(KEY_KNOWN_PEERS, &good[..4]).unwrap();
        assert!(matches!(store.known_peers(), Err(StoreError::Corrupt(_))));
        fs::remove_dir_all(dir).unwrap();
    }

    proptest::proptest! {
        /// Any bytes decode to a record or to nothing, never a panic; what decodes encodes
        /// back to the same bytes.
        #[test]
        fn known_peer_decoder_takes_any_bytes(
            bytes in proptest::collection::vec(0u8..=255, 0..600),
        ) {
            if let Some(addrs) = decode_known_peers(&bytes) {
                proptest::prop_assert_eq!(encode_known_peers(&addrs), bytes);
            }
        }

        /// Records of any addresses read back as the first [`MAX_KNOWN_PEERS`] of them; a
        /// byte changed anywhere in one decodes to a record or to nothing, never a panic.
        #[test]
        fn known_peer_records_round_trip_and_survive_a_changed_byte(
            hosts in proptest::collection::vec((0u8..=255, 1u16..=u16::MAX), 0..40),
            at in 0usize..2_000,
            byte in 0u8..=255,
        ) {
            let addrs: Vec<Multiaddr> = hosts
                .iter()
                .map(|&(h, port)| {
                    let peer = PeerId::from_public_key(
                        &libp2p_identity::Keypair::ed25519_from_bytes([h; 32])
                            .map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?
                            .public(),
                    );
                    format!("/ip4/10.0.{h}.1/tcp/{port}/p2p/{peer}")
                        .parse()
                        .map_err(|e: libp2p::multiaddr::Error| {
                            proptest::test_runner::TestCaseError::fail(e.to_string())
                        })
                })
                .collect::<Result<_, _>>()?;
            let mut record = encode_known_peers(&addrs);
            let back = decode_known_peers(&record);
            let kept = &addrs[..addrs.len().min(MAX_KNOWN_PEERS)];
            proptest::prop_assert_eq!(back.as_deref(), Some(kept));
            let i = at % record.len();
            if let Some(b) = record.get_mut(i) {
                *b = byte;
            }
            let _ = decode_known_peers(&record);
        }
    }

    #[test]
    fn state_survives_reopen() {
        let dir = tempdir();
        let (peer, state) = {
            let store = Store::open(&dir).unwrap();
            let key = store.identity_or_create().unwrap();
            let checkpoint = store.put_blob(b"params").unwrap();
            let residuals = store.put_blob(b"residuals").unwrap();
            let state = RoundState {
                round: 7,
                checkpoint,
                residuals,
            };
            store.commit_round(state).unwrap();
            store
                .put_packet(PacketId([3; 32]), b"header", b"body")
                .unwrap();
            (key.public(), state)
        };
        let store = reopen(&dir);
        assert_eq!(store.identity().unwrap().unwrap().public(), peer);
        assert_eq!(store.identity_or_create().unwrap().public(), peer);
        assert_eq!(store.round_state().unwrap(), Some(state));
        assert_eq!(store.get_blob(&state.checkpoint).unwrap(), b"params");
        assert_eq!(
            store.packet_header(&PacketId([3; 32])).unwrap().unwrap(),
            b"header"
        );
        assert_eq!(
            store.packet_body(&PacketId([3; 32])).unwrap().unwrap(),
            b"body"
        );
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn corrupt_blob_is_detected_not_returned() {
        let dir = tempdir();
        let store = Store::open(&dir).unwrap();
        let id = store.put_blob(b"checkpoint bytes").unwrap();
        fs::write(dir.join("blobs").join(id.file_name()), b"checkpoint bytez").unwrap();
        assert!(matches!(store.get_blob(&id), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            store.get_blob(&BlobId([9; 32])),
            Err(StoreError::MissingBlob(_))
        ));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_exchange_record_survives_reopen_and_sweeps_keep_its_blob() {
        let dir = tempdir();
        {
            let store = Store::open(&dir).unwrap();
            assert_eq!(store.exchange().unwrap(), None);
            assert!(matches!(
                store.put_exchange(b"state", Some(BlobId([9; 32]))),
                Err(StoreError::MissingBlob(_))
            ));
            let too_big = vec![0; MAX_EXCHANGE_RECORD + 1];
            assert!(store.put_exchange(&too_big, None).is_err());
            let blob = store.put_blob(b"hub distiller").unwrap();
            store.put_exchange(b"state v1", Some(blob)).unwrap();
            let cp = store.put_blob(b"checkpoint").unwrap();
            store
                .commit_round(RoundState {
                    round: 4,
                    checkpoint: cp,
                    residuals: cp,
                })
                .unwrap();
            store.sweep(|_| false).unwrap();
            assert_eq!(store.get_blob(&blob).unwrap(), b"hub distiller");
        }
        let store = reopen(&dir);
        let (record, blob) = store.exchange().unwrap().unwrap();
        assert_eq!(record, b"state v1");
        let blob = blob.unwrap();
        assert_eq!(store.get_blob(&blob).unwrap(), b"hub distiller");
        // A record without a blob drops the reference, and the next sweep the blob.
        store.put_exchange(b"state v2", None).unwrap();
        assert_eq!(
            store.exchange().unwrap(),
            Some((b"state v2".to_vec(), None))
        );
        store.sweep(|_| false).unwrap();
        assert!(store.get_blob(&blob).is_err());
    }

    #[test]
    fn commit_refuses_unwritten_blobs_and_sweep_keeps_referenced() {
        let dir = tempdir();
        let store = Store::open(&dir).unwrap();
        let old = store.put_blob(b"old").unwrap();
        let cp = store.put_blob(b"new checkpoint").unwrap();
        let res = store.put_blob(b"new residuals").unwrap();
        let missing = RoundState {
            round: 1,
            checkpoint: BlobId([1; 32]),
            residuals: res,
        };
        assert!(matches!(
            store.commit_round(missing),
            Err(StoreError::MissingBlob(_))
        ));
        store
            .commit_round(RoundState {
                round: 2,
                checkpoint: cp,
                residuals: res,
            })
            .unwrap();
        store
            .put_packet(PacketId([1; 32]), b"keep", b"body-keep")
            .unwrap();
        store
            .put_packet(PacketId([2; 32]), b"drop", b"body-drop")
            .unwrap();
        fs::write(dir.join("blobs/tmp/leftover"), b"x").unwrap();
        assert_eq!(
            store.sweep(|h| h == b"keep").unwrap(),
            2,
            "old blob and dropped body"
        );
        assert!(store.get_blob(&old).is_err());
        assert_eq!(store.get_blob(&cp).unwrap(), b"new checkpoint");
        assert!(store.packet_header(&PacketId([2; 32])).unwrap().is_none());
        assert_eq!(
            store.packet_body(&PacketId([1; 32])).unwrap().unwrap(),
            b"body-keep"
        );
        drop(store);
        reopen(&dir);
        assert!(
            !dir.join("blobs/tmp/leftover").exists(),
            "temp files swept at open"
        );
        fs::remove_dir_all(dir).unwrap();
    }
}
