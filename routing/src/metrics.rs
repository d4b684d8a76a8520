//! Counters the node exports as Prometheus metrics: traffic per exchange kind and per peer,
//! rejects per reason, bans, lookups and DHT requests.
//!
//! Plain integers updated by the sans-IO core; the driver hands out snapshots
//! ([`RoutingMetrics`] is `Clone`). Byte counts are encoded RPC message sizes (what crosses a
//! yamux stream, before Noise framing). The per-peer table is bounded: past
//! [`MAX_PEERS_TRACKED`] peers, new peers are summed into [`RoutingMetrics::other_peers`].

use std::collections::{BTreeMap, HashMap};

use kindred_proto::rpc::RpcKind;
use libp2p::PeerId;

/// Most peers with their own traffic counters.
pub const MAX_PEERS_TRACKED: usize = 1024;

/// Requests and bytes, one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Messages.
    pub messages: u64,
    /// Encoded bytes.
    pub bytes: u64,
}

impl Traffic {
    fn add(&mut self, bytes: usize) {
        self.messages += 1;
        self.bytes += bytes as u64;
    }
}

/// Traffic of one exchange kind (`headers`, `body`, `snapshot`, `push` or `merge`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KindTraffic {
    /// Requests this node sent.
    pub requests_sent: Traffic,
    /// Responses this node received to them.
    pub responses_received: Traffic,
    /// Requests this node received.
    pub requests_received: Traffic,
    /// Responses this node sent.
    pub responses_sent: Traffic,
    /// Outbound requests that failed (timeout, closed connection, undecodable response...).
    pub failures: u64,
}

/// Traffic with one peer, all kinds together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerTraffic {
    /// Bytes received from the peer (requests and responses).
    pub bytes_in: u64,
    /// Bytes sent to the peer.
    pub bytes_out: u64,
    /// Requests received from the peer.
    pub requests_in: u64,
    /// Requests sent to the peer.
    pub requests_out: u64,
}

/// All routing counters.
#[derive(Debug, Clone, Default)]
pub struct RoutingMetrics {
    /// `GetHeaders` / `Headers` traffic.
    pub headers: KindTraffic,
    /// `GetBody` / `Body` traffic.
    pub body: KindTraffic,
    /// `GetSnapshot` / `Snapshot` traffic.
    pub snapshot: KindTraffic,
    /// `Push` / `PushAnswer` traffic (the hub exchange).
    pub push: KindTraffic,
    /// `GetMerge` / `Merge` traffic (the hub exchange).
    pub merge: KindTraffic,
    /// `GetChunk` / `Chunk` traffic: pieces of large snapshots and merges ([`crate::pieces`]).
    pub chunk: KindTraffic,
    /// Traffic per peer (bounded, see [`MAX_PEERS_TRACKED`]).
    pub peers: HashMap<PeerId, PeerTraffic>,
    /// Traffic of peers past the per-peer bound.
    pub other_peers: PeerTraffic,
    /// Rejected data or requests, by reason label (`bad_signature`, `rpc_oversize`, `bad_request`
    /// for an undecodable inbound request, `bad_identity` for a connection refused for its
    /// identity key, ...).
    pub rejects: BTreeMap<&'static str, u64>,
    /// Failed outbound requests by cause (`timeout`, `connection_closed`, ...), not the peer's
    /// fault as far as this node can tell, so not scored.
    pub request_failures: BTreeMap<&'static str, u64>,
    /// Peers banned.
    pub bans: u64,
    /// Round lookups started.
    pub lookups_started: u64,
    /// Round lookups finished (including timed out ones).
    pub lookups_finished: u64,
    /// Round lookups that hit their deadline.
    pub lookups_timed_out: u64,
    /// DHT provider lookups (one per key) completed.
    pub key_lookups: u64,
    /// Kademlia requests those provider lookups made (from kad's query statistics).
    pub kad_requests: u64,
    /// Keys announced (provider records published).
    pub keys_announced: u64,
    /// Kademlia requests those announcements made (walks and `ADD_PROVIDER`s, from kad's query
    /// statistics).
    pub announce_kad_requests: u64,
    /// Announcements of a key that failed.
    pub announce_failures: u64,
    /// Verified headers accepted into the index.
    pub headers_accepted: u64,
    /// Verified bodies fetched.
    pub bodies_accepted: u64,
    /// Bytes received over all connections, every protocol (Kademlia, identify, ping and the
    /// packet RPCs), above the muxer. Filled in by the driver; 0 for a bare core.
    pub wire_bytes_in: u64,
    /// Bytes sent over all connections, every protocol (see [`RoutingMetrics::wire_bytes_in`]).
    pub wire_bytes_out: u64,
    /// The same bytes by protocol ([`crate::wire`]). Filled in by the driver.
    pub wire: crate::wire::WireBytes,
    /// Bytes inside connections through relays, by protocol: never any of the packet and
    /// exchange RPCs ([`crate::direct_only`]). They also cross the connection to the relay,
    /// where `wire` counts them as relay traffic. Filled in by the driver.
    pub relayed_wire: crate::wire::WireBytes,
    /// Direct connections open now. Filled in by the driver.
    pub connections_direct: u64,
    /// Connections through relays open now. Filled in by the driver.
    pub connections_relayed: u64,
    /// Relay reservations granted to this node (renewals not counted).
    pub relay_reservations: u64,
    /// Hole punches that opened a direct connection (DCUtR).
    pub hole_punches: u64,
    /// Hole punches that failed after every attempt.
    pub hole_punch_failures: u64,
}

impl RoutingMetrics {
    fn kind(&mut self, kind: RpcKind) -> &mut KindTraffic {
        match kind {
            RpcKind::Headers => &mut self.headers,
            RpcKind::Body => &mut self.body,
            RpcKind::Snapshot => &mut self.snapshot,
            RpcKind::Chunk => &mut self.chunk,
            RpcKind::Push => &mut self.push,
            RpcKind::Merge => &mut self.merge,
        }
    }

    fn peer(&mut self, peer: &PeerId) -> &mut PeerTraffic {
        if !self.peers.contains_key(peer) && self.peers.len() >= MAX_PEERS_TRACKED {
            return &mut self.other_peers;
        }
        self.peers.entry(*peer).or_default()
    }

    pub(crate) fn request_sent(&mut self, peer: &PeerId, kind: RpcKind, bytes: usize) {
        self.kind(kind).requests_sent.add(bytes);
        let p = self.peer(peer);
        p.bytes_out += bytes as u64;
        p.requests_out += 1;
    }

    pub(crate) fn response_received(&mut self, peer: &PeerId, kind: RpcKind, bytes: usize) {
        self.kind(kind).responses_received.add(bytes);
        self.peer(peer).bytes_in += bytes as u64;
    }

    pub(crate) fn request_received(&mut self, peer: &PeerId, kind: RpcKind, bytes: usize) {
        self.kind(kind).requests_received.add(bytes);
        let p = self.peer(peer);
        p.bytes_in += bytes as u64;
        p.requests_in += 1;
    }

    pub(crate) fn response_sent(&mut self, peer: &PeerId, kind: RpcKind, bytes: usize) {
        self.kind(kind).responses_sent.add(bytes);
        self.peer(peer).bytes_out += bytes as u64;
    }

    pub(crate) fn request_failed(&mut self, kind: RpcKind, cause: &'static str) {
        self.kind(kind).failures += 1;
        *self.request_failures.entry(cause).or_default() += 1;
    }

    pub(crate) fn reject(&mut self, reason: &'static str) {
        *self.rejects.entry(reason).or_default() += 1;
    }

    /// Total rejects over all reasons.
    pub fn total_rejects(&self) -> u64 {
        self.rejects.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_peer_table_is_bounded() {
        let mut m = RoutingMetrics::default();
        for _ in 0..MAX_PEERS_TRACKED + 10 {
            m.request_sent(&PeerId::random(), RpcKind::Headers, 10);
        }
        assert_eq!(m.peers.len(), MAX_PEERS_TRACKED);
        assert_eq!(m.other_peers.requests_out, 10);
        assert_eq!(
            m.headers.requests_sent.messages,
            MAX_PEERS_TRACKED as u64 + 10
        );
        assert_eq!(
            m.headers.requests_sent.bytes,
            10 * (MAX_PEERS_TRACKED as u64 + 10)
        );
    }
}
