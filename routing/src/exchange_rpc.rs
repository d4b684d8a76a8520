//! The hub exchange on the wire: a member's push and merge fetch, and a hub's answers.
//!
//! The exchange's rules live in [`crate::exchange`]; this module only moves its messages
//! between nodes over the `/kindred/rpc` protocol and checks what it can without the node's
//! model:
//! - **Outbound** ([`RoutingCore::exchange_call`]): a push ([`ExchangeCall::Push`]) is answered
//!   at once ([`ExchangeReply::Answer`]); a merge fetch ([`ExchangeCall::GetMerge`]) by the
//!   hub's merge, verified here like a snapshot (signed under the merge domain by the hub
//!   asked, of the local model, of the round asked: [`kindred_proto::seal_merge`]), by
//!   [`ExchangeReply::NotReady`], or by the hub's later answer to the push
//!   ([`ExchangeReply::Answer`]: a push is answered at once, accepted or not, but a hub may
//!   still refuse the pusher when it closes its admission, and says so here). A reply that
//!   breaks the protocol (another kind, a forged or foreign merge, a peer list that does not
//!   parse) costs the peer score like a bad packet. A merge over one response's limit comes as
//!   its header, then its body in pieces ([`crate::pieces`]), verified whole.
//! - **Inbound** ([`RoutingCore::exchange_request`]): a push or a merge fetch from a peer that
//!   is not banned goes to the node ([`InboundExchange`], through
//!   [`crate::RoutingHandle::serve_exchange`]), which answers through its
//!   [`ExchangeResponder`] when its exchange core decides: a push at once, a merge fetch when
//!   the merge is ready or the node gives up. The node verifies a pushed packet against its
//!   model and reports one that fails ([`crate::RoutingHandle::report_invalid`]). A node that
//!   does not serve the exchange refuses both. A merge the node serves over one response's
//!   limit leaves as its header ([`RoutingCore::offer_large_merge`]), its body served in pieces
//!   to the member it answered.
//!
//! Sans-IO like the rest of the core: an outbound call is an [`Output::SendRequest`] and ends
//! in one [`Output::ExchangeDone`].

use std::sync::Arc;
use std::time::Instant;

use kindred_proto::rpc::{
    PushAnswer, RequestId, RpcErrorCode, RpcKind, RpcRequest, RpcResponse, SketchCosine,
};
use kindred_proto::{ModelSpec, OutcomePacket};
use libp2p::PeerId;
use tokio::sync::oneshot;

use crate::core::{Output, RequestFailure, RoutingCore};
use crate::pieces::{Download, Failed, Step};
use crate::scoring::Severity;
use crate::serve::BAD_REQUEST;

/// Identifies one outbound exchange call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExchangeCallId(pub u64);

/// Bytes of pushed bodies a node pulls at once, at most (their announced lengths summed): 4 GiB,
/// two pushes of a 10^9-parameter model's update dense in f16. A push past it is answered busy.
pub const MAX_PULL_BYTES: u64 = 4 << 30;

/// Identifies one inbound push whose body this node pulls in pieces ([`Inbound::Pull`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PullId(pub u64);

/// What a node asks of a peer in the hub exchange.
#[derive(Debug, Clone)]
pub enum ExchangeCall {
    /// Push the node's packet to its hub, with the peers of its view.
    Push(PushedPacket),
    /// Ask the hub for its merge of `round`, to be verified against `spec`.
    GetMerge {
        /// The round.
        round: u64,
        /// The local model.
        spec: Arc<ModelSpec>,
    },
}

/// A member's packet pushed to its hub, as sent and as received (a received one is not yet
/// verified: the node checks it against its model).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushedPacket {
    /// The round it pushes for.
    pub round: u64,
    /// The sealed packet header.
    pub header: Vec<u8>,
    /// The packet body.
    pub body: Vec<u8>,
    /// The peers of the member's view (at most [`kindred_proto::rpc::MAX_KNOWN_PEERS`]).
    pub known: Vec<PeerId>,
}

/// A hub's answer to a push, peers parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HubAnswer {
    /// Queued for the round's admission.
    Accepted,
    /// Not the hub: `0` is the one it names.
    NotHub(PeerId),
    /// Full, or not taking part this round.
    Busy,
    /// After the hub closed its admission.
    Late,
    /// Not admitted; with `foreign`, the hub's data refused the merge.
    Refused {
        /// The hub's data refused its merge.
        foreign: bool,
    },
}

/// What an exchange call brought back.
#[derive(Debug, Clone)]
pub enum ExchangeReply {
    /// The answer to a push.
    Answer(HubAnswer),
    /// The merge asked for, verified, and the hub's view as listed with it.
    Merge {
        /// The merge (header signed by the hub under the merge domain, body decoded).
        merge: Box<OutcomePacket>,
        /// Its encoded size (header and body), for the node's byte counts.
        bytes: usize,
        /// The hub's sketch cosine with the node's push, in [−1, 1] (its anchor:
        /// [`crate::Cohort::merged`]).
        cosine: f32,
        /// The lineage of the hub's model ([`crate::exchange::Exchange::lineage`]).
        lineage: u64,
        /// The peers the hub listed.
        listed: Vec<PeerId>,
    },
    /// The hub has no merge of that round for this node (not yet, or none).
    NotReady,
}

/// Why an exchange call brought nothing back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// The peer refused (it bans this node, or does not serve the exchange), or this node
    /// bans the peer.
    #[error("the request was refused")]
    Refused,
    /// No usable answer, for a reason that is not the peer's fault as far as this node can
    /// tell (timeout, closed connection...).
    #[error("the request failed: {0}")]
    Failed(&'static str),
    /// The peer answered against the protocol: the label names why, and the peer was
    /// penalised.
    #[error("the peer answered invalidly: {0}")]
    Invalid(&'static str),
    /// The routing driver has stopped.
    #[error("the routing driver has stopped")]
    Stopped,
}

/// A peer's exchange request, for the node to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InboundCall {
    /// A member's push: its packet (not yet verified: the node checks it against its model)
    /// and the peers of its view.
    Push(PushedPacket),
    /// A member asks for the merge of `round`.
    GetMerge {
        /// The round.
        round: u64,
    },
}

/// An exchange request from `peer` and the way to answer it.
#[derive(Debug)]
pub struct InboundExchange {
    /// The requesting peer.
    pub peer: PeerId,
    /// What it asks.
    pub call: InboundCall,
    /// Answers it (dropped unanswered: the peer's request fails).
    pub reply: ExchangeResponder,
}

/// What a hub serves with a merge besides the merge and its view.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServedWith {
    /// The hub's sketch cosine with the member's push.
    pub cosine: f32,
    /// The lineage of the hub's model ([`crate::exchange::Exchange::lineage`]).
    pub lineage: u64,
}

/// Answers one inbound exchange request; each answer consumes it.
#[derive(Debug)]
pub struct ExchangeResponder {
    id: RequestId,
    tx: oneshot::Sender<RpcResponse>,
}

impl ExchangeResponder {
    pub(crate) fn new(id: RequestId, tx: oneshot::Sender<RpcResponse>) -> Self {
        Self { id, tx }
    }

    /// Answer a push.
    pub fn answer(self, answer: &HubAnswer) {
        let answer = match answer {
            HubAnswer::Accepted => PushAnswer::Accepted,
            HubAnswer::NotHub(hub) => PushAnswer::NotHub {
                hub: hub.to_bytes(),
            },
            HubAnswer::Busy => PushAnswer::Busy,
            HubAnswer::Late => PushAnswer::Late,
            HubAnswer::Refused { foreign } => PushAnswer::Refused { foreign: *foreign },
        };
        let id = self.id;
        self.send(RpcResponse::PushAnswer { id, answer });
    }

    /// Serve a merge (sealed with [`kindred_proto::seal_merge`]), the hub's sketch cosine with
    /// the member's push, the lineage of the hub's model, and the listed peers.
    pub fn merge(self, header: Vec<u8>, body: Vec<u8>, served: ServedWith, listed: &[PeerId]) {
        let id = self.id;
        let listed = listed.iter().map(|p| p.to_bytes()).collect();
        self.send(RpcResponse::Merge {
            id,
            header,
            body,
            cosine: SketchCosine::from_f32(served.cosine),
            lineage: served.lineage,
            listed,
        });
    }

    /// No merge of that round for this peer (not yet, or none).
    pub fn not_ready(self) {
        let id = self.id;
        self.send(RpcResponse::Error {
            id,
            code: RpcErrorCode::NotFound,
        });
    }

    /// Refuse the request.
    pub fn refuse(self) {
        let id = self.id;
        self.send(RpcResponse::Error {
            id,
            code: RpcErrorCode::Refused,
        });
    }

    fn send(self, response: RpcResponse) {
        // The driver went away (shutting down): nobody to answer.
        let _ = self.tx.send(response);
    }
}

/// An outbound exchange call waiting for its response.
#[derive(Debug)]
pub(crate) struct PendingCall {
    pub(crate) call: ExchangeCallId,
    pub(crate) peer: PeerId,
    /// For a merge fetch: the round and the spec to verify against.
    pub(crate) merge: Option<(u64, Arc<ModelSpec>)>,
    /// A large merge's body as it arrives ([`crate::pieces`]), with what came with its header.
    pub(crate) pieces: Option<MergePieces>,
}

/// A large merge being fetched in pieces: the download and what its header's answer said.
#[derive(Debug)]
pub(crate) struct MergePieces {
    download: Download,
    cosine: SketchCosine,
    lineage: u64,
    listed: Vec<PeerId>,
}

/// What [`RoutingCore::exchange_request`] made of an inbound request.
#[derive(Debug)]
pub enum Inbound {
    /// For the node to answer.
    Call(InboundCall),
    /// Answer at once with this (a banned peer, a node that does not serve the exchange).
    Respond(RpcResponse),
    /// Answer nothing: the request broke the protocol and the peer was penalised.
    Drop,
    /// A push whose body is too large for one request: this node pulls it from the pusher in
    /// pieces ([`crate::pieces`]). Hold the request until [`Output::PushPulled`] names this
    /// pull, then hand its call to the node (or, if the pull failed, answer busy).
    Pull(PullId),
}

/// An inbound push whose body is being pulled from its pusher.
#[derive(Debug)]
pub(crate) struct PendingPull {
    pub(crate) pull: PullId,
    pub(crate) peer: PeerId,
    round: u64,
    known: Vec<PeerId>,
    download: Download,
}

fn parse_peers(list: &[Vec<u8>]) -> Option<Vec<PeerId>> {
    list.iter().map(|b| PeerId::from_bytes(b).ok()).collect()
}

impl RoutingCore {
    /// Send `call` to `peer`. Emits an [`Output::SendRequest`] (or, for a banned peer, at once
    /// an [`Output::ExchangeDone`] with [`ExchangeError::Refused`]); the response goes to
    /// [`RoutingCore::handle_response`] and ends the call with one [`Output::ExchangeDone`].
    pub fn exchange_call(
        &mut self,
        peer: PeerId,
        call: ExchangeCall,
        now: Instant,
    ) -> ExchangeCallId {
        let id = ExchangeCallId(self.next_id());
        if self.scores.is_banned(&peer, now) {
            self.outputs.push_back(Output::ExchangeDone {
                call: id,
                result: Err(ExchangeError::Refused),
            });
            return id;
        }
        let request_id = RequestId(self.next_id());
        let (request, merge) = match call {
            ExchangeCall::Push(PushedPacket {
                round,
                header,
                body,
                known,
            }) => (
                RpcRequest::Push {
                    id: request_id,
                    round,
                    body: self.offer_large_push(peer, &header, body, now),
                    header,
                    known: known.iter().map(|p| p.to_bytes()).collect(),
                },
                None,
            ),
            ExchangeCall::GetMerge { round, spec } => (
                RpcRequest::GetMerge {
                    id: request_id,
                    round,
                },
                Some((round, spec)),
            ),
        };
        self.metrics
            .request_sent(&peer, request.kind(), request.encoded_len());
        self.exchange_calls.insert(
            request_id,
            PendingCall {
                call: id,
                peer,
                merge,
                pieces: None,
            },
        );
        self.outputs
            .push_back(Output::SendRequest { peer, request });
        id
    }

    /// A response to one of an [`RoutingCore::exchange_call`]'s requests (called from
    /// `handle_response`, which has checked that `peer` is the one asked).
    pub(crate) fn on_exchange_response(
        &mut self,
        peer: PeerId,
        id: RequestId,
        mut pending: PendingCall,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) {
        match self.check_exchange(peer, id, &mut pending, result, now) {
            Step::Next => {
                if let Some(p) = &pending.pieces {
                    let id = self.ask_piece(peer, &p.download);
                    self.exchange_calls.insert(id, pending);
                }
            }
            Step::Done(result) => {
                if result.is_ok() {
                    self.scores.reward(&peer, now);
                }
                self.outputs.push_back(Output::ExchangeDone {
                    call: pending.call,
                    result,
                });
            }
        }
    }

    fn check_exchange(
        &mut self,
        peer: PeerId,
        id: RequestId,
        pending: &mut PendingCall,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) -> Step<Result<ExchangeReply, ExchangeError>> {
        let kind = match (&pending.pieces, &pending.merge) {
            (Some(_), _) => RpcKind::Chunk,
            (None, Some(_)) => RpcKind::Merge,
            (None, None) => RpcKind::Push,
        };
        let response = match result {
            Ok(response) => response,
            Err(failure) => {
                let download = pending.pieces.as_mut().map(|p| &mut p.download);
                return match self.transfer_failed(peer, kind, &failure, download, now) {
                    Failed::Invalid(reason) => Step::Done(Err(ExchangeError::Invalid(reason))),
                    Failed::Retry => Step::Next,
                    Failed::GaveUp(label) => Step::Done(Err(ExchangeError::Failed(label))),
                };
            }
        };
        if pending.pieces.is_some() {
            return self.merge_piece(peer, id, pending, response, now);
        }
        match self.exchange_answer(peer, id, pending, response, now) {
            Ok(Some(reply)) => Step::Done(Ok(reply)),
            Ok(None) => Step::Next,
            Err(e) => Step::Done(Err(e)),
        }
    }

    /// A piece of a large merge came (or an answer instead).
    fn merge_piece(
        &mut self,
        peer: PeerId,
        id: RequestId,
        pending: &mut PendingCall,
        response: RpcResponse,
        now: Instant,
    ) -> Step<Result<ExchangeReply, ExchangeError>> {
        self.metrics
            .response_received(&peer, RpcKind::Chunk, response.encoded_len());
        let invalid = |core: &mut Self, reason: &'static str| {
            core.reject(&peer, reason, Some(Severity::Major), now);
            Step::Done(Err(ExchangeError::Invalid(reason)))
        };
        if response.id() != id {
            return invalid(self, "id_mismatch");
        }
        let bytes = match response {
            RpcResponse::Chunk { bytes, .. } => bytes,
            RpcResponse::Error { code, .. } => {
                // Refused, or the merge is no longer served (its time is up).
                let (label, error) = match code {
                    RpcErrorCode::Refused => ("refused", ExchangeError::Refused),
                    _ => ("merge_gone", ExchangeError::Failed("merge_gone")),
                };
                self.metrics.request_failed(RpcKind::Chunk, label);
                return Step::Done(Err(error));
            }
            _ => return invalid(self, "unexpected_response"),
        };
        let Some(p) = pending.pieces.as_mut() else {
            return Step::Done(Err(ExchangeError::Failed("no_download")));
        };
        match p.download.piece(&bytes, self.config.chunk_bytes) {
            Err(reason) => invalid(self, reason),
            Ok(false) => Step::Next,
            Ok(true) => {
                let (Some(p), Some((round, spec))) = (pending.pieces.take(), &pending.merge) else {
                    return Step::Done(Err(ExchangeError::Failed("no_download")));
                };
                let (header, body) = p.download.into_parts();
                Step::Done(self.verified_merge(
                    peer,
                    (*round, spec.clone()),
                    header,
                    body,
                    (p.cosine, p.lineage, p.listed),
                    now,
                ))
            }
        }
    }

    /// The first answer to a push or a merge fetch; `None` when a large merge's pieces follow.
    fn exchange_answer(
        &mut self,
        peer: PeerId,
        id: RequestId,
        pending: &mut PendingCall,
        response: RpcResponse,
        now: Instant,
    ) -> Result<Option<ExchangeReply>, ExchangeError> {
        let kind = if pending.merge.is_some() {
            RpcKind::Merge
        } else {
            RpcKind::Push
        };
        self.metrics
            .response_received(&peer, kind, response.encoded_len());
        let invalid = |core: &mut Self, reason: &'static str, severity: Severity| {
            core.reject(&peer, reason, Some(severity), now);
            ExchangeError::Invalid(reason)
        };
        if response.id() != id {
            return Err(invalid(self, "id_mismatch", Severity::Major));
        }
        match (response, &pending.merge) {
            (RpcResponse::Error { code, .. }, merge) => match code {
                RpcErrorCode::Refused => {
                    self.metrics.request_failed(kind, "refused");
                    Err(ExchangeError::Refused)
                }
                _ if merge.is_some() => Ok(Some(ExchangeReply::NotReady)),
                _ => Err(invalid(self, "unexpected_response", Severity::Major)),
            },
            // A push's answer, or, to a merge fetch, the hub's later answer to the push (it
            // refused the pusher at its admission, or its data refused the merge).
            (RpcResponse::PushAnswer { answer, .. }, _) => {
                Ok(Some(ExchangeReply::Answer(match answer {
                    PushAnswer::Accepted => HubAnswer::Accepted,
                    PushAnswer::NotHub { hub } => match PeerId::from_bytes(&hub) {
                        Ok(hub) => HubAnswer::NotHub(hub),
                        Err(_) => return Err(invalid(self, "bad_peer_id", Severity::Major)),
                    },
                    PushAnswer::Busy => HubAnswer::Busy,
                    PushAnswer::Late => HubAnswer::Late,
                    PushAnswer::Refused { foreign } => HubAnswer::Refused { foreign },
                })))
            }
            (
                RpcResponse::Merge {
                    header,
                    body,
                    cosine,
                    lineage,
                    listed,
                    ..
                },
                Some((round, spec)),
            ) => {
                let listed = self.listed_peers(peer, &listed, now)?;
                let merge = (*round, spec.clone());
                self.verified_merge(peer, merge, header, body, (cosine, lineage, listed), now)
                    .map(Some)
            }
            // A merge too large for one response: its header, then its body in pieces.
            (
                RpcResponse::MergeHeader {
                    header,
                    cosine,
                    lineage,
                    listed,
                    ..
                },
                Some((round, spec)),
            ) => {
                let listed = self.listed_peers(peer, &listed, now)?;
                let verified = kindred_proto::decode_merge_header(&header)
                    .map_err(|e| invalid(self, e.reason(), crate::lookup::decode_severity(&e)))?;
                let h = verified.header();
                self.merge_of(peer, h, *round, now)?;
                if h.model != spec.id() {
                    return Err(invalid(self, "model_mismatch", Severity::Major));
                }
                let (body_hash, body_len) = (h.body_hash, h.body_len as usize);
                if body_len == 0 {
                    let merge = (*round, spec.clone());
                    let answer = (cosine, lineage, listed);
                    return self
                        .verified_merge(peer, merge, header, Vec::new(), answer, now)
                        .map(Some);
                }
                pending.pieces = Some(MergePieces {
                    download: Download::new(header, body_hash, body_len),
                    cosine,
                    lineage,
                    listed,
                });
                Ok(None)
            }
            _ => Err(invalid(self, "unexpected_response", Severity::Major)),
        }
    }

    /// Whether a merge's verified header is `peer`'s own, of `round`: another hub's merge,
    /// validly signed, is not this hub's, and a merge of another round is a replay.
    fn merge_of(
        &mut self,
        peer: PeerId,
        h: &kindred_proto::PacketHeader,
        round: u64,
        now: Instant,
    ) -> Result<(), ExchangeError> {
        let reason = if h.sender != peer {
            "foreign_sender"
        } else if h.round != round {
            "replayed_merge"
        } else {
            return Ok(());
        };
        self.reject(&peer, reason, Some(Severity::Major), now);
        Err(ExchangeError::Invalid(reason))
    }

    /// The peers a merge's answer lists, parsed; a list that does not parse is the peer's fault.
    fn listed_peers(
        &mut self,
        peer: PeerId,
        listed: &[Vec<u8>],
        now: Instant,
    ) -> Result<Vec<PeerId>, ExchangeError> {
        parse_peers(listed).ok_or_else(|| {
            self.reject(&peer, "bad_peer_id", Some(Severity::Major), now);
            ExchangeError::Invalid("bad_peer_id")
        })
    }

    /// A whole merge from `peer`: verified against the round and spec asked for, with what its
    /// answer said (`cosine`, `lineage`, `listed`).
    fn verified_merge(
        &mut self,
        peer: PeerId,
        (round, spec): (u64, Arc<ModelSpec>),
        header: Vec<u8>,
        body: Vec<u8>,
        (cosine, lineage, listed): (SketchCosine, u64, Vec<PeerId>),
        now: Instant,
    ) -> Result<ExchangeReply, ExchangeError> {
        let invalid = |core: &mut Self, reason: &'static str, severity: Severity| {
            core.reject(&peer, reason, Some(severity), now);
            ExchangeError::Invalid(reason)
        };
        let bytes = header.len() + body.len();
        let merge = OutcomePacket::decode_merge(&header, &body, &spec)
            .map_err(|e| invalid(self, e.reason(), crate::lookup::decode_severity(&e)))?;
        self.merge_of(peer, merge.header.header(), round, now)?;
        Ok(ExchangeReply::Merge {
            merge: Box::new(merge),
            bytes,
            cosine: cosine.to_f32(),
            lineage,
            listed,
        })
    }

    /// The body a push to `hub` carries: the packet's, or, over
    /// [`crate::CoreConfig::inline_body_bytes`], nothing (the hub pulls it in pieces, served
    /// to it from now on: [`crate::pieces`]).
    fn offer_large_push(
        &mut self,
        hub: PeerId,
        header: &[u8],
        body: Vec<u8>,
        now: Instant,
    ) -> Vec<u8> {
        if !self.in_pieces(body.len()) {
            return body;
        }
        // The node sealed it: its header names the body's hash.
        match kindred_proto::decode_header(header) {
            Ok(h) => {
                self.served_bodies
                    .offer(hub, h.header().body_hash, body, now);
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(%hub, error = %e, "own packet header does not decode");
                body
            }
        }
    }

    /// An inbound push without a body: if its header (signed by the pusher) announces one, pull
    /// it in pieces and hand the push on when it is whole ([`Inbound::Pull`]); otherwise it is
    /// the node's to judge as it is.
    fn pull_push(
        &mut self,
        peer: PeerId,
        id: RequestId,
        round: u64,
        header: Vec<u8>,
        known: Vec<PeerId>,
    ) -> Inbound {
        let announced = kindred_proto::decode_header(&header)
            .ok()
            .map(|h| (h.header().sender, h.header().body_hash, h.header().body_len))
            .filter(|&(sender, _, len)| sender == peer && len > 0);
        let Some((_, hash, len)) = announced else {
            return Inbound::Call(InboundCall::Push(PushedPacket {
                round,
                header,
                body: Vec::new(),
                known,
            }));
        };
        // One pull per pusher, and at most MAX_PULL_BYTES announced at once: past that the push
        // is answered as a full hub answers, and the pusher's exchange tries again.
        let in_flight: u64 = self
            .pulls
            .values()
            .map(|p| p.download.progress().1 as u64)
            .sum();
        if self.pulls.values().any(|p| p.peer == peer)
            || in_flight.saturating_add(u64::from(len)) > MAX_PULL_BYTES
        {
            let busy = RpcResponse::PushAnswer {
                id,
                answer: PushAnswer::Busy,
            };
            self.metrics
                .response_sent(&peer, RpcKind::Push, busy.encoded_len());
            return Inbound::Respond(busy);
        }
        let pull = PullId(self.next_id());
        tracing::debug!(%peer, round, len, "pulling a pushed body in pieces");
        self.ask_pull_piece(PendingPull {
            pull,
            peer,
            round,
            known,
            download: Download::new(header, hash, len as usize),
        });
        Inbound::Pull(pull)
    }

    fn ask_pull_piece(&mut self, pending: PendingPull) {
        let id = self.ask_piece(pending.peer, &pending.download);
        self.pulls.insert(id, pending);
    }

    /// A response to a pull's piece request (called from `handle_response`, which has
    /// checked that `peer` is the pusher).
    pub(crate) fn on_pull_response(
        &mut self,
        peer: PeerId,
        id: RequestId,
        mut pending: PendingPull,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) {
        let kind = RpcKind::Chunk;
        if let Ok(response) = &result {
            self.metrics
                .response_received(&peer, kind, response.encoded_len());
        }
        let bytes = match result {
            Ok(RpcResponse::Chunk { id: echoed, bytes }) if echoed == id => bytes,
            Ok(RpcResponse::Error { .. }) => {
                // The pusher no longer serves it (restarted, or its time is up).
                self.metrics.request_failed(kind, "push_gone");
                return self.pull_done(pending.pull, None);
            }
            Ok(_) => {
                self.reject(&peer, "unexpected_response", Some(Severity::Major), now);
                return self.pull_done(pending.pull, None);
            }
            Err(failure) => {
                let download = Some(&mut pending.download);
                return match self.transfer_failed(peer, kind, &failure, download, now) {
                    Failed::Retry => self.ask_pull_piece(pending),
                    Failed::Invalid(_) | Failed::GaveUp(_) => self.pull_done(pending.pull, None),
                };
            }
        };
        match pending.download.piece(&bytes, self.config.chunk_bytes) {
            Err(reason) => {
                self.reject(&peer, reason, Some(Severity::Major), now);
                self.pull_done(pending.pull, None);
            }
            Ok(false) => self.ask_pull_piece(pending),
            Ok(true) => {
                let (header, body) = pending.download.into_parts();
                // The node verifies the whole packet (its hash included) as any push.
                let call = InboundCall::Push(PushedPacket {
                    round: pending.round,
                    header,
                    body,
                    known: pending.known,
                });
                self.pull_done(pending.pull, Some(call));
            }
        }
    }

    fn pull_done(&mut self, pull: PullId, call: Option<InboundCall>) {
        self.outputs.push_back(Output::PushPulled { pull, call });
    }

    /// A response about to go to `peer`: a merge whose body is over
    /// [`crate::CoreConfig::inline_body_bytes`] leaves as its header
    /// ([`RpcResponse::MergeHeader`]), its body served to `peer` in pieces from now on
    /// ([`crate::pieces`]); any other response goes as it is.
    pub fn offer_large_merge(
        &mut self,
        peer: PeerId,
        response: RpcResponse,
        now: Instant,
    ) -> RpcResponse {
        match response {
            RpcResponse::Merge {
                id,
                header,
                body,
                cosine,
                lineage,
                listed,
            } if self.in_pieces(body.len()) => {
                // The node sealed it: its header names the body's hash.
                match kindred_proto::decode_merge_header(&header) {
                    Ok(h) => {
                        let hash = h.header().body_hash;
                        self.served_bodies.offer(peer, hash, body, now);
                        RpcResponse::MergeHeader {
                            id,
                            header,
                            cosine,
                            lineage,
                            listed,
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, "own merge header does not decode");
                        RpcResponse::Error {
                            id,
                            code: RpcErrorCode::NotFound,
                        }
                    }
                }
            }
            other => other,
        }
    }

    /// Take an inbound `Push` or `GetMerge` from `peer`: for the node to answer when it serves
    /// the exchange (`serving`), refused otherwise or when the peer is banned; a push whose
    /// peer list does not parse is a bad request (penalised, answered with nothing).
    pub fn exchange_request(
        &mut self,
        peer: PeerId,
        request: RpcRequest,
        serving: bool,
        now: Instant,
    ) -> Inbound {
        let kind = request.kind();
        self.metrics
            .request_received(&peer, kind, request.encoded_len());
        let id = request.id();
        if !serving || self.scores.is_banned(&peer, now) {
            let response = RpcResponse::Error {
                id,
                code: RpcErrorCode::Refused,
            };
            self.metrics
                .response_sent(&peer, kind, response.encoded_len());
            return Inbound::Respond(response);
        }
        match request {
            RpcRequest::Push {
                round,
                header,
                body,
                known,
                ..
            } => match parse_peers(&known) {
                Some(known) if body.is_empty() => self.pull_push(peer, id, round, header, known),
                Some(known) => Inbound::Call(InboundCall::Push(PushedPacket {
                    round,
                    header,
                    body,
                    known,
                })),
                None => {
                    self.reject(&peer, BAD_REQUEST, Some(Severity::Major), now);
                    Inbound::Drop
                }
            },
            RpcRequest::GetMerge { round, .. } => Inbound::Call(InboundCall::GetMerge { round }),
            // Not an exchange request: the driver sends only pushes and merge fetches here.
            _ => Inbound::Respond(RpcResponse::Error {
                id,
                code: RpcErrorCode::Refused,
            }),
        }
    }

    /// The node answered an exchange request of `kind` from `peer` with `response`: count it
    /// under the request's kind (a merge fetch may be answered with a push's later answer).
    pub fn exchange_response_sent(&mut self, peer: &PeerId, kind: RpcKind, response: &RpcResponse) {
        self.metrics
            .response_sent(peer, kind, response.encoded_len());
    }

    /// The node found `peer`'s exchange traffic invalid (a pushed packet that does not verify,
    /// `reason` says why): penalised like a bad packet.
    pub fn report_invalid(&mut self, peer: PeerId, reason: &'static str, now: Instant) {
        self.reject(&peer, reason, Some(Severity::Major), now);
    }
}
