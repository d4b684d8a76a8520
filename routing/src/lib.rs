//! Kindred's routing: how nodes whose updates point the same way find each other.
//!
//! libp2p-kad hashes record keys before measuring XOR distance, so similar keys do not land on
//! nearby nodes. Locality therefore comes from exact-bucket rendezvous: the 256-bit SimHash of an
//! update's embedding is cut into L bands of b bits, each band becomes one DHT key
//! (`blake3(network ‖ model ‖ round window ‖ band index ‖ band bits)`, published on the DHT as a
//! CIDv1 with a blake3 multihash so that every libp2p implementation accepts it:
//! [`keys::dht_key`]), and a node announces itself as provider of its keys and looks up the same
//! keys plus multi-probe neighbours. Similar updates share at least one band with high
//! probability, and each probe costs one O(log N) lookup.
//!
//! Fetching is two-phase so that traffic follows the partners a node actually merges with: a
//! provider is first asked for its small signed *headers*; they are verified, indexed in a local
//! `hnsw_rs` graph and ranked by sketch cosine; only the best `m` *bodies* are then fetched, by id.
//!
//! # Layout
//! - [`keys`]: semantic keys, multi-probe order and hot-key sharding. Pure functions, no libp2p
//!   types, shared with the simulator.
//! - [`RoutingCore`] ([`core`], [`lookup`], `serve`): the sans-IO state machine: announcing,
//!   round lookups, verification, replay filtering ([`replay`]), peer scoring and bans
//!   ([`scoring`]), the local index ([`index`]), model snapshot fetches ([`snapshot`]) and
//!   counters ([`metrics`]). Takes `now` and inputs, returns [`Output`]s.
//! - The libp2p layer: [`behaviour`] (identity gate + ban list + limits + kad + identify + ping +
//!   AutoNAT ([`reachability`]) + relay v2 + DCUtR + request-response), [`identity_gate`]
//!   (refuses weak or non-canonical identity keys, which Noise accepts), [`codec`] (framing with
//!   size limits; invalid requests reach the driver to be scored), [`direct_only`] (the RPCs
//!   never run over a relayed connection), [`transport`] (TCP/QUIC/memory, relay circuits,
//!   pnet, Noise, yamux).
//! - The tokio driver: [`spawn`] returns a [`RoutingHandle`] (async `announce`,
//!   `find_partners`, `fetch_snapshot`, `dial`, `bootstrap`, `metrics`) and a bounded [`RoutingEvent`] stream.
//!   Requests are served from the node's storage through [`store::PacketStore`].
//!
//! # Driving it from a node
//! Per round: seal the packet, put it in the store, `announce(header)`, then
//! `find_partners(PartnerQuery::new(header, margins, spec))`. The result holds ranked verified
//! candidate headers and the verified bodies of the top `m` above the cosine gate, ready for
//! synthesis. Every few rounds, [`RoutingHandle::fetch_snapshot`] fetches one partner's verified
//! model snapshot (served from [`store::PacketStore::snapshot`]; past 64 MiB in resumable
//! pieces, [`snapshot`]). Persist
//! [`RoutingHandle::replay_marks`] (and restore them with
//! [`RoutingHandle::restore_replay_marks`]) if replay protection must survive restarts.
#![deny(clippy::indexing_slicing)]

mod addr_book;
pub mod behaviour;
pub(crate) mod bootstrap;
pub mod codec;
pub mod cohort;
pub mod config;
pub mod core;
pub mod direct_only;
pub mod discovery;
mod driver;
pub mod exchange;
pub mod exchange_rpc;
mod handle;
pub mod identity_gate;
pub mod index;
pub mod keys;
pub mod lookup;
pub mod metrics;
pub mod pieces;
pub mod reachability;
pub mod replay;
pub mod scoring;
mod serve;
pub mod snapshot;
pub mod store;
pub mod transport;
pub mod wire;

pub use cohort::{Cohort, hub_rank, hub_rank_at, is_hub_candidate, relay_only_rank};
pub use config::{
    ConnectionConfig, CoreConfig, CosineGate, KadConfig, KadMode, LookupConfig, RelayServerConfig,
    RoutingConfig, TransportConfig, TransportKind,
};
pub use core::{AnnounceError, AnnounceId, AnnounceReport, Output, RequestFailure, RoutingCore};
pub use discovery::{Discovery, Follower, RoundPlan};
pub use exchange_rpc::{
    ExchangeCall, ExchangeCallId, ExchangeError, ExchangeReply, ExchangeResponder, HubAnswer,
    InboundCall, InboundExchange, PushedPacket, ServedWith,
};
pub use handle::{
    BootstrapError, DialError, NodeInfo, ReplayMark, RoutingEvent, RoutingHandle, SpawnError, spawn,
};
pub use keys::{KeyConfig, KeyContext, NetworkId, RoundWindow, SemanticKey};
pub use lookup::{
    Candidate, FetchedPacket, LookupError, LookupId, LookupStats, PartnerQuery, Partners,
};
pub use metrics::RoutingMetrics;
pub use snapshot::{SnapshotError, SnapshotFetchId};
pub use store::{MemoryStore, PacketStore, StoredSnapshot};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
