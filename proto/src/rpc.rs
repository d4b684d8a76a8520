//! Request/response messages peers exchange to fetch packets: `GetHeaders` and `GetBody`, and
//! `GetSnapshot` for a peer's whole model.
//!
//! Routing finds *which* peers hold similar updates; these two messages then move the packets.
//! A node asks a provider for the headers it announced under some semantic keys (or for headers
//! by [`PacketId`]), ranks them, and only then asks for the few bodies it will merge, by id. Every
//! request carries a [`RequestId`] chosen by the requester, and every response echoes it, so a
//! response can always be matched to (and checked against) the request that caused it.
//!
//! `GetSnapshot` asks a peer for its model as it stands (its cumulative update, sealed with
//! [`crate::seal_snapshot`]): a node that merged the peer's update moves part of the way toward
//! its model, so that nodes' models do not drift apart (see `kindred_distill::pull`).
//!
//! Like the packet codec, decoding treats the bytes as hostile. Postcard first parses the message
//! into wire types that only *borrow* the input, so no claimed length can make the decoder
//! allocate; each list's length is then compared with its limit (the constants below) before any
//! owned value is built. Headers inside a response stay opaque byte strings here: the receiver
//! verifies each one with [`crate::decode_header`], which is where signatures are checked.
//!
//! Layout (postcard throughout):
//! - a request is `postcard(WireRequest)`; key and id lists are packed runs of 32-byte values;
//! - a response is `postcard(WireResponse)`, and a `Headers` response is followed by `count`
//!   postcard byte strings (varint length ‖ bytes), byte-identical to postcard's encoding of a
//!   struct ending in a `Vec<&[u8]>`.
//!
//! ```
//! use kindred_proto::rpc::*;
//!
//! let request = RpcRequest::GetHeaders {
//!     id: RequestId(7),
//!     query: HeaderQuery::Keys(vec![[1u8; 32], [2u8; 32]]),
//! };
//! let bytes = request.encode()?;
//! assert_eq!(bytes.len(), request.encoded_len());
//! assert_eq!(RpcRequest::decode(&bytes)?, request);
//!
//! let response = RpcResponse::Headers { id: RequestId(7), headers: vec![vec![0xab; 10]] };
//! let bytes = response.encode()?;
//! assert_eq!(RpcResponse::decode(&bytes, request.response_limit())?, response);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::header::PacketId;
use crate::limits::{MAX_BODY_BYTES, MAX_HEADER_BYTES};

/// Most keys or packet ids one `GetHeaders` request may name.
///
/// A round lookup asks each provider once, naming the keys it was found under: at most the bands
/// plus probes, each possibly sharded, which stays far below this.
pub const MAX_QUERY_ITEMS: usize = 256;

/// Most headers one `Headers` response may carry.
pub const MAX_HEADERS_PER_RESPONSE: usize = 64;

/// Largest encoded request accepted (bytes). The biggest valid request (a full key list) is
/// 8,205 bytes.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// Largest encoded `Headers` response accepted (bytes): a full list of maximum-size headers plus
/// its framing.
pub const MAX_HEADERS_RESPONSE_BYTES: usize =
    MAX_HEADERS_PER_RESPONSE * (MAX_HEADER_BYTES + 2) + 32;

/// Largest encoded `Body` response accepted (bytes): the largest body plus its framing.
pub const MAX_BODY_RESPONSE_BYTES: usize = MAX_BODY_BYTES + 32;

/// Largest encoded `Snapshot` response accepted (bytes): a header and the largest body, plus
/// their framing.
pub const MAX_SNAPSHOT_RESPONSE_BYTES: usize = MAX_HEADER_BYTES + MAX_BODY_BYTES + 32;

/// Largest encoded response of any kind (bytes).
pub const MAX_RESPONSE_BYTES: usize = MAX_SNAPSHOT_RESPONSE_BYTES;

const KEY_LEN: usize = 32;

/// Identifier the requester picks for a request; its response carries the same value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What a `GetHeaders` request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderQuery {
    /// Headers the responder announced under any of these semantic (DHT) keys.
    Keys(Vec<[u8; 32]>),
    /// Headers with these packet ids.
    Ids(Vec<PacketId>),
    /// The responder's newest own header: how a node follows a partner it already found,
    /// between the rounds in which it searches the DHT.
    Latest,
}

impl HeaderQuery {
    /// Number of keys or ids named (0 for [`HeaderQuery::Latest`]).
    pub fn len(&self) -> usize {
        match self {
            Self::Keys(k) => k.len(),
            Self::Ids(i) => i.len(),
            Self::Latest => 0,
        }
    }

    /// Whether a key or id query names nothing (such a query is invalid on the wire).
    /// [`HeaderQuery::Latest`] names nothing by design and is never empty.
    pub fn is_empty(&self) -> bool {
        match self {
            Self::Keys(k) => k.is_empty(),
            Self::Ids(i) => i.is_empty(),
            Self::Latest => false,
        }
    }
}

/// A request from one peer to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RpcRequest {
    /// Ask for encoded, signed packet headers; answered by [`RpcResponse::Headers`].
    GetHeaders {
        /// Echoed by the response.
        id: RequestId,
        /// Which headers.
        query: HeaderQuery,
    },
    /// Ask for one packet body by the id of its header; answered by [`RpcResponse::Body`].
    GetBody {
        /// Echoed by the response.
        id: RequestId,
        /// The packet whose body is wanted.
        packet: PacketId,
    },
    /// Ask for the responder's model snapshot; answered by [`RpcResponse::Snapshot`].
    GetSnapshot {
        /// Echoed by the response.
        id: RequestId,
    },
}

/// Why the responder could not answer a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RpcErrorCode {
    /// The responder does not have (or no longer serves) the packet asked for.
    NotFound,
    /// The responder refuses to serve this peer now (rate limit, ban, shutting down).
    Refused,
}

/// A response to an [`RpcRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RpcResponse {
    /// Encoded, signed headers (each at most [`MAX_HEADER_BYTES`]); possibly none.
    Headers {
        /// The request's id.
        id: RequestId,
        /// Each entry is one header as produced by [`crate::seal`]; verify with
        /// [`crate::decode_header`].
        headers: Vec<Vec<u8>>,
    },
    /// One encoded packet body; verify with [`crate::decode_body`] against its header.
    Body {
        /// The request's id.
        id: RequestId,
        /// The encoded body.
        body: Vec<u8>,
    },
    /// The responder's model snapshot: verify with [`crate::OutcomePacket::decode_snapshot`].
    Snapshot {
        /// The request's id.
        id: RequestId,
        /// The encoded header, signed under the snapshot domain (at most [`MAX_HEADER_BYTES`]).
        header: Vec<u8>,
        /// The encoded body (at most [`MAX_BODY_BYTES`]).
        body: Vec<u8>,
    },
    /// The request could not be answered.
    Error {
        /// The request's id.
        id: RequestId,
        /// Why.
        code: RpcErrorCode,
    },
}

/// Which kind of exchange a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RpcKind {
    /// `GetHeaders` / `Headers`.
    Headers,
    /// `GetBody` / `Body`.
    Body,
    /// `GetSnapshot` / `Snapshot`.
    Snapshot,
}

impl RpcKind {
    /// A short, stable label (`"headers"`, `"body"`, `"snapshot"`) for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Self::Headers => "headers",
            Self::Body => "body",
            Self::Snapshot => "snapshot",
        }
    }
}

/// Why received RPC bytes were rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RpcDecodeError {
    /// A length exceeds its limit; rejected before anything was allocated.
    #[error("{what} is {len} long, over the limit of {max}")]
    Oversize {
        /// What was too long.
        what: &'static str,
        /// The length claimed or seen.
        len: u64,
        /// The limit it broke.
        max: u64,
    },
    /// The bytes ended before the message did.
    #[error("rpc message is truncated")]
    Truncated,
    /// Bytes were left over after a complete message.
    #[error("rpc message has {extra} trailing bytes")]
    TrailingBytes {
        /// How many bytes were left.
        extra: usize,
    },
    /// The bytes do not follow the encoding (bad varint, unknown tag, ragged key list...).
    #[error("rpc message is malformed: {detail}")]
    Malformed {
        /// What the decoder saw.
        detail: &'static str,
    },
}

impl RpcDecodeError {
    /// A short, stable label for the cause, suitable as a metric label.
    ///
    /// ```
    /// use kindred_proto::rpc::RpcDecodeError;
    /// assert_eq!(RpcDecodeError::Truncated.reason(), "rpc_truncated");
    /// ```
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Oversize { .. } => "rpc_oversize",
            Self::Truncated => "rpc_truncated",
            Self::TrailingBytes { .. } => "rpc_trailing_bytes",
            Self::Malformed { .. } => "rpc_malformed",
        }
    }
}

/// Why a message could not be encoded: it breaks a limit that receivers enforce, so sending it
/// would only get it rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RpcEncodeError {
    /// A list or byte string is longer than receivers accept.
    #[error("{what} is {len} long, over the limit of {max}")]
    Oversize {
        /// What was too long.
        what: &'static str,
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A `GetHeaders` query names nothing.
    #[error("a GetHeaders query must name at least one key or id")]
    EmptyQuery,
}

#[derive(Serialize, Deserialize)]
enum WireRequest<'a> {
    HeadersByKeys { id: u64, keys: &'a [u8] },
    HeadersByIds { id: u64, ids: &'a [u8] },
    Body { id: u64, packet: [u8; 32] },
    // Appended last: postcard numbers variants in order, so the earlier encodings stay as
    // they were.
    HeadersLatest { id: u64 },
    Snapshot { id: u64 },
}

#[derive(Serialize, Deserialize)]
enum WireErrorCode {
    NotFound,
    Refused,
}

#[derive(Serialize, Deserialize)]
enum WireResponse<'a> {
    /// Followed by `count` postcard byte strings.
    Headers {
        id: u64,
        count: u32,
    },
    Body {
        id: u64,
        body: &'a [u8],
    },
    Error {
        id: u64,
        code: WireErrorCode,
    },
    // Appended last, as `WireRequest::Snapshot`.
    Snapshot {
        id: u64,
        header: &'a [u8],
        body: &'a [u8],
    },
}

fn oversize_enc(what: &'static str, len: usize, max: usize) -> RpcEncodeError {
    RpcEncodeError::Oversize {
        what,
        len: len as u64,
        max: max as u64,
    }
}

fn oversize_dec(what: &'static str, len: usize, max: usize) -> RpcDecodeError {
    RpcDecodeError::Oversize {
        what,
        len: len as u64,
        max: max as u64,
    }
}

/// Bytes of the LEB128 varint encoding of `v`.
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

impl RpcRequest {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        match self {
            Self::GetHeaders { id, .. } | Self::GetBody { id, .. } | Self::GetSnapshot { id } => {
                *id
            }
        }
    }

    /// Which exchange this request starts.
    pub fn kind(&self) -> RpcKind {
        match self {
            Self::GetHeaders { .. } => RpcKind::Headers,
            Self::GetBody { .. } => RpcKind::Body,
            Self::GetSnapshot { .. } => RpcKind::Snapshot,
        }
    }

    /// The largest response a requester should accept for this request (bytes).
    pub fn response_limit(&self) -> usize {
        match self.kind() {
            RpcKind::Headers => MAX_HEADERS_RESPONSE_BYTES,
            RpcKind::Body => MAX_BODY_RESPONSE_BYTES,
            RpcKind::Snapshot => MAX_SNAPSHOT_RESPONSE_BYTES,
        }
    }

    /// Length of [`RpcRequest::encode`]'s output, computed without encoding.
    pub fn encoded_len(&self) -> usize {
        match self {
            Self::GetHeaders {
                id,
                query: HeaderQuery::Latest,
            } => 1 + varint_len(id.0),
            Self::GetHeaders { id, query } => {
                let bytes = query.len() * KEY_LEN;
                1 + varint_len(id.0) + varint_len(bytes as u64) + bytes
            }
            Self::GetBody { id, .. } => 1 + varint_len(id.0) + KEY_LEN,
            Self::GetSnapshot { id } => 1 + varint_len(id.0),
        }
    }

    /// Encode the request.
    ///
    /// # Errors
    /// [`RpcEncodeError`] when the query is empty or names more than [`MAX_QUERY_ITEMS`] items:
    /// receivers would reject it.
    pub fn encode(&self) -> Result<Vec<u8>, RpcEncodeError> {
        let out = Vec::with_capacity(self.encoded_len());
        // Serialising into a Vec only fails on allocation failure, which aborts anyway.
        match self {
            Self::GetHeaders { id, query } => {
                if query.is_empty() {
                    return Err(RpcEncodeError::EmptyQuery);
                }
                if query.len() > MAX_QUERY_ITEMS {
                    return Err(oversize_enc("query", query.len(), MAX_QUERY_ITEMS));
                }
                let packed: Cow<'_, [u8]> = match query {
                    HeaderQuery::Keys(keys) => Cow::Borrowed(keys.as_flattened()),
                    HeaderQuery::Ids(ids) => Cow::Owned(ids.iter().flat_map(|p| p.0).collect()),
                    HeaderQuery::Latest => Cow::Borrowed(&[]),
                };
                let wire = match query {
                    HeaderQuery::Keys(_) => WireRequest::HeadersByKeys {
                        id: id.0,
                        keys: &packed,
                    },
                    HeaderQuery::Ids(_) => WireRequest::HeadersByIds {
                        id: id.0,
                        ids: &packed,
                    },
                    HeaderQuery::Latest => WireRequest::HeadersLatest { id: id.0 },
                };
                Ok(postcard::to_extend(&wire, out).unwrap_or_default())
            }
            Self::GetBody { id, packet } => Ok(postcard::to_extend(
                &WireRequest::Body {
                    id: id.0,
                    packet: packet.0,
                },
                out,
            )
            .unwrap_or_default()),
            Self::GetSnapshot { id } => Ok(postcard::to_extend(
                &WireRequest::Snapshot { id: id.0 },
                out,
            )
            .unwrap_or_default()),
        }
    }

    /// Decode a request received from a peer.
    ///
    /// # Errors
    /// The first [`RpcDecodeError`] found; nothing is allocated for a list longer than
    /// [`MAX_QUERY_ITEMS`] or a message longer than [`MAX_REQUEST_BYTES`].
    pub fn decode(bytes: &[u8]) -> Result<Self, RpcDecodeError> {
        if bytes.len() > MAX_REQUEST_BYTES {
            return Err(oversize_dec("request", bytes.len(), MAX_REQUEST_BYTES));
        }
        let (wire, rest) =
            postcard::take_from_bytes::<WireRequest<'_>>(bytes).map_err(postcard_error)?;
        if !rest.is_empty() {
            return Err(RpcDecodeError::TrailingBytes { extra: rest.len() });
        }
        Ok(match wire {
            WireRequest::HeadersByKeys { id, keys } => Self::GetHeaders {
                id: RequestId(id),
                query: HeaderQuery::Keys(unpack_keys(keys)?),
            },
            WireRequest::HeadersByIds { id, ids } => Self::GetHeaders {
                id: RequestId(id),
                query: HeaderQuery::Ids(unpack_keys(ids)?.into_iter().map(PacketId).collect()),
            },
            WireRequest::Body { id, packet } => Self::GetBody {
                id: RequestId(id),
                packet: PacketId(packet),
            },
            WireRequest::HeadersLatest { id } => Self::GetHeaders {
                id: RequestId(id),
                query: HeaderQuery::Latest,
            },
            WireRequest::Snapshot { id } => Self::GetSnapshot { id: RequestId(id) },
        })
    }
}

/// Split a packed run of 32-byte values, checking its length before allocating.
fn unpack_keys(packed: &[u8]) -> Result<Vec<[u8; 32]>, RpcDecodeError> {
    if !packed.len().is_multiple_of(KEY_LEN) {
        return Err(RpcDecodeError::Malformed {
            detail: "key list is not a whole number of 32-byte keys",
        });
    }
    let count = packed.len() / KEY_LEN;
    if count == 0 {
        return Err(RpcDecodeError::Malformed {
            detail: "empty query",
        });
    }
    if count > MAX_QUERY_ITEMS {
        return Err(oversize_dec("query", count, MAX_QUERY_ITEMS));
    }
    Ok(packed
        .chunks_exact(KEY_LEN)
        .map(|c| {
            let mut key = [0u8; KEY_LEN];
            key.copy_from_slice(c);
            key
        })
        .collect())
}

impl RpcResponse {
    /// The id of the request this answers.
    pub fn id(&self) -> RequestId {
        match self {
            Self::Headers { id, .. }
            | Self::Body { id, .. }
            | Self::Snapshot { id, .. }
            | Self::Error { id, .. } => *id,
        }
    }

    /// Length of [`RpcResponse::encode`]'s output, computed without encoding.
    pub fn encoded_len(&self) -> usize {
        match self {
            Self::Headers { id, headers } => {
                1 + varint_len(id.0)
                    + varint_len(headers.len() as u64)
                    + headers
                        .iter()
                        .map(|h| varint_len(h.len() as u64) + h.len())
                        .sum::<usize>()
            }
            Self::Body { id, body } => {
                1 + varint_len(id.0) + varint_len(body.len() as u64) + body.len()
            }
            Self::Snapshot { id, header, body } => {
                1 + varint_len(id.0)
                    + varint_len(header.len() as u64)
                    + header.len()
                    + varint_len(body.len() as u64)
                    + body.len()
            }
            Self::Error { id, .. } => 1 + varint_len(id.0) + 1,
        }
    }

    /// Encode the response.
    ///
    /// # Errors
    /// [`RpcEncodeError::Oversize`] when it carries more than [`MAX_HEADERS_PER_RESPONSE`]
    /// headers, a header longer than [`MAX_HEADER_BYTES`], or a body longer than
    /// [`MAX_BODY_BYTES`]: receivers would reject it. The same limits hold for a snapshot.
    pub fn encode(&self) -> Result<Vec<u8>, RpcEncodeError> {
        let mut out = Vec::with_capacity(self.encoded_len());
        match self {
            Self::Headers { id, headers } => {
                if headers.len() > MAX_HEADERS_PER_RESPONSE {
                    return Err(oversize_enc(
                        "header list",
                        headers.len(),
                        MAX_HEADERS_PER_RESPONSE,
                    ));
                }
                if let Some(h) = headers.iter().find(|h| h.len() > MAX_HEADER_BYTES) {
                    return Err(oversize_enc("header", h.len(), MAX_HEADER_BYTES));
                }
                let wire = WireResponse::Headers {
                    id: id.0,
                    count: headers.len() as u32,
                };
                out = postcard::to_extend(&wire, out).unwrap_or_default();
                for h in headers {
                    out = postcard::to_extend(&h.as_slice(), out).unwrap_or_default();
                }
            }
            Self::Body { id, body } => {
                if body.len() > MAX_BODY_BYTES {
                    return Err(oversize_enc("body", body.len(), MAX_BODY_BYTES));
                }
                let wire = WireResponse::Body { id: id.0, body };
                out = postcard::to_extend(&wire, out).unwrap_or_default();
            }
            Self::Snapshot { id, header, body } => {
                if header.len() > MAX_HEADER_BYTES {
                    return Err(oversize_enc("header", header.len(), MAX_HEADER_BYTES));
                }
                if body.len() > MAX_BODY_BYTES {
                    return Err(oversize_enc("body", body.len(), MAX_BODY_BYTES));
                }
                let wire = WireResponse::Snapshot {
                    id: id.0,
                    header,
                    body,
                };
                out = postcard::to_extend(&wire, out).unwrap_or_default();
            }
            Self::Error { id, code } => {
                let code = match code {
                    RpcErrorCode::NotFound => WireErrorCode::NotFound,
                    RpcErrorCode::Refused => WireErrorCode::Refused,
                };
                out = postcard::to_extend(&WireResponse::Error { id: id.0, code }, out)
                    .unwrap_or_default();
            }
        }
        Ok(out)
    }

    /// Decode a response received from a peer, accepting at most `limit` bytes (use
    /// [`RpcRequest::response_limit`] of the request it answers; never more than
    /// [`MAX_RESPONSE_BYTES`]).
    ///
    /// # Errors
    /// The first [`RpcDecodeError`] found. A header list is checked against
    /// [`MAX_HEADERS_PER_RESPONSE`] and each header against [`MAX_HEADER_BYTES`] before they are
    /// copied.
    pub fn decode(bytes: &[u8], limit: usize) -> Result<Self, RpcDecodeError> {
        let limit = limit.min(MAX_RESPONSE_BYTES);
        if bytes.len() > limit {
            return Err(oversize_dec("response", bytes.len(), limit));
        }
        let (wire, mut rest) =
            postcard::take_from_bytes::<WireResponse<'_>>(bytes).map_err(postcard_error)?;
        let response = match wire {
            WireResponse::Headers { id, count } => {
                let count = count as usize;
                if count > MAX_HEADERS_PER_RESPONSE {
                    return Err(oversize_dec("header list", count, MAX_HEADERS_PER_RESPONSE));
                }
                // Every entry takes at least one byte (its length): a count the remaining bytes
                // cannot hold is rejected before the list is allocated.
                if rest.len() < count {
                    return Err(RpcDecodeError::Truncated);
                }
                let mut headers = Vec::with_capacity(count);
                for _ in 0..count {
                    let (h, tail) =
                        postcard::take_from_bytes::<&[u8]>(rest).map_err(postcard_error)?;
                    if h.len() > MAX_HEADER_BYTES {
                        return Err(oversize_dec("header", h.len(), MAX_HEADER_BYTES));
                    }
                    headers.push(h.to_vec());
                    rest = tail;
                }
                Self::Headers {
                    id: RequestId(id),
                    headers,
                }
            }
            WireResponse::Body { id, body } => {
                if body.len() > MAX_BODY_BYTES {
                    return Err(oversize_dec("body", body.len(), MAX_BODY_BYTES));
                }
                Self::Body {
                    id: RequestId(id),
                    body: body.to_vec(),
                }
            }
            WireResponse::Snapshot { id, header, body } => {
                if header.len() > MAX_HEADER_BYTES {
                    return Err(oversize_dec("header", header.len(), MAX_HEADER_BYTES));
                }
                if body.len() > MAX_BODY_BYTES {
                    return Err(oversize_dec("body", body.len(), MAX_BODY_BYTES));
                }
                Self::Snapshot {
                    id: RequestId(id),
                    header: header.to_vec(),
                    body: body.to_vec(),
                }
            }
            WireResponse::Error { id, code } => Self::Error {
                id: RequestId(id),
                code: match code {
                    WireErrorCode::NotFound => RpcErrorCode::NotFound,
                    WireErrorCode::Refused => RpcErrorCode::Refused,
                },
            },
        };
        if !rest.is_empty() {
            return Err(RpcDecodeError::TrailingBytes { extra: rest.len() });
        }
        Ok(response)
    }
}

fn postcard_error(err: postcard::Error) -> RpcDecodeError {
    use postcard::Error as E;
    let detail = match err {
        E::DeserializeUnexpectedEnd => return RpcDecodeError::Truncated,
        E::DeserializeBadVarint => "bad varint",
        // serde's derived enum visitors report an unknown variant index as a custom error.
        E::DeserializeBadEnum | E::SerdeDeCustom => "unknown enum tag",
        _ => "undecodable bytes",
    };
    RpcDecodeError::Malformed { detail }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_len_matches_postcard() {
        for v in [0u64, 1, 127, 128, 16_383, 16_384, u32::MAX as u64, u64::MAX] {
            assert_eq!(
                varint_len(v),
                postcard::to_allocvec(&v).unwrap_or_default().len()
            );
        }
    }

    #[test]
    fn largest_request_fits_the_limit() {
        let request = RpcRequest::GetHeaders {
            id: RequestId(u64::MAX),
            query: HeaderQuery::Keys(vec![[0xff; 32]; MAX_QUERY_ITEMS]),
        };
        let len = request.encode().map(|b| b.len()).unwrap_or(usize::MAX);
        assert_eq!(len, request.encoded_len());
        assert!(len <= MAX_REQUEST_BYTES, "{len}");
    }

    #[test]
    fn largest_snapshot_response_fits_the_limit() {
        let response = RpcResponse::Snapshot {
            id: RequestId(u64::MAX),
            header: vec![0xff; MAX_HEADER_BYTES],
            body: vec![0xff; MAX_BODY_BYTES],
        };
        let len = response.encode().map(|b| b.len()).unwrap_or(usize::MAX);
        assert_eq!(len, response.encoded_len());
        assert!(len <= MAX_SNAPSHOT_RESPONSE_BYTES, "{len}");
        assert!(RpcResponse::decode(&[0; 8], MAX_SNAPSHOT_RESPONSE_BYTES).is_err());
    }

    #[test]
    fn largest_headers_response_fits_the_limit() {
        let response = RpcResponse::Headers {
            id: RequestId(u64::MAX),
            headers: vec![vec![0xff; MAX_HEADER_BYTES]; MAX_HEADERS_PER_RESPONSE],
        };
        assert!(response.encoded_len() <= MAX_HEADERS_RESPONSE_BYTES);
    }
}
