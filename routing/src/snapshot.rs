//! Fetching a peer's model snapshot: one `GetSnapshot` request, one verified answer.
//!
//! Merging updates alone lets the models of nodes that share data drift apart: a partner's update
//! is computed at the partner's parameters, and nothing pulls two nodes' models toward each
//! other. So every few rounds a node asks one partner it merged for its whole model (its
//! cumulative update, sealed with [`kindred_proto::seal_snapshot`]) and moves part of the way
//! toward it (`kindred_distill::pull`). Routing only moves and verifies the snapshot: the answer
//! must be a snapshot signed by the peer asked, of the local model, from a recent round, or the
//! fetch fails (and a peer that sent invalid bytes is penalised like one that sent a bad packet).
//!
//! Serving is narrow too. A snapshot answer is the whole model (up to 2 GiB) for a 9-byte
//! request, so a node serves it only to a peer it just served a packet body to: each body served
//! grants that peer one snapshot fetch, for [`crate::CoreConfig::snapshot_grant`]. That is
//! exactly the honest flow (a node fetches the snapshot of a partner whose update it merged),
//! and it bounds what a peer can pull out of a node to one snapshot per body it fetched.
//!
//! A snapshot is the whole model, and past one response's limit (64 MiB: an int8 snapshot of
//! about 6.7 × 10^7 parameters) it travels in pieces. The answer to `GetSnapshot` is then the
//! signed header alone; the fetcher checks it (signer, model, round) and asks for the body a
//! piece at a time by its hash (`GetChunk`, [`crate::CoreConfig::chunk_bytes`] each:
//! [`crate::pieces`]), every piece exactly as long as asked. A piece that does not come (a
//! timeout, a dropped connection) is asked for again from where the body stopped, up to
//! [`CHUNK_RETRIES`] times in a row, so a fetch resumes instead of starting over; the request
//! re-dials the peer. The whole
//! body is checked against the header's length and blake3 hash before it is decoded, so a
//! tampered piece fails the fetch (and penalises the peer) before anything uses the model. The
//! pieces are not checked one by one: a peer that lies wastes one fetch of the fetcher's
//! bandwidth, and then it is penalised like any other invalid answer.
//!
//! Sans-IO like the rest of the core: [`RoutingCore::fetch_snapshot`] emits an
//! [`Output::SendRequest`], and the responses reported through
//! [`RoutingCore::handle_response`] end in one [`Output::SnapshotFetched`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kindred_proto::rpc::{RequestId, RpcErrorCode, RpcKind, RpcRequest, RpcResponse};
use kindred_proto::{ModelSpec, OutcomePacket, decode_snapshot_header};
use libp2p::PeerId;

use crate::core::{Output, RequestFailure, RoutingCore};
use crate::pieces::{Download, Failed, Step};
use crate::scoring::Severity;

/// Identifies one snapshot fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SnapshotFetchId(pub u64);

/// Why a peer's snapshot could not be fetched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The peer has no snapshot to serve (it has not finished a round since it started, or it
    /// does not serve snapshots).
    #[error("the peer has no snapshot to serve")]
    NotFound,
    /// The peer refused (it has banned this node, or is shutting down), or this node has banned
    /// the peer.
    #[error("the request was refused")]
    Refused,
    /// No usable answer, for a reason that is not the peer's fault as far as this node can tell
    /// (timeout, closed connection...): the label names it.
    #[error("the request failed: {0}")]
    Failed(&'static str),
    /// The peer answered with bytes that are not a valid snapshot for this model from itself:
    /// the label names why, and the peer was penalised.
    #[error("the peer sent an invalid snapshot: {0}")]
    Invalid(&'static str),
    /// A valid snapshot, but older than the caller accepts.
    #[error("the snapshot is of round {found}, older than round {oldest}")]
    Stale {
        /// The snapshot's round.
        found: u64,
        /// The oldest round accepted.
        oldest: u64,
    },
    /// The routing driver has stopped.
    #[error("the routing driver has stopped")]
    Stopped,
}

pub use crate::pieces::CHUNK_RETRIES;

/// A snapshot fetch waiting for its response.
#[derive(Debug)]
pub(crate) struct SnapshotFetch {
    pub(crate) fetch: SnapshotFetchId,
    pub(crate) peer: PeerId,
    pub(crate) spec: Arc<ModelSpec>,
    pub(crate) oldest_round: u64,
    /// A large snapshot's body as it arrives, once its header came.
    pub(crate) download: Option<Download>,
}

/// Peers allowed one snapshot fetch each, since when: granted by serving them a body. A peer
/// answered with a large snapshot's header may then fetch that body's pieces, for as long.
#[derive(Debug, Default)]
pub(crate) struct SnapshotGrants {
    granted: HashMap<PeerId, Instant>,
    chunks: HashMap<PeerId, ([u8; 32], Instant)>,
}

impl SnapshotGrants {
    /// Most peers holding a grant at once; past it, expired grants are dropped, then the oldest.
    const CAPACITY: usize = 4096;

    /// `peer` was served a body at `now`: it may fetch the snapshot once.
    pub(crate) fn grant(&mut self, peer: PeerId, now: Instant, ttl: Duration) {
        if self.granted.len() >= Self::CAPACITY && !self.granted.contains_key(&peer) {
            self.granted
                .retain(|_, at| now.saturating_duration_since(*at) < ttl);
            if self.granted.len() >= Self::CAPACITY
                && let Some(oldest) = self
                    .granted
                    .iter()
                    .min_by_key(|(_, at)| **at)
                    .map(|(p, _)| *p)
            {
                self.granted.remove(&oldest);
            }
        }
        self.granted.insert(peer, now);
    }

    /// Use `peer`'s grant, if it holds an unexpired one.
    pub(crate) fn take(&mut self, peer: &PeerId, now: Instant, ttl: Duration) -> bool {
        self.granted
            .remove(peer)
            .is_some_and(|at| now.saturating_duration_since(at) < ttl)
    }

    /// `peer` was answered with the header of the snapshot whose body hashes to `hash`: it may
    /// fetch that body's pieces.
    fn open_chunks(&mut self, peer: PeerId, hash: [u8; 32], now: Instant, ttl: Duration) {
        if self.chunks.len() >= Self::CAPACITY && !self.chunks.contains_key(&peer) {
            self.chunks
                .retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
            if self.chunks.len() >= Self::CAPACITY {
                return;
            }
        }
        self.chunks.insert(peer, (hash, now));
    }

    /// Whether `peer` may fetch a piece of the body hashing to `hash`.
    fn chunk_allowed(&self, peer: &PeerId, hash: &[u8; 32], now: Instant, ttl: Duration) -> bool {
        self.chunks
            .get(peer)
            .is_some_and(|(h, at)| h == hash && now.saturating_duration_since(*at) < ttl)
    }
}

impl RoutingCore {
    /// Whether `peer` may fetch this node's snapshot now (using up its grant if so).
    pub(crate) fn may_fetch_snapshot(&mut self, peer: &PeerId, now: Instant) -> bool {
        match self.config.snapshot_grant {
            None => true,
            Some(ttl) => self.snapshot_grants.take(peer, now, ttl),
        }
    }

    /// `peer` was answered with a large snapshot's header: it may fetch its body's pieces.
    pub(crate) fn open_snapshot_chunks(&mut self, peer: PeerId, hash: [u8; 32], now: Instant) {
        if let Some(ttl) = self.config.snapshot_grant {
            self.snapshot_grants.open_chunks(peer, hash, now, ttl);
        }
    }

    /// Whether `peer` may fetch a piece of the snapshot body hashing to `hash` now.
    pub(crate) fn may_fetch_snapshot_chunk(
        &self,
        peer: &PeerId,
        hash: &[u8; 32],
        now: Instant,
    ) -> bool {
        match self.config.snapshot_grant {
            None => true,
            Some(ttl) => self.snapshot_grants.chunk_allowed(peer, hash, now, ttl),
        }
    }

    /// `peer` was just served a body: it may fetch the snapshot once.
    pub(crate) fn grant_snapshot(&mut self, peer: PeerId, now: Instant) {
        if let Some(ttl) = self.config.snapshot_grant {
            self.snapshot_grants.grant(peer, now, ttl);
        }
    }

    /// Ask `peer` for its model snapshot, to be decoded against `spec` and accepted only from
    /// round `oldest_round` on.
    ///
    /// Emits an [`Output::SendRequest`] (or, for a banned peer, at once an
    /// [`Output::SnapshotFetched`] with [`SnapshotError::Refused`]); the response goes to
    /// [`RoutingCore::handle_response`] like any other, and ends the fetch with one
    /// [`Output::SnapshotFetched`]. The request's time limit is the transport's.
    pub fn fetch_snapshot(
        &mut self,
        peer: PeerId,
        spec: Arc<ModelSpec>,
        oldest_round: u64,
        now: Instant,
    ) -> SnapshotFetchId {
        let fetch = SnapshotFetchId(self.next_id());
        if self.scores.is_banned(&peer, now) {
            self.outputs.push_back(Output::SnapshotFetched {
                fetch,
                result: Err(SnapshotError::Refused),
            });
            return fetch;
        }
        let id = RequestId(self.next_id());
        let request = RpcRequest::GetSnapshot { id };
        self.metrics
            .request_sent(&peer, RpcKind::Snapshot, request.encoded_len());
        self.snapshot_fetches.insert(
            id,
            SnapshotFetch {
                fetch,
                peer,
                spec,
                oldest_round,
                download: None,
            },
        );
        self.outputs
            .push_back(Output::SendRequest { peer, request });
        fetch
    }

    /// A response to one of a [`RoutingCore::fetch_snapshot`]'s requests (called from
    /// `handle_response`, which has checked that `peer` is the one asked).
    pub(crate) fn on_snapshot_response(
        &mut self,
        peer: PeerId,
        id: RequestId,
        mut pending: SnapshotFetch,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) {
        match self.snapshot_step(peer, id, &mut pending, result, now) {
            Step::Next => {
                if let Some(d) = &pending.download {
                    let id = self.ask_piece(peer, d);
                    self.snapshot_fetches.insert(id, pending);
                }
            }
            Step::Done(result) => {
                if result.is_ok() {
                    self.scores.reward(&peer, now);
                }
                self.outputs.push_back(Output::SnapshotFetched {
                    fetch: pending.fetch,
                    result,
                });
            }
        }
    }

    fn snapshot_step(
        &mut self,
        peer: PeerId,
        id: RequestId,
        pending: &mut SnapshotFetch,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) -> Step<Result<Box<OutcomePacket>, SnapshotError>> {
        let kind = if pending.download.is_some() {
            RpcKind::Chunk
        } else {
            RpcKind::Snapshot
        };
        let response = match result {
            Ok(response) => response,
            Err(failure) => {
                let download = pending.download.as_mut();
                return match self.transfer_failed(peer, kind, &failure, download, now) {
                    Failed::Invalid(reason) => Step::Done(Err(SnapshotError::Invalid(reason))),
                    Failed::Retry => Step::Next,
                    Failed::GaveUp(label) => Step::Done(Err(SnapshotError::Failed(label))),
                };
            }
        };
        self.metrics
            .response_received(&peer, kind, response.encoded_len());
        let invalid = |core: &mut Self, reason: &'static str, severity: Severity| {
            core.reject(&peer, reason, Some(severity), now);
            Step::Done(Err(SnapshotError::Invalid(reason)))
        };
        if response.id() != id {
            return invalid(self, "id_mismatch", Severity::Major);
        }
        match (response, pending.download.as_mut()) {
            (RpcResponse::Error { code, .. }, download) => {
                let (label, error) = match (code, download) {
                    (RpcErrorCode::Refused, _) => ("refused", SnapshotError::Refused),
                    // The peer sealed a newer snapshot since its header came.
                    (_, Some(_)) => (
                        "snapshot_replaced",
                        SnapshotError::Failed("snapshot_replaced"),
                    ),
                    (_, None) => ("not_found", SnapshotError::NotFound),
                };
                self.metrics.request_failed(kind, label);
                Step::Done(Err(error))
            }
            (RpcResponse::Snapshot { header, body, .. }, None) => {
                Step::Done(self.check_snapshot(peer, pending, &header, &body, now))
            }
            (RpcResponse::SnapshotHeader { header, .. }, None) => {
                let verified = match decode_snapshot_header(&header) {
                    Ok(h) => h,
                    Err(e) => {
                        return invalid(self, e.reason(), crate::lookup::decode_severity(&e));
                    }
                };
                let h = verified.header();
                if h.sender != peer {
                    return invalid(self, "foreign_sender", Severity::Major);
                }
                if h.model != pending.spec.id() {
                    return invalid(self, "model_mismatch", Severity::Major);
                }
                if h.round < pending.oldest_round {
                    self.metrics.request_failed(kind, "stale_snapshot");
                    return Step::Done(Err(SnapshotError::Stale {
                        found: h.round,
                        oldest: pending.oldest_round,
                    }));
                }
                let body_len = h.body_len as usize;
                if body_len == 0 {
                    return Step::Done(self.check_snapshot(peer, pending, &header, &[], now));
                }
                pending.download = Some(Download::new(header, h.body_hash, body_len));
                Step::Next
            }
            (RpcResponse::Chunk { bytes, .. }, Some(d)) => {
                match d.piece(&bytes, self.config.chunk_bytes) {
                    Err(reason) => invalid(self, reason, Severity::Major),
                    Ok(false) => Step::Next,
                    Ok(true) => match pending.download.take() {
                        Some(d) => {
                            let (header, body) = d.into_parts();
                            Step::Done(self.check_snapshot(peer, pending, &header, &body, now))
                        }
                        None => Step::Done(Err(SnapshotError::Failed("no_download"))),
                    },
                }
            }
            _ => invalid(self, "unexpected_response", Severity::Major),
        }
    }

    /// A whole snapshot, header and body: verified against the model and the peer asked.
    fn check_snapshot(
        &mut self,
        peer: PeerId,
        pending: &SnapshotFetch,
        header: &[u8],
        body: &[u8],
        now: Instant,
    ) -> Result<Box<OutcomePacket>, SnapshotError> {
        let kind = RpcKind::Snapshot;
        let snapshot =
            OutcomePacket::decode_snapshot(header, body, &pending.spec).map_err(|e| {
                self.reject(
                    &peer,
                    e.reason(),
                    Some(crate::lookup::decode_severity(&e)),
                    now,
                );
                SnapshotError::Invalid(e.reason())
            })?;
        let h = snapshot.header.header();
        if h.sender != peer {
            // Someone else's snapshot, validly signed: not this peer's model.
            self.reject(&peer, "foreign_sender", Some(Severity::Major), now);
            return Err(SnapshotError::Invalid("foreign_sender"));
        }
        if h.round < pending.oldest_round {
            self.metrics.request_failed(kind, "stale_snapshot");
            return Err(SnapshotError::Stale {
                found: h.round,
                oldest: pending.oldest_round,
            });
        }
        Ok(Box::new(snapshot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CoreConfig;
    use crate::keys::NetworkId;
    use kindred_proto::{
        DType, DenseValues, Embedding, HeaderFields, LayerPayload, LayerSpec, PacketBody, seal,
        seal_snapshot,
    };
    use libp2p::identity::{Keypair, ed25519};

    fn spec() -> Arc<ModelSpec> {
        Arc::new(
            ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])
                .unwrap_or_else(|e| panic!("{e}")),
        )
    }

    fn body() -> PacketBody {
        PacketBody {
            layers: vec![LayerPayload::Dense(DenseValues::F32(vec![0.5; 4]))],
        }
    }

    fn fields(round: u64) -> HeaderFields {
        HeaderFields {
            round,
            unix_ms: 0,
            samples: 0,
            loss: 0.0,
            embedding: Embedding::default(),
        }
    }

    struct Peer {
        key: ed25519::Keypair,
        id: PeerId,
    }

    fn peer(seed: u8) -> Peer {
        let key = ed25519::Keypair::from(
            ed25519::SecretKey::try_from_bytes([seed; 32]).unwrap_or_else(|e| panic!("{e}")),
        );
        let id = Keypair::from(key.clone()).public().to_peer_id();
        Peer { key, id }
    }

    /// Start a fetch from `from`, answer it with `answer(request id)`, return the result.
    fn fetch(
        core: &mut RoutingCore,
        from: PeerId,
        oldest: u64,
        answer: impl FnOnce(RequestId) -> Result<RpcResponse, RequestFailure>,
    ) -> Result<Box<OutcomePacket>, SnapshotError> {
        let now = Instant::now();
        let fetch = core.fetch_snapshot(from, spec(), oldest, now);
        let id = match core.poll_output() {
            Some(Output::SendRequest {
                peer,
                request: RpcRequest::GetSnapshot { id },
            }) if peer == from => id,
            other => panic!("expected a snapshot request, got {other:?}"),
        };
        core.handle_response(from, id, answer(id), now);
        loop {
            match core.poll_output() {
                Some(Output::SnapshotFetched { fetch: f, result }) if f == fetch => return result,
                Some(_) => {}
                None => panic!("the fetch did not finish"),
            }
        }
    }

    fn answer(key: &ed25519::Keypair, round: u64) -> impl FnOnce(RequestId) -> RpcResult + use<> {
        let sealed =
            seal_snapshot(key, &spec(), fields(round), &body()).unwrap_or_else(|e| panic!("{e}"));
        move |id| {
            Ok(RpcResponse::Snapshot {
                id,
                header: sealed.header_bytes,
                body: sealed.body_bytes,
            })
        }
    }

    type RpcResult = Result<RpcResponse, RequestFailure>;
    type Answer = Box<dyn FnOnce(RequestId) -> RpcResult>;

    #[test]
    fn a_peers_own_recent_snapshot_is_accepted() {
        let (me, a) = (peer(1), peer(2));
        let mut core = RoutingCore::new(me.id, CoreConfig::new(NetworkId::from_name("t")));
        let got = fetch(&mut core, a.id, 5, answer(&a.key, 6)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.header.header().sender, a.id);
        assert_eq!(got.body, body());
        assert_eq!(core.metrics().snapshot.responses_received.messages, 1);
        assert_eq!(core.metrics().snapshot.requests_sent.messages, 1);
    }

    #[test]
    fn invalid_answers_fail_the_fetch_and_penalise_the_peer() {
        let (me, a, b) = (peer(1), peer(2), peer(3));
        let core = || RoutingCore::new(me.id, CoreConfig::new(NetworkId::from_name("t")));
        let sealed =
            seal_snapshot(&a.key, &spec(), fields(6), &body()).unwrap_or_else(|e| panic!("{e}"));
        let packet = seal(&a.key, &spec(), fields(6), &body()).unwrap_or_else(|e| panic!("{e}"));
        let mut tampered = sealed.body_bytes.clone();
        if let Some(last) = tampered.last_mut() {
            *last ^= 1;
        }
        let snapshot = |header: &[u8], body: &[u8], echo: u64| {
            let (header, body) = (header.to_vec(), body.to_vec());
            move |id: RequestId| -> RpcResult {
                Ok(RpcResponse::Snapshot {
                    id: RequestId(id.0 + echo),
                    header,
                    body,
                })
            }
        };
        let cases: Vec<(Answer, &str)> = vec![
            // Another node's snapshot, validly signed.
            (Box::new(answer(&b.key, 6)), "foreign_sender"),
            // A packet (an update) passed off as a snapshot.
            (
                Box::new(snapshot(&packet.header_bytes, &packet.body_bytes, 0)),
                "bad_signature",
            ),
            // The right header with a body it does not commit to.
            (
                Box::new(snapshot(&sealed.header_bytes, &tampered, 0)),
                "body_hash_mismatch",
            ),
            // An answer to another request.
            (
                Box::new(snapshot(&sealed.header_bytes, &sealed.body_bytes, 1)),
                "id_mismatch",
            ),
            // A body where a snapshot was asked for.
            (
                Box::new(|id| {
                    Ok(RpcResponse::Body {
                        id,
                        body: Vec::new(),
                    })
                }),
                "unexpected_response",
            ),
        ];
        for (answer, reason) in cases {
            let mut core = core();
            let r = fetch(&mut core, a.id, 0, answer);
            assert_eq!(r.err(), Some(SnapshotError::Invalid(reason)));
            assert_eq!(core.metrics().rejects.get(reason), Some(&1), "{reason}");
        }
        // Repeated offences get the peer banned, and a fetch from it is then refused unasked.
        let mut core = core();
        let now = Instant::now();
        for _ in 0..20 {
            if core.is_banned(&a.id, now) {
                break;
            }
            let _ = fetch(&mut core, a.id, 0, answer(&b.key, 6));
        }
        assert!(core.is_banned(&a.id, now));
        let fetch = core.fetch_snapshot(a.id, spec(), 0, now);
        assert!(matches!(
            core.poll_output(),
            Some(Output::SnapshotFetched { fetch: f, result: Err(SnapshotError::Refused) }) if f == fetch
        ));
    }

    #[test]
    fn a_snapshot_is_served_once_per_body_served_within_the_grant() {
        use crate::store::MemoryStore;
        let (me, a) = (peer(1), peer(2));
        let cfg = CoreConfig::new(NetworkId::from_name("t"));
        let ttl = cfg.snapshot_grant.unwrap_or_default();
        let mut core = RoutingCore::new(me.id, cfg);
        let store = MemoryStore::default();
        let packet = seal(&me.key, &spec(), fields(4), &body()).unwrap_or_else(|e| panic!("{e}"));
        store.insert(&packet);
        store.set_snapshot(
            &seal_snapshot(&me.key, &spec(), fields(4), &body()).unwrap_or_else(|e| panic!("{e}")),
        );
        let t0 = Instant::now();
        let ask = |core: &mut RoutingCore, at: Instant| {
            core.handle_request(
                a.id,
                &RpcRequest::GetSnapshot { id: RequestId(1) },
                &store,
                at,
            )
        };
        let get_body = |core: &mut RoutingCore, at: Instant| {
            let r = core.handle_request(
                a.id,
                &RpcRequest::GetBody {
                    id: RequestId(2),
                    packet: packet.id(),
                },
                &store,
                at,
            );
            assert!(matches!(r, RpcResponse::Body { .. }));
        };
        let refused = |r: RpcResponse| {
            matches!(
                r,
                RpcResponse::Error {
                    code: RpcErrorCode::Refused,
                    ..
                }
            )
        };
        // Nobody asks for a snapshot unprompted.
        assert!(refused(ask(&mut core, t0)));
        // One body served, one snapshot; the second is refused.
        get_body(&mut core, t0);
        assert!(matches!(ask(&mut core, t0), RpcResponse::Snapshot { .. }));
        assert!(refused(ask(&mut core, t0)));
        // A grant expires.
        get_body(&mut core, t0);
        assert!(refused(ask(&mut core, t0 + ttl)));
        // Without the policy, anyone may ask.
        let mut open = CoreConfig::new(NetworkId::from_name("t"));
        open.snapshot_grant = None;
        let mut core = RoutingCore::new(me.id, open);
        assert!(matches!(ask(&mut core, t0), RpcResponse::Snapshot { .. }));
        assert!(matches!(ask(&mut core, t0), RpcResponse::Snapshot { .. }));
    }

    #[test]
    fn stale_missing_and_failed_answers_are_not_the_peers_fault() {
        let (me, a) = (peer(1), peer(2));
        let mut core = RoutingCore::new(me.id, CoreConfig::new(NetworkId::from_name("t")));
        let r = fetch(&mut core, a.id, 7, answer(&a.key, 6));
        assert_eq!(
            r.err(),
            Some(SnapshotError::Stale {
                found: 6,
                oldest: 7
            })
        );
        let r = fetch(&mut core, a.id, 0, |id| {
            Ok(RpcResponse::Error {
                id,
                code: RpcErrorCode::NotFound,
            })
        });
        assert_eq!(r.err(), Some(SnapshotError::NotFound));
        let r = fetch(&mut core, a.id, 0, |_| Err(RequestFailure::Timeout));
        assert_eq!(r.err(), Some(SnapshotError::Failed("timeout")));
        assert!(core.metrics().rejects.is_empty());
        assert!(!core.is_banned(&a.id, Instant::now()));
        assert_eq!(core.metrics().snapshot.failures, 3);
    }

    /// A server holding `a`'s snapshot of a 256-value layer (about 1 KB of body), answering
    /// headers alone past 64 bytes; a client asking for 100-byte pieces.
    struct Pieces {
        server: RoutingCore,
        client: RoutingCore,
        store: crate::store::MemoryStore,
        sealed: kindred_proto::SealedPacket,
        body: PacketBody,
        big: Arc<ModelSpec>,
        me: PeerId,
        a: PeerId,
    }

    impl Pieces {
        /// `granted`: the server serves its snapshot only to peers it served a body.
        fn new(granted: bool) -> Self {
            let (me, a) = (peer(1), peer(2));
            let big = Arc::new(
                ModelSpec::new(vec![LayerSpec::new("w", [256], DType::F32)])
                    .unwrap_or_else(|e| panic!("{e}")),
            );
            let values = (0..256).map(|i| i as f32 / 7.0).collect();
            let body = PacketBody {
                layers: vec![LayerPayload::Dense(DenseValues::F32(values))],
            };
            let sealed =
                seal_snapshot(&a.key, &big, fields(6), &body).unwrap_or_else(|e| panic!("{e}"));
            let store = crate::store::MemoryStore::default();
            store.set_snapshot(&sealed);
            let mut cfg = CoreConfig::new(NetworkId::from_name("t"));
            cfg.inline_body_bytes = 64;
            cfg.chunk_bytes = 100;
            let mut served = cfg.clone();
            if !granted {
                served.snapshot_grant = None;
            }
            Self {
                server: RoutingCore::new(a.id, served),
                client: RoutingCore::new(me.id, cfg),
                store,
                sealed,
                body,
                big,
                me: me.id,
                a: a.id,
            }
        }

        /// Run one fetch to its end; `meddle(n, response)` sees the answer to the client's
        /// `n`th request (0: the header's) and may change or drop it. Returns the result and
        /// the offsets asked for.
        fn fetch(
            &mut self,
            mut meddle: impl FnMut(usize, RpcResponse) -> RpcResult,
        ) -> (Result<Box<OutcomePacket>, SnapshotError>, Vec<u64>) {
            let now = Instant::now();
            let fetch = self.client.fetch_snapshot(self.a, self.big.clone(), 0, now);
            let (mut n, mut offsets) = (0, Vec::new());
            loop {
                match self.client.poll_output() {
                    Some(Output::SendRequest { peer, request }) => {
                        assert_eq!(peer, self.a);
                        if let RpcRequest::GetChunk { offset, .. } = &request {
                            offsets.push(*offset);
                        }
                        let response =
                            self.server
                                .handle_request(self.me, &request, &self.store, now);
                        let result = meddle(n, response);
                        n += 1;
                        self.client
                            .handle_response(self.a, request.id(), result, now);
                    }
                    Some(Output::SnapshotFetched { fetch: f, result }) if f == fetch => {
                        return (result, offsets);
                    }
                    Some(_) => {}
                    None => panic!("the fetch did not finish"),
                }
            }
        }
    }

    #[test]
    fn a_large_snapshot_comes_in_pieces_and_resumes_after_a_dropped_connection() {
        let mut t = Pieces::new(false);
        let len = t.sealed.body_bytes.len() as u64;
        assert!(len > 1000, "{len}");
        // The connection drops under the third piece, twice: asked for again from where the
        // body stopped, and the fetch completes.
        let (got, offsets) = t.fetch(|n, r| match n {
            3 | 4 => Err(RequestFailure::ConnectionClosed),
            _ => Ok(r),
        });
        let got = got.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.header.header().sender, t.a);
        assert_eq!(got.body, t.body);
        let mut expected: Vec<u64> = (0..len.div_ceil(100)).map(|i| i * 100).collect();
        expected.splice(2..2, [200, 200]);
        assert_eq!(offsets, expected);
        assert!(t.client.metrics().rejects.is_empty());
        // The header as snapshot traffic, the pieces as chunks (each one asked for counted).
        let m = t.client.metrics();
        assert_eq!(m.snapshot.requests_sent.messages, 1);
        assert_eq!(m.chunk.requests_sent.messages, offsets.len() as u64);
        assert_eq!(m.chunk.failures, 2);
    }

    #[test]
    fn a_fetch_gives_up_after_its_retries_in_a_row() {
        let mut t = Pieces::new(false);
        let (got, offsets) = t.fetch(|n, r| {
            if n >= 2 {
                Err(RequestFailure::Timeout)
            } else {
                Ok(r)
            }
        });
        assert_eq!(got.err(), Some(SnapshotError::Failed("timeout")));
        assert_eq!(offsets, [0, 100, 100, 100, 100]);
        assert!(t.client.metrics().rejects.is_empty());
    }

    #[test]
    fn a_tampered_or_short_piece_fails_the_fetch_and_penalises_the_peer() {
        let mut t = Pieces::new(false);
        let (got, _) = t.fetch(|n, r| match r {
            RpcResponse::Chunk { id, mut bytes } if n == 5 => {
                bytes[10] ^= 1;
                Ok(RpcResponse::Chunk { id, bytes })
            }
            r => Ok(r),
        });
        assert_eq!(
            got.err(),
            Some(SnapshotError::Invalid("body_hash_mismatch"))
        );
        assert_eq!(
            t.client.metrics().rejects.get("body_hash_mismatch"),
            Some(&1)
        );

        let (got, offsets) = t.fetch(|n, r| match r {
            RpcResponse::Chunk { id, mut bytes } if n == 2 => {
                bytes.pop();
                Ok(RpcResponse::Chunk { id, bytes })
            }
            r => Ok(r),
        });
        assert_eq!(got.err(), Some(SnapshotError::Invalid("chunk_length")));
        assert_eq!(offsets, [0, 100]);

        // A header for another model is refused before a piece is asked for.
        let (got, offsets) = t.fetch(|_, r| match r {
            RpcResponse::SnapshotHeader { id, .. } => {
                let other = seal_snapshot(&peer(2).key, &spec(), fields(6), &body())
                    .unwrap_or_else(|e| panic!("{e}"));
                Ok(RpcResponse::SnapshotHeader {
                    id,
                    header: other.header_bytes,
                })
            }
            r => Ok(r),
        });
        assert_eq!(got.err(), Some(SnapshotError::Invalid("model_mismatch")));
        assert!(offsets.is_empty());
    }

    #[test]
    fn pieces_are_served_only_after_the_header_and_only_of_the_snapshot_served() {
        let mut t = Pieces::new(true);
        let t0 = Instant::now();
        let hash = t.sealed.header.header().body_hash;
        let piece = |t: &mut Pieces, body_hash: [u8; 32], offset: u64, at: Instant| {
            t.server.handle_request(
                t.me,
                &RpcRequest::GetChunk {
                    id: RequestId(9),
                    body_hash,
                    offset,
                    len: 100,
                },
                &t.store,
                at,
            )
        };
        let code = |r: RpcResponse| match r {
            RpcResponse::Error { code, .. } => Some(code),
            _ => None,
        };
        // Nobody fetches pieces unprompted while snapshots are granted per body.
        assert_eq!(
            code(piece(&mut t, hash, 0, t0)),
            Some(RpcErrorCode::Refused)
        );
        // A body served grants the snapshot: its header alone, then its pieces.
        let packet =
            seal(&peer(2).key, &spec(), fields(6), &body()).unwrap_or_else(|e| panic!("{e}"));
        t.store.insert(&packet);
        let get_body = RpcRequest::GetBody {
            id: RequestId(1),
            packet: packet.id(),
        };
        let _ = t.server.handle_request(t.me, &get_body, &t.store, t0);
        let header = t.server.handle_request(
            t.me,
            &RpcRequest::GetSnapshot { id: RequestId(2) },
            &t.store,
            t0,
        );
        assert!(matches!(header, RpcResponse::SnapshotHeader { .. }));
        let Some(last) = t.sealed.body_bytes.len().checked_sub(5) else {
            panic!("short body");
        };
        match piece(&mut t, hash, last as u64, t0) {
            RpcResponse::Chunk { bytes, .. } => assert_eq!(bytes, t.sealed.body_bytes[last..]),
            other => panic!("{other:?}"),
        }
        // Another body's pieces were not granted; past the end there is nothing.
        assert_eq!(
            code(piece(&mut t, [7; 32], 0, t0)),
            Some(RpcErrorCode::Refused)
        );
        let end = t.sealed.body_bytes.len() as u64;
        assert_eq!(
            code(piece(&mut t, hash, end, t0)),
            Some(RpcErrorCode::NotFound)
        );
        // A snapshot replaced since its header went out: its pieces are gone.
        t.store.set_snapshot(
            &seal_snapshot(&peer(2).key, &spec(), fields(7), &body())
                .unwrap_or_else(|e| panic!("{e}")),
        );
        assert_eq!(
            code(piece(&mut t, hash, 0, t0)),
            Some(RpcErrorCode::NotFound)
        );
        let ttl = CoreConfig::new(NetworkId::from_name("t"))
            .snapshot_grant
            .unwrap_or_default();
        assert_eq!(
            code(piece(&mut t, hash, 0, t0 + ttl)),
            Some(RpcErrorCode::Refused)
        );
    }
}
