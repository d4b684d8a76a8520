//! Where served packets come from: the node's packet store, behind a small trait.
//!
//! Routing serves `GetHeaders`, `GetBody` and `GetSnapshot` requests but does not own storage: the node keeps
//! packets in sled and content-addressed files. [`PacketStore`] is the narrow read-only view the
//! driver needs; [`MemoryStore`] is an in-memory implementation for tests, benchmarks and
//! embedders without persistence.
//!
//! Which headers are served *under which semantic keys* is routing's own state (it announced
//! them), so the trait only answers by packet id.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use kindred_proto::{PacketId, SealedPacket};

/// Read access to stored packets, called from the swarm task for every inbound request.
///
/// Implementations must be quick (an in-memory map, a sled get, a small file read): the swarm
/// task waits for them. Return `None` for anything not held; a node never serves bytes it did
/// not store itself.
pub trait PacketStore: Send + Sync + 'static {
    /// The encoded, signed header of packet `id`.
    fn header(&self, id: &PacketId) -> Option<Vec<u8>>;
    /// The encoded body of packet `id`.
    fn body(&self, id: &PacketId) -> Option<Vec<u8>>;
    /// The node's newest model snapshot, sealed with [`kindred_proto::seal_snapshot`]. `None`
    /// (the default) when the node serves none. Shared, not copied: a snapshot is the whole
    /// model, and each piece of a large one is sliced out of it
    /// ([`kindred_proto::RpcRequest::GetChunk`]).
    fn snapshot(&self) -> Option<Arc<StoredSnapshot>> {
        None
    }
}

/// A sealed model snapshot as a node serves it.
///
/// ```
/// # use kindred_routing::StoredSnapshot;
/// let s = StoredSnapshot::new(vec![1], vec![2, 3]);
/// assert_eq!(s.body_hash, *blake3::hash(&[2, 3]).as_bytes());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSnapshot {
    /// The encoded header, signed under the snapshot domain.
    pub header: Vec<u8>,
    /// The encoded body.
    pub body: Vec<u8>,
    /// The body's blake3 hash (what its header commits to, and chunk requests name).
    pub body_hash: [u8; 32],
}

impl StoredSnapshot {
    /// A snapshot of these bytes (the body hashed once here).
    pub fn new(header: Vec<u8>, body: Vec<u8>) -> Self {
        let body_hash = *blake3::hash(&body).as_bytes();
        Self {
            header,
            body,
            body_hash,
        }
    }

    /// A sealed snapshot's bytes, taken without copying (its header holds the body's hash).
    pub fn sealed(sealed: SealedPacket) -> Self {
        let body_hash = sealed.header.header().body_hash;
        Self {
            header: sealed.header_bytes,
            body: sealed.body_bytes,
            body_hash,
        }
    }
}

/// A [`PacketStore`] in memory.
///
/// ```
/// use kindred_routing::store::{MemoryStore, PacketStore};
/// use kindred_proto::PacketId;
///
/// let store = MemoryStore::default();
/// store.insert_raw(PacketId([1; 32]), vec![1, 2], vec![3]);
/// assert_eq!(store.body(&PacketId([1; 32])), Some(vec![3]));
/// assert_eq!(store.header(&PacketId([2; 32])), None);
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    packets: RwLock<HashMap<PacketId, StoredPacket>>,
    snapshot: RwLock<Option<Arc<StoredSnapshot>>>,
}

/// Encoded header and body.
type StoredPacket = (Vec<u8>, Vec<u8>);

impl MemoryStore {
    /// Store a sealed packet.
    pub fn insert(&self, packet: &SealedPacket) {
        self.insert_raw(
            packet.id(),
            packet.header_bytes.clone(),
            packet.body_bytes.clone(),
        );
    }

    /// Store raw header and body bytes under `id`, unchecked (tests use this to serve invalid
    /// data).
    pub fn insert_raw(&self, id: PacketId, header: Vec<u8>, body: Vec<u8>) {
        self.packets
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, (header, body));
    }

    /// Serve `snapshot` as the node's model snapshot from now on.
    pub fn set_snapshot(&self, snapshot: &SealedPacket) {
        *self
            .snapshot
            .write()
            .unwrap_or_else(PoisonError::into_inner) =
            Some(Arc::new(StoredSnapshot::sealed(snapshot.clone())));
    }

    /// Drop a packet.
    pub fn remove(&self, id: &PacketId) {
        self.packets
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }

    /// Number of packets held.
    pub fn len(&self) -> usize {
        self.packets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl PacketStore for MemoryStore {
    fn header(&self, id: &PacketId) -> Option<Vec<u8>> {
        self.packets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .map(|(h, _)| h.clone())
    }

    fn body(&self, id: &PacketId) -> Option<Vec<u8>> {
        self.packets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .map(|(_, b)| b.clone())
    }

    fn snapshot(&self) -> Option<Arc<StoredSnapshot>> {
        self.snapshot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
