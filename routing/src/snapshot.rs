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
//! Serving is narrow too. A snapshot answer is the whole model (up to 64 MiB) for a 9-byte
//! request, so a node serves it only to a peer it just served a packet body to: each body served
//! grants that peer one snapshot fetch, for [`crate::CoreConfig::snapshot_grant`]. That is
//! exactly the honest flow (a node fetches the snapshot of a partner whose update it merged),
//! and it bounds what a peer can pull out of a node to one snapshot per body it fetched.
//!
//! Sans-IO like the rest of the core: [`RoutingCore::fetch_snapshot`] emits an
//! [`Output::SendRequest`], and the response reported through
//! [`RoutingCore::handle_response`] ends in one [`Output::SnapshotFetched`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kindred_proto::rpc::{RequestId, RpcErrorCode, RpcKind, RpcRequest, RpcResponse};
use kindred_proto::{ModelSpec, OutcomePacket};
use libp2p::PeerId;

use crate::core::{Output, RequestFailure, RoutingCore};
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

/// A snapshot fetch waiting for its response.
#[derive(Debug, Clone)]
pub(crate) struct SnapshotFetch {
    pub(crate) fetch: SnapshotFetchId,
    pub(crate) peer: PeerId,
    pub(crate) spec: Arc<ModelSpec>,
    pub(crate) oldest_round: u64,
}

/// Peers allowed one snapshot fetch each, since when: granted by serving them a body.
#[derive(Debug, Default)]
pub(crate) struct SnapshotGrants {
    granted: HashMap<PeerId, Instant>,
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
}

impl RoutingCore {
    /// Whether `peer` may fetch this node's snapshot now (using up its grant if so).
    pub(crate) fn may_fetch_snapshot(&mut self, peer: &PeerId, now: Instant) -> bool {
        match self.config.snapshot_grant {
            None => true,
            Some(ttl) => self.snapshot_grants.take(peer, now, ttl),
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
            },
        );
        self.outputs
            .push_back(Output::SendRequest { peer, request });
        fetch
    }

    /// The response to a [`RoutingCore::fetch_snapshot`] request (called from
    /// `handle_response`, which has checked that `peer` is the one asked).
    pub(crate) fn on_snapshot_response(
        &mut self,
        peer: PeerId,
        id: RequestId,
        pending: SnapshotFetch,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) {
        let result = self.check_snapshot(peer, id, &pending, result, now);
        if result.is_ok() {
            self.scores.reward(&peer, now);
        }
        self.outputs.push_back(Output::SnapshotFetched {
            fetch: pending.fetch,
            result: result.map(Box::new),
        });
    }

    fn check_snapshot(
        &mut self,
        peer: PeerId,
        id: RequestId,
        pending: &SnapshotFetch,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) -> Result<OutcomePacket, SnapshotError> {
        let kind = RpcKind::Snapshot;
        let response = match result {
            Ok(response) => response,
            Err(RequestFailure::Protocol(reason)) => {
                self.metrics.request_failed(kind, reason);
                self.reject(&peer, reason, Some(Severity::Major), now);
                return Err(SnapshotError::Invalid(reason));
            }
            Err(failure) => {
                self.count_failure(kind, &failure);
                return Err(SnapshotError::Failed(failure.label()));
            }
        };
        self.metrics
            .response_received(&peer, kind, response.encoded_len());
        let invalid = |core: &mut Self, reason: &'static str, severity: Severity| {
            core.reject(&peer, reason, Some(severity), now);
            SnapshotError::Invalid(reason)
        };
        let (header, body) = match response {
            RpcResponse::Snapshot { id: echoed, .. } if echoed != id => {
                return Err(invalid(self, "id_mismatch", Severity::Major));
            }
            RpcResponse::Snapshot { header, body, .. } => (header, body),
            RpcResponse::Error { code, .. } => {
                let (label, error) = match code {
                    RpcErrorCode::Refused => ("refused", SnapshotError::Refused),
                    _ => ("not_found", SnapshotError::NotFound),
                };
                self.metrics.request_failed(kind, label);
                return Err(error);
            }
            RpcResponse::Headers { .. }
            | RpcResponse::Body { .. }
            | RpcResponse::PushAnswer { .. }
            | RpcResponse::Merge { .. } => {
                return Err(invalid(self, "unexpected_response", Severity::Major));
            }
        };
        let snapshot = OutcomePacket::decode_snapshot(&header, &body, &pending.spec)
            .map_err(|e| invalid(self, e.reason(), crate::lookup::decode_severity(&e)))?;
        let h = snapshot.header.header();
        if h.sender != peer {
            // Someone else's snapshot, validly signed: not this peer's model.
            return Err(invalid(self, "foreign_sender", Severity::Major));
        }
        if h.round < pending.oldest_round {
            self.metrics.request_failed(kind, "stale_snapshot");
            return Err(SnapshotError::Stale {
                found: h.round,
                oldest: pending.oldest_round,
            });
        }
        Ok(snapshot)
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
}
