//! Per-message bandwidth accounting.
//!
//! Sizes are those of libp2p-kad's protobuf messages as a node's connection counter
//! (`kindred_routing::transport::wire_bytes`) sees them: stream payloads above the muxer, so
//! multistream-select's negotiation of every Kademlia substream is in (the dialer's header and
//! protocol, 40 B, and the listener's echo, 40 B) and yamux and Noise framing are not (about
//! 30 B more per frame on a real link, as for every other figure in the simulator). A peer entry
//! is a 38-byte ed25519 `PeerId` and one address, which libp2p-kad stores and sends with a
//! `/p2p/<peer id>` suffix: `/ip4/…/tcp/…/p2p/…`, 49 B. Connection handshakes and identify are
//! not counted (libp2p keeps connections open for the idle timeout, and lookups mostly reuse
//! them). `kindred-sim calibrate` checks these sizes against a real swarm's counter.

use std::sync::atomic::{AtomicU64, Ordering};

/// Byte sizes of Kademlia messages on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageSizes {
    /// `FIND_NODE` or `GET_PROVIDERS` request: the dialer's stream negotiation (40 B), a length
    /// prefix, the message type and the 36-byte key (a semantic key published as a CIDv1,
    /// `kindred_routing::keys::dht_key`; 41 B).
    pub request: u32,
    /// Fixed part of a response: the listener's negotiation echo (40 B), a length prefix and the
    /// message type.
    pub response_base: u32,
    /// Each peer (closer peer or provider) in a response: the peer id (40 B), its `/p2p`
    /// address (51 B), the connection type and the entry's own tag and length.
    pub peer_entry: u32,
    /// `ADD_PROVIDER` (answered by nothing): both negotiations, the key and the provider's
    /// entry.
    pub add_provider: u32,
}

impl Default for MessageSizes {
    fn default() -> Self {
        Self {
            request: 81,
            response_base: 44,
            peer_entry: 95,
            add_provider: 217,
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
