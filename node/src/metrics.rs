//! Prometheus metrics of a node, served at `GET /metrics` on the local API.
//!
//! Two sources: the round loop updates its own counters and histograms directly (rounds, round
//! and lookup durations, partners, loss, accuracy, merge verdicts), and the routing layer's
//! counters (bytes and messages per exchange kind and direction, rejects by reason, bans, DHT
//! requests) are copied from the last [`RoutingMetrics`] snapshot at scrape time by a collector,
//! so routing keeps plain integers and never depends on Prometheus. Reachability gauges
//! (connected peers, routing table, bans in force, Kademlia server mode, confirmed external
//! addresses) are set from the routing task's [`NodeInfo`] after each round.
//!
//! `node/dashboards/kindred.json` is a Grafana dashboard over these metrics; the
//! `kindred-tests` `dashboard` test checks that every metric it queries is exported.

use std::sync::{Arc, Mutex, PoisonError};

use kindred_routing::metrics::{KindTraffic, RoutingMetrics};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicI64, AtomicU64};

use kindred_routing::NodeInfo;
use kindred_routing::identity_gate::BAD_IDENTITY;
use kindred_routing::reachability::NatStatus;

/// One label: a merge verdict (`accepted` or a rejection reason), or a lookup mode.
type Labels = Vec<(&'static str, String)>;

/// The node's metrics and the registry that renders them.
#[derive(Debug)]
pub struct NodeMetrics {
    registry: Registry,
    routing: Arc<RoutingSnapshot>,
    /// Completed rounds.
    pub rounds: Counter,
    /// Wall time of a whole round, seconds.
    pub round_seconds: Histogram,
    /// Wall time of a partner lookup (keys, headers, bodies) or, in the hub exchange, of a
    /// DHT search (keys and headers), seconds.
    pub lookup_seconds: Histogram,
    /// Peers merged per round.
    pub partners: Histogram,
    /// Bytes of our own packets (header + body) per round.
    pub packet_bytes: Histogram,
    /// Local training loss of the last round.
    pub loss: Gauge<f64, AtomicU64>,
    /// Held-out accuracy after the last round.
    pub accuracy: Gauge<f64, AtomicU64>,
    /// Merge verdicts on fetched peer updates, by outcome.
    pub merge_verdicts: Family<Labels, Counter>,
    /// Partner lookups by mode: `search` (the DHT, in warm-up and when following nobody),
    /// `refresh` (the DHT on a few shards of each hot band, in later discovery rounds) or
    /// `follow` (the partners found before, asked directly).
    pub lookups: Family<Labels, Counter>,
    /// Model snapshot pulls by outcome (`pulled`, `clipped`, or why none: `not_found`,
    /// `deadline`...).
    pub snapshot_pulls: Family<Labels, Counter>,
    /// Hub-exchange rounds by the node's role (`hub`, `member`, `local`).
    pub exchange_rounds: Family<Labels, Counter>,
    /// Hub-exchange merges by outcome: `served` (as a hub, one per member served), `applied`,
    /// `refused` (by the node's checks), `missed` (none came: the node applied its own update).
    pub exchange_merges: Family<Labels, Counter>,
    /// Pushes received as a hub.
    pub exchange_pushes: Counter,
    /// Peers banned by the exchange (merges or models that failed twice).
    pub exchange_bans: Counter,
    /// Peers in the node's cohort view after the last round.
    pub exchange_cohort: Gauge<i64, std::sync::atomic::AtomicI64>,
    /// Whether the node was its cohort's hub in the last round (1) or not (0).
    pub exchange_is_hub: Gauge<i64, std::sync::atomic::AtomicI64>,
    /// Reachability, from the routing task's connectivity after the last round
    /// ([`NodeMetrics::set_reachability`]).
    reachability: Reachability,
}

/// Gauges of the node's connectivity, set from a [`NodeInfo`].
#[derive(Debug, Default)]
struct Reachability {
    connected: Gauge<i64, AtomicI64>,
    routing_table: Gauge<i64, AtomicI64>,
    banned: Gauge<i64, AtomicI64>,
    kad_server: Gauge<i64, AtomicI64>,
    external_addrs: Gauge<i64, AtomicI64>,
    bootstraps_cut: Gauge<i64, AtomicI64>,
    nat_public: Gauge<i64, AtomicI64>,
}

/// Label values known in advance, exported at 0 from the start so that every series exists
/// before its first event (a dashboard or an alert on `rate()` sees 0, not "no data").
const EXCHANGE_ROLES: [&str; 3] = ["hub", "member", "local"];
const EXCHANGE_OUTCOMES: [&str; 4] = ["served", "applied", "refused", "missed"];
const LOOKUP_MODES: [&str; 3] = ["search", "refresh", "follow"];

/// Reject reasons exported at 0 until the first one (the others appear when they first occur):
/// the forged-packet and wrong-identity rejects an operator watches for.
fn common_reject_reasons() -> [&'static str; 4] {
    [
        kindred_proto::DecodeError::BadSignature.reason(),
        kindred_proto::DecodeError::BodyHashMismatch.reason(),
        kindred_proto::rpc::RpcDecodeError::Truncated.reason(),
        BAD_IDENTITY,
    ]
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// A fresh registry with every metric registered under the `kindred` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kindred");
        let routing = Arc::new(RoutingSnapshot::default());
        let rounds = Counter::default();
        let round_seconds = Histogram::new(exponential_buckets(0.05, 2.0, 12));
        let lookup_seconds = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        let partners = Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0]);
        let packet_bytes = Histogram::new(exponential_buckets(256.0, 2.0, 16));
        let loss = Gauge::<f64, AtomicU64>::default();
        let accuracy = Gauge::<f64, AtomicU64>::default();
        let merge_verdicts = Family::<Labels, Counter>::default();
        let lookups = Family::<Labels, Counter>::default();
        registry.register("rounds", "Completed rounds", rounds.clone());
        registry.register(
            "round_seconds",
            "Wall time of a round",
            round_seconds.clone(),
        );
        registry.register(
            "lookup_seconds",
            "Wall time of the partner lookup",
            lookup_seconds.clone(),
        );
        registry.register("partners", "Peers merged per round", partners.clone());
        registry.register(
            "packet_bytes",
            "Bytes of our own packet per round",
            packet_bytes.clone(),
        );
        registry.register(
            "loss",
            "Local training loss of the last round",
            loss.clone(),
        );
        registry.register(
            "accuracy",
            "Held-out accuracy after the last round",
            accuracy.clone(),
        );
        registry.register(
            "merge_verdicts",
            "Merge verdicts on peer updates",
            merge_verdicts.clone(),
        );
        registry.register(
            "partner_lookups",
            "Partner lookups by mode (search or refresh: the DHT; follow: known partners)",
            lookups.clone(),
        );
        let snapshot_pulls = Family::<Labels, Counter>::default();
        registry.register(
            "snapshot_pulls",
            "Model snapshot pulls by outcome (pulled, clipped, or why none)",
            snapshot_pulls.clone(),
        );
        let exchange_rounds = Family::<Labels, Counter>::default();
        registry.register(
            "exchange_rounds",
            "Hub-exchange rounds by the node's role (hub, member, local)",
            exchange_rounds.clone(),
        );
        let exchange_merges = Family::<Labels, Counter>::default();
        registry.register(
            "exchange_merges",
            "Hub-exchange merges by outcome (served, applied, refused, missed)",
            exchange_merges.clone(),
        );
        let exchange_pushes = Counter::default();
        registry.register(
            "exchange_pushes",
            "Pushes received as a hub",
            exchange_pushes.clone(),
        );
        let exchange_bans = Counter::default();
        registry.register(
            "exchange_bans",
            "Peers banned by the exchange",
            exchange_bans.clone(),
        );
        let exchange_cohort = Gauge::default();
        registry.register(
            "exchange_cohort",
            "Peers in the node's cohort view",
            exchange_cohort.clone(),
        );
        let exchange_is_hub = Gauge::default();
        registry.register(
            "exchange_is_hub",
            "Whether the node was its cohort's hub in the last round",
            exchange_is_hub.clone(),
        );
        let reachability = Reachability::default();
        reachability.nat_public.set(-1);
        for (name, help, gauge) in [
            (
                "connected_peers",
                "Peers with an open connection",
                &reachability.connected,
            ),
            (
                "routing_table_peers",
                "Peers in the Kademlia routing table",
                &reachability.routing_table,
            ),
            ("banned_peers", "Peers banned now", &reachability.banned),
            (
                "kademlia_server",
                "Whether Kademlia runs in server mode, answering other peers' queries (1) or \
                 client mode (0)",
                &reachability.kad_server,
            ),
            (
                "external_addresses",
                "Addresses confirmed reachable from other peers",
                &reachability.external_addrs,
            ),
            (
                "reachable",
                "Whether peers can dial this node, from AutoNAT dial-back tests: 1 public, 0 \
                 private (behind NAT or a firewall), -1 unknown (no test finished yet)",
                &reachability.nat_public,
            ),
            (
                "kademlia_bootstraps_cut",
                "Kademlia bootstraps libp2p started on its own that the node ended early (one \
                 runs per bootstrap throttle)",
                &reachability.bootstraps_cut,
            ),
        ] {
            registry.register(name, help, gauge.clone());
        }
        // Creating a series is enough: it starts at 0.
        let preset = |family: &Family<Labels, Counter>, label: &'static str, values: &[&str]| {
            for value in values {
                let _ = family.get_or_create(&vec![(label, (*value).to_string())]);
            }
        };
        preset(&exchange_rounds, "role", &EXCHANGE_ROLES);
        preset(&exchange_merges, "outcome", &EXCHANGE_OUTCOMES);
        preset(&lookups, "mode", &LOOKUP_MODES);
        preset(&merge_verdicts, "verdict", &["accepted"]);
        registry.register_collector(Box::new(routing.clone()));
        Self {
            registry,
            routing,
            rounds,
            round_seconds,
            lookup_seconds,
            partners,
            packet_bytes,
            loss,
            accuracy,
            merge_verdicts,
            lookups,
            snapshot_pulls,
            exchange_rounds,
            exchange_merges,
            exchange_pushes,
            exchange_bans,
            exchange_cohort,
            exchange_is_hub,
            reachability,
        }
    }

    /// Set the reachability gauges from the routing task's connectivity snapshot.
    pub fn set_reachability(&self, info: &NodeInfo) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let r = &self.reachability;
        r.connected.set(count(info.connected.len()));
        r.routing_table.set(count(info.routing_table));
        r.banned.set(count(info.banned.len()));
        r.kad_server.set(i64::from(info.kad_server));
        r.external_addrs.set(count(info.external_addrs.len()));
        r.nat_public.set(match info.reachability {
            NatStatus::Public => 1,
            NatStatus::Private => 0,
            NatStatus::Unknown => -1,
        });
        r.bootstraps_cut
            .set(i64::try_from(info.bootstraps_cut).unwrap_or(i64::MAX));
    }

    /// Replace the routing counters shown at the next scrape.
    pub fn set_routing(&self, snapshot: RoutingMetrics) {
        *self
            .routing
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(snapshot);
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The last routing snapshot, rendered on scrape.
#[derive(Debug, Default)]
struct RoutingSnapshot(Mutex<Option<RoutingMetrics>>);

impl Collector for RoutingSnapshot {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(m) = guard.as_ref() else {
            return Ok(());
        };

        let traffic = |k: &KindTraffic| {
            [
                ("out", "request", k.requests_sent),
                ("in", "response", k.responses_received),
                ("in", "request", k.requests_received),
                ("out", "response", k.responses_sent),
            ]
        };
        for (name, help, bytes) in [
            (
                "rpc_bytes",
                "Encoded RPC bytes by exchange kind, direction and message",
                true,
            ),
            (
                "rpc_messages",
                "RPC messages by exchange kind, direction and message",
                false,
            ),
        ] {
            let counter = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            for (kind, k) in [
                ("headers", &m.headers),
                ("body", &m.body),
                ("snapshot", &m.snapshot),
                ("push", &m.push),
                ("merge", &m.merge),
                ("chunk", &m.chunk),
            ] {
                for (direction, message, t) in traffic(k) {
                    let labels = [
                        ("kind", kind),
                        ("direction", direction),
                        ("message", message),
                    ];
                    let value = if bytes { t.bytes } else { t.messages };
                    ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
                }
            }
        }

        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "wire_bytes",
            "Bytes over all connections, every protocol (Kademlia included), by direction",
            None,
            counter.metric_type(),
        )?;
        for (direction, value) in [("in", m.wire_bytes_in), ("out", m.wire_bytes_out)] {
            ConstCounter::new(value).encode(family.encode_family(&[("direction", direction)])?)?;
        }

        encode_by_protocol(
            &mut encoder,
            "wire_protocol_bytes",
            "Bytes over all connections by protocol (kademlia, rpc, identify, ping, autonat, \
             relay, dcutr, other) and direction",
            &m.wire,
        )?;
        encode_by_protocol(
            &mut encoder,
            "relayed_protocol_bytes",
            "Bytes inside connections through relays by protocol and direction (rpc stays 0: \
             exchange traffic waits for a direct connection); they cross the relay connection \
             too, counted there under wire_protocol_bytes{protocol=\"relay\"}",
            &m.relayed_wire,
        )?;

        let gauge = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "connections",
            "Connections open now, by type (direct, relayed)",
            None,
            gauge.metric_type(),
        )?;
        for (kind, n) in [
            ("direct", m.connections_direct),
            ("relayed", m.connections_relayed),
        ] {
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(family.encode_family(&[("type", kind)])?)?;
        }

        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "rejects",
            "Invalid data received, by reason",
            None,
            counter.metric_type(),
        )?;
        for reason in common_reject_reasons() {
            if !m.rejects.contains_key(reason) {
                ConstCounter::new(0u64).encode(family.encode_family(&[("reason", reason)])?)?;
            }
        }
        for (reason, n) in &m.rejects {
            ConstCounter::new(*n).encode(family.encode_family(&[("reason", *reason)])?)?;
        }

        for (name, help, value) in [
            ("bans", "Peers banned for invalid data", m.bans),
            ("lookups", "Partner lookups started", m.lookups_started),
            (
                "lookups_timed_out",
                "Partner lookups that hit their deadline",
                m.lookups_timed_out,
            ),
            (
                "kad_requests",
                "Kademlia requests sent by lookups",
                m.kad_requests,
            ),
            (
                "announce_kad_requests",
                "Kademlia requests sent by announcements",
                m.announce_kad_requests,
            ),
            (
                "keys_announced",
                "Semantic keys announced",
                m.keys_announced,
            ),
            (
                "headers_accepted",
                "Peer headers verified and indexed",
                m.headers_accepted,
            ),
            ("bodies_accepted", "Peer bodies verified", m.bodies_accepted),
            (
                "relay_reservations",
                "Relay reservations granted to this node (renewals not counted)",
                m.relay_reservations,
            ),
            (
                "hole_punches",
                "Hole punches that opened a direct connection",
                m.hole_punches,
            ),
            (
                "hole_punch_failures",
                "Hole punches that failed after every attempt",
                m.hole_punch_failures,
            ),
        ] {
            let c = ConstCounter::new(value);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        Ok(())
    }
}

/// One counter family of `bytes` by protocol and direction.
fn encode_by_protocol(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    bytes: &kindred_routing::wire::WireBytes,
) -> Result<(), std::fmt::Error> {
    let counter = ConstCounter::new(0u64);
    let mut family = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
    for (protocol, bytes_in, bytes_out) in bytes.by_protocol() {
        for (direction, value) in [("in", bytes_in), ("out", bytes_out)] {
            let labels = [("protocol", protocol.label()), ("direction", direction)];
            ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// CPU time of each thread of this process (Linux: the scheduler's nanosecond counters in
/// `/proc/self/task/*/schedstat`), to measure what one step cost in CPU across all threads.
#[derive(Debug, Clone, Default)]
pub struct CpuTimes(std::collections::HashMap<u64, u64>);

impl CpuTimes {
    /// The counters now; `None` where the platform does not expose them.
    pub fn now() -> Option<Self> {
        let mut times = std::collections::HashMap::new();
        for task in std::fs::read_dir("/proc/self/task").ok()? {
            let path = task.ok()?.path();
            let Some(tid) = path.file_name().and_then(|n| n.to_str()?.parse().ok()) else {
                continue;
            };
            // A thread may exit between listing and reading: skip it.
            let Ok(text) = std::fs::read_to_string(path.join("schedstat")) else {
                continue;
            };
            times.insert(tid, text.split_whitespace().next()?.parse().ok()?);
        }
        Some(Self(times))
    }

    /// CPU seconds used since `earlier` by the threads alive now (a thread started since counts
    /// whole; one that exited since is not counted).
    pub fn since(&self, earlier: &Self) -> f64 {
        let ns: u64 = self
            .0
            .iter()
            .map(|(tid, &ns)| ns.saturating_sub(earlier.0.get(tid).copied().unwrap_or(0)))
            .sum();
        ns as f64 / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_node_and_routing_metrics() {
        let m = NodeMetrics::new();
        m.rounds.inc();
        m.accuracy.set(0.9);
        m.merge_verdicts
            .get_or_create(&vec![("verdict", "low_cosine".to_string())])
            .inc();
        m.lookups
            .get_or_create(&vec![("mode", "follow".to_string())])
            .inc_by(7);
        let mut r = RoutingMetrics::default();
        r.body.responses_sent.bytes = 12345;
        r.push.requests_received.messages = 4;
        r.merge.requests_sent.messages = 2;
        r.rejects.insert("bad_signature", 3);
        r.wire_bytes_out = 777;
        m.set_routing(r);
        let text = m.render();
        assert!(text.contains("kindred_rounds_total 1"), "{text}");
        assert!(text.contains("kindred_accuracy 0.9"), "{text}");
        assert!(
            text.contains(r#"kindred_merge_verdicts_total{verdict="low_cosine"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kindred_partner_lookups_total{mode="follow"} 7"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kindred_rpc_bytes_total{kind="body",direction="out",message="response"} 12345"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kindred_rpc_messages_total{kind="push",direction="in",message="request"} 4"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kindred_rpc_messages_total{kind="merge",direction="out",message="request"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"kindred_rejects_total{reason="bad_signature"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kindred_wire_bytes_total{direction="out"} 777"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kindred_wire_protocol_bytes_total{protocol="kademlia",direction="in"} 0"#
            ),
            "{text}"
        );
        // Reject reasons known in advance are exported at 0 beside those counted.
        assert!(
            text.contains(r#"kindred_rejects_total{reason="bad_identity"} 0"#),
            "{text}"
        );
        assert_eq!(
            text.matches(r#"kindred_rejects_total{reason="bad_signature"}"#)
                .count(),
            1,
            "{text}"
        );
        // Every metric family is declared once.
        let mut types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE")).collect();
        let all = types.len();
        types.sort_unstable();
        types.dedup();
        assert_eq!(types.len(), all, "{text}");
    }

    #[test]
    fn label_values_known_in_advance_start_at_zero() {
        let text = NodeMetrics::new().render();
        for line in [
            r#"kindred_exchange_rounds_total{role="hub"} 0"#,
            r#"kindred_exchange_rounds_total{role="member"} 0"#,
            r#"kindred_exchange_rounds_total{role="local"} 0"#,
            r#"kindred_exchange_merges_total{outcome="missed"} 0"#,
            r#"kindred_partner_lookups_total{mode="search"} 0"#,
            r#"kindred_merge_verdicts_total{verdict="accepted"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        // Before the first round there is no routing snapshot, hence no reject series.
        assert!(!text.contains("kindred_rejects_total"), "{text}");
    }

    #[test]
    fn reachability_gauges_follow_the_routing_info() {
        let m = NodeMetrics::new();
        let text = m.render();
        for line in [
            "kindred_connected_peers 0",
            "kindred_kademlia_server 0",
            "kindred_external_addresses 0",
            "kindred_reachable -1",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        let peers: Vec<libp2p::PeerId> = (0..3).map(|_| libp2p::PeerId::random()).collect();
        let info = NodeInfo {
            peer_id: libp2p::PeerId::random(),
            listen_addrs: Vec::new(),
            connected: peers.clone(),
            routing_table: 5,
            banned: peers[..1].to_vec(),
            dropped_events: 0,
            bootstraps_cut: 2,
            kad_server: true,
            external_addrs: vec!["/ip4/127.0.0.1/tcp/4001".parse().unwrap()],
            reachability: NatStatus::Public,
            relays: Vec::new(),
            direct: Vec::new(),
            relay_only: Vec::new(),
        };
        m.set_reachability(&info);
        let text = m.render();
        for line in [
            "kindred_connected_peers 3",
            "kindred_routing_table_peers 5",
            "kindred_banned_peers 1",
            "kindred_kademlia_server 1",
            "kindred_external_addresses 1",
            "kindred_kademlia_bootstraps_cut 2",
            "kindred_reachable 1",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        // Back to client mode, every peer gone.
        m.set_reachability(&NodeInfo {
            connected: Vec::new(),
            kad_server: false,
            external_addrs: Vec::new(),
            reachability: NatStatus::Private,
            ..info
        });
        let text = m.render();
        assert!(text.contains("kindred_reachable 0"), "{text}");
        assert!(text.contains("kindred_connected_peers 0"), "{text}");
        assert!(text.contains("kindred_kademlia_server 0"), "{text}");
    }
}
