//! Serving peers' requests from the node's store.
//!
//! What a node serves is deliberately narrow:
//! - `GetHeaders` by key returns only headers this node *announced* under those keys (its own
//!   packets, for retained windows), so a node never answers for keys it does not provide;
//! - `GetHeaders` by id returns stored headers by id;
//! - `GetHeaders` for the latest returns the node's newest own packet's header (to peers that
//!   follow it between discovery rounds);
//! - a body goes out only as the answer to a `GetBody` naming its id: nothing is ever pushed;
//! - `GetSnapshot` returns the node's newest model snapshot, if the store holds one, and only
//!   to a peer that was served one of this node's bodies lately (one snapshot per body: see
//!   [`crate::snapshot`]); anyone else is refused. A snapshot too large for one response is
//!   answered with its header, and `GetChunk` then serves pieces of that body (by its
//!   hash) to the peer that asked, while its grant lasts; so are a hub's large merge to its
//!   members and a member's large push to its hub ([`crate::pieces`]);
//! - the hub exchange's `Push` and `GetMerge` never reach the store: the driver hands them to
//!   the node that serves the exchange ([`crate::exchange_rpc`]), or refuses them.
//!
//! Banned peers get [`RpcErrorCode::Refused`]; every request and response is counted per kind
//! and per peer. A request that does not decode (or claims more than the request limit) reaches
//! the core too, through `handle_bad_request`: it is answered with nothing and scored as a
//! major offence (reject label `bad_request`), so garbage-sending peers are banned like those that
//! send bad responses.

use std::time::Instant;

use kindred_proto::rpc::{
    HeaderQuery, MAX_HEADERS_PER_RESPONSE, RpcErrorCode, RpcRequest, RpcResponse,
};
use kindred_proto::{MAX_BODY_BYTES, MAX_HEADER_BYTES, MAX_PIECED_BODY_BYTES};
use libp2p::PeerId;

use crate::core::RoutingCore;
use crate::pieces::slice;
use crate::scoring::Severity;
use crate::store::PacketStore;

/// The reject label of an undecodable inbound request.
pub(crate) const BAD_REQUEST: &str = "bad_request";
/// Reject label of a request frame over the size limit (`CodecError::FrameTooLarge`'s reason).
pub(crate) const OVERSIZE_REQUEST: &str = "rpc_oversize";

impl RoutingCore {
    /// Answer an inbound request from `peer` out of `store`.
    pub fn handle_request(
        &mut self,
        peer: PeerId,
        request: &RpcRequest,
        store: &dyn PacketStore,
        now: Instant,
    ) -> RpcResponse {
        let kind = request.kind();
        self.metrics
            .request_received(&peer, kind, request.encoded_len());
        let id = request.id();
        let not_found = RpcResponse::Error {
            id,
            code: RpcErrorCode::NotFound,
        };
        let response = if self.scores.is_banned(&peer, now) {
            RpcResponse::Error {
                id,
                code: RpcErrorCode::Refused,
            }
        } else {
            match request {
                RpcRequest::GetHeaders { query, .. } => {
                    let ids: Vec<_> = match query {
                        HeaderQuery::Keys(keys) => {
                            let mut ids = Vec::new();
                            for key in keys {
                                if let Some(id) = self.by_key.get(key)
                                    && !ids.contains(id)
                                {
                                    ids.push(*id);
                                }
                            }
                            ids
                        }
                        HeaderQuery::Ids(ids) => ids.clone(),
                        HeaderQuery::Latest => self.latest_own.into_iter().collect(),
                    };
                    // Never send what the peer's decoder would refuse (a corrupt store entry).
                    let headers = ids
                        .iter()
                        .filter_map(|id| store.header(id))
                        .filter(|h| h.len() <= MAX_HEADER_BYTES)
                        .take(MAX_HEADERS_PER_RESPONSE)
                        .collect();
                    RpcResponse::Headers { id, headers }
                }
                // Never send what the peer's decoder would refuse: an oversize store entry is
                // logged and answered as missing.
                RpcRequest::GetBody { packet, .. } => match store.body(packet) {
                    Some(body) if body.len() <= MAX_BODY_BYTES => {
                        self.grant_snapshot(peer, now);
                        RpcResponse::Body { id, body }
                    }
                    Some(_) => {
                        tracing::warn!(%peer, %packet, "stored body is over the wire limit");
                        not_found
                    }
                    None => not_found,
                },
                RpcRequest::GetSnapshot { .. } if !self.may_fetch_snapshot(&peer, now) => {
                    RpcResponse::Error {
                        id,
                        code: RpcErrorCode::Refused,
                    }
                }
                RpcRequest::GetSnapshot { .. } => match store.snapshot() {
                    Some(s) if s.header.len() > MAX_HEADER_BYTES => {
                        tracing::warn!(%peer, "model snapshot header is over the wire limit");
                        not_found
                    }
                    Some(s) if !self.in_pieces(s.body.len()) => RpcResponse::Snapshot {
                        id,
                        header: s.header.clone(),
                        body: s.body.clone(),
                    },
                    // Too large for one response: the header, and the body in pieces.
                    Some(s) if s.body.len() <= MAX_PIECED_BODY_BYTES => {
                        self.open_snapshot_chunks(peer, s.body_hash, now);
                        RpcResponse::SnapshotHeader {
                            id,
                            header: s.header.clone(),
                        }
                    }
                    Some(_) => {
                        tracing::warn!(%peer, "model snapshot is over the wire limit");
                        not_found
                    }
                    None => not_found,
                },
                RpcRequest::GetChunk {
                    body_hash,
                    offset,
                    len,
                    ..
                } => {
                    let code = |code| RpcResponse::Error { id, code };
                    match self
                        .served_bodies
                        .piece(&peer, body_hash, *offset, *len, now)
                    {
                        // A large merge or push this node offered.
                        Some(Ok(bytes)) => RpcResponse::Chunk { id, bytes },
                        Some(Err(c)) => code(c),
                        None if !self.may_fetch_snapshot_chunk(&peer, body_hash, now) => {
                            code(RpcErrorCode::Refused)
                        }
                        // Only the snapshot served now: one replaced since is not found, and
                        // the fetch starts again from its header.
                        None => store
                            .snapshot()
                            .filter(|s| s.body_hash == *body_hash)
                            .and_then(|s| slice(&s.body, *offset, *len))
                            .map_or(not_found, |bytes| RpcResponse::Chunk { id, bytes }),
                    }
                }
                // Answered by the node through `exchange_rpc`; refused if one gets here.
                RpcRequest::Push { .. } | RpcRequest::GetMerge { .. } => RpcResponse::Error {
                    id,
                    code: RpcErrorCode::Refused,
                },
            }
        };
        self.metrics
            .response_sent(&peer, kind, response.encoded_len());
        response
    }

    /// `peer` sent a request that is not one: a frame that does not decode, or a length prefix
    /// over the request limit (`cause` is the codec's label, e.g. `rpc_malformed` or
    /// `rpc_oversize`). Counted as an `rpc_oversize` reject if it is over the limit (a push
    /// larger than the node's model allows, say), as a `bad_request` otherwise (the cause goes
    /// to the log), and penalised as a major offence, like an invalid response, so a peer that
    /// keeps sending garbage is banned. Nothing is answered.
    pub fn handle_bad_request(&mut self, peer: PeerId, cause: &'static str, now: Instant) {
        tracing::debug!(%peer, cause, "undecodable request");
        let label = if cause == OVERSIZE_REQUEST {
            OVERSIZE_REQUEST
        } else {
            BAD_REQUEST
        };
        self.reject(&peer, label, Some(Severity::Major), now);
    }
}
