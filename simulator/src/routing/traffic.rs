//! Per-message bandwidth accounting.
//!
//! Sizes are those of libp2p-kad's protobuf messages as carried over yamux and Noise: each frame
//! pays a yamux header (12 B), a Noise length and tag (18 B) and a varint length prefix. A peer
//! entry is a 38-byte ed25519 `PeerId`, one binary multiaddr (`/ip4/…/tcp/…`, 9 B) and protobuf
//! tags. Connection handshakes are not counted (libp2p keeps connections open for the idle
//! timeout, and lookups mostly reuse them); the figures are per-message payload plus framing.

use std::sync::atomic::{AtomicU64, Ordering};

/// Byte sizes of Kademlia messages on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageSizes {
    /// `FIND_NODE` or `GET_PROVIDERS` request: a 32-byte key and framing.
    pub request: u32,
    /// Fixed part of a response.
    pub response_base: u32,
    /// Each peer (closer peer or provider) in a response.
    pub peer_entry: u32,
    /// `ADD_PROVIDER`: key, provider entry and framing.
    pub add_provider: u32,
}

impl Default for MessageSizes {
    fn default() -> Self {
        Self {
            request: 72,
            response_base: 40,
            peer_entry: 56,
            add_provider: 136,
        }
    }
}

/// Byte counters: one per node (sent plus received) and totals per phase.
#[derive(Debug)]
pub struct Traffic {
    per_node: Vec<AtomicU64>,
    /// Bytes of announcements (`ADD_PROVIDER` lookups).
    pub announce: AtomicU64,
    /// Bytes of measured semantic lookups.
    pub query: AtomicU64,
    /// Bytes of bootstrap lookups of (re)joining nodes.
    pub maintenance: AtomicU64,
}

/// What a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Announcing keys.
    Announce,
    /// Looking keys up.
    Query,
    /// Bootstrap and repair.
    Maintenance,
}

impl Traffic {
    /// Zeroed counters for `n` nodes.
    pub fn new(n: usize) -> Self {
        Self {
            per_node: (0..n).map(|_| AtomicU64::new(0)).collect(),
            announce: AtomicU64::new(0),
            query: AtomicU64::new(0),
            maintenance: AtomicU64::new(0),
        }
    }

    /// Count a message of `bytes` from `from` to `to`.
    #[inline]
    pub fn message(&self, phase: Phase, from: u32, to: u32, bytes: u32) {
        let b = u64::from(bytes);
        match phase {
            Phase::Announce => self.announce.fetch_add(b, Ordering::Relaxed),
            Phase::Query => self.query.fetch_add(b, Ordering::Relaxed),
            Phase::Maintenance => self.maintenance.fetch_add(b, Ordering::Relaxed),
        };
        if phase != Phase::Maintenance {
            for n in [from, to] {
                if let Some(c) = self.per_node.get(n as usize) {
                    c.fetch_add(b, Ordering::Relaxed);
                }
            }
        }
    }

    /// Per-node bytes (sent + received) of announcements and queries.
    pub fn per_node(&self) -> Vec<u64> {
        self.per_node
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}
