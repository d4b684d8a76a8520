//! Request/response messages peers exchange to fetch packets: `GetHeaders` and `GetBody`, and
//! `GetSnapshot` for a peer's whole model; `Push` and `GetMerge` for the hub exchange.
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
//! A snapshot is the whole model, so it can outgrow one message: over [`MAX_BODY_BYTES`] the
//! answer is its signed header alone ([`RpcResponse::SnapshotHeader`]), and the requester
//! fetches the body in pieces of at most [`MAX_CHUNK_BYTES`] by the body's hash
//! ([`RpcRequest::GetChunk`]), resuming where it stopped if a connection drops. A hub's merge
//! over [`MAX_BODY_BYTES`] (a model of more than about 6.5 × 10^8 parameters at 5%) goes the
//! same way: [`RpcResponse::MergeHeader`], then its pieces.
//!
//! The hub exchange has members push their packet to a hub ([`RpcRequest::Push`]), which answers
//! at once ([`RpcResponse::PushAnswer`]) and later serves one merged update to each member that
//! asks for it ([`RpcRequest::GetMerge`], answered by [`RpcResponse::Merge`]): a merge can take
//! longer than one request's timeout, so it is fetched, not awaited. A member that joins a hub
//! fetches the hub's model with `GetSnapshot`. Peer lists in these messages (`known`, `listed`)
//! and a redirect's hub are encoded `PeerId` bytes, opaque here like headers: the receiver parses
//! them (`PeerId::from_bytes`), and this module only bounds their number and length
//! ([`MAX_KNOWN_PEERS`], [`MAX_PEER_ID_BYTES`]). A push carries a whole packet body, so it is
//! the one request allowed past [`MAX_REQUEST_BYTES`] (up to [`MAX_PUSH_REQUEST_BYTES`]).
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
//!   struct ending in a `Vec<&[u8]>`;
//! - a `Push` request and a `Merge` response end the same way: their peer list is a `count`
//!   followed by `count` postcard byte strings, each checked as it is read.
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
pub use crate::limits::MAX_PEER_ID_BYTES;
use crate::limits::{MAX_BODY_BYTES, MAX_CHUNK_BYTES, MAX_HEADER_BYTES};

/// Most keys or packet ids one `GetHeaders` request may name.
///
/// A round lookup asks each provider once, naming the keys it was found under: at most the bands
/// plus probes, each possibly sharded, which stays far below this.
pub const MAX_QUERY_ITEMS: usize = 256;

/// Most headers one `Headers` response may carry.
pub const MAX_HEADERS_PER_RESPONSE: usize = 64;

/// Most peers one `Push` (`known`) or `Merge` (`listed`) may name.
///
/// A cohort view is a few dozen peers; this is headroom, and what bounds the list's memory
/// before it is read (each entry at most [`MAX_PEER_ID_BYTES`]).
pub const MAX_KNOWN_PEERS: usize = 1024;

/// Largest encoded request accepted (bytes), a `Push` excepted. The biggest valid request of
/// another kind (a full key list) is 8,205 bytes.
///
/// [`RpcRequest::decode`] takes up to [`MAX_PUSH_REQUEST_BYTES`] and, once the message's tag is
/// read, refuses anything but a push that is longer than this (`Oversize` "request"). Readers
/// that do not take pushes (the routing codec today) should keep their frame limit at this.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// Bytes of framing a `Push` or `Merge` adds to its header, body and peer list, rounded up: tag,
/// id and round varints (10 bytes each at most), the header, body and list length varints, and a
/// merge's cosine and lineage (10 bytes at most).
const PACKET_FRAMING: usize = 48;

/// Encoded bytes of a full peer list: each entry is a one-byte length and at most
/// [`MAX_PEER_ID_BYTES`]; the count's varint is in [`PACKET_FRAMING`].
const MAX_PEER_LIST_BYTES: usize = MAX_KNOWN_PEERS * (MAX_PEER_ID_BYTES + 1);

/// Largest encoded `Push` request accepted (bytes): the largest header and body, a full
/// `known` list, and their framing. The only request allowed past [`MAX_REQUEST_BYTES`]:
/// [`RpcRequest::decode`] accepts this many bytes overall and refuses any other kind of request
/// over [`MAX_REQUEST_BYTES`].
pub const MAX_PUSH_REQUEST_BYTES: usize =
    MAX_HEADER_BYTES + MAX_BODY_BYTES + MAX_PEER_LIST_BYTES + PACKET_FRAMING;

/// Largest encoded `Headers` response accepted (bytes): a full list of maximum-size headers plus
/// its framing.
pub const MAX_HEADERS_RESPONSE_BYTES: usize =
    MAX_HEADERS_PER_RESPONSE * (MAX_HEADER_BYTES + 2) + 32;

/// Largest encoded `Body` response accepted (bytes): the largest body plus its framing.
pub const MAX_BODY_RESPONSE_BYTES: usize = MAX_BODY_BYTES + 32;

/// Largest encoded `Snapshot` response accepted (bytes): a header and the largest body, plus
/// their framing.
pub const MAX_SNAPSHOT_RESPONSE_BYTES: usize = MAX_HEADER_BYTES + MAX_BODY_BYTES + 32;

/// Largest encoded `PushAnswer` response accepted (bytes): a redirect naming the longest peer id,
/// plus its framing. An `Error` answer to a push is smaller.
pub const MAX_PUSH_ANSWER_BYTES: usize = MAX_PEER_ID_BYTES + 32;

/// Largest encoded `Merge` response accepted (bytes): the largest header and body, a full
/// `listed` list, and their framing.
pub const MAX_MERGE_RESPONSE_BYTES: usize =
    MAX_HEADER_BYTES + MAX_BODY_BYTES + MAX_PEER_LIST_BYTES + PACKET_FRAMING;

/// Largest encoded `Chunk` response accepted (bytes): the largest piece plus its framing.
pub const MAX_CHUNK_RESPONSE_BYTES: usize = MAX_CHUNK_BYTES + 32;

/// Largest encoded response of any kind (bytes): the largest of the per-kind limits.
pub const MAX_RESPONSE_BYTES: usize = max(
    max(MAX_HEADERS_RESPONSE_BYTES, MAX_BODY_RESPONSE_BYTES),
    max(
        max(MAX_SNAPSHOT_RESPONSE_BYTES, MAX_CHUNK_RESPONSE_BYTES),
        max(MAX_PUSH_ANSWER_BYTES, MAX_MERGE_RESPONSE_BYTES),
    ),
);

/// `usize::max` for constants.
const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

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
    /// Ask for the responder's model snapshot; answered by [`RpcResponse::Snapshot`], or, for
    /// a body over [`MAX_BODY_BYTES`], by [`RpcResponse::SnapshotHeader`] alone (the body is then
    /// fetched in pieces with [`RpcRequest::GetChunk`]).
    GetSnapshot {
        /// Echoed by the response.
        id: RequestId,
    },
    /// Ask for `len` bytes from `offset` of a body the responder serves, named by its blake3
    /// hash (as its signed header says): today a snapshot's whose `GetSnapshot` was answered
    /// with its header alone. Answered by [`RpcResponse::Chunk`] with exactly
    /// `min(len, body length − offset)` bytes, or [`RpcResponse::Error`] when the responder does
    /// not (or no longer) serve that body.
    GetChunk {
        /// Echoed by the response.
        id: RequestId,
        /// The body's blake3 hash.
        body_hash: [u8; 32],
        /// Where the piece starts in the body.
        offset: u64,
        /// Its length: 1..=[`MAX_CHUNK_BYTES`].
        len: u32,
    },
    /// A member's push to its hub: its packet for `round` and the peers of its cohort view.
    /// Answered at once by [`RpcResponse::PushAnswer`].
    Push {
        /// Echoed by the response.
        id: RequestId,
        /// The exchange round the packet is for.
        round: u64,
        /// The member's sealed packet header (at most [`MAX_HEADER_BYTES`]); verify with
        /// [`crate::decode_header`].
        header: Vec<u8>,
        /// The packet's encoded body (at most [`MAX_BODY_BYTES`]); verify with
        /// [`crate::decode_body`] against its header.
        body: Vec<u8>,
        /// The peers of the member's cohort view, each an encoded `PeerId` (non-empty, at most
        /// [`MAX_PEER_ID_BYTES`]); at most [`MAX_KNOWN_PEERS`] of them.
        known: Vec<Vec<u8>>,
    },
    /// Ask a hub for its merge of `round` (a merge can take longer than one request's
    /// timeout, so members fetch it). Answered by [`RpcResponse::Merge`] or
    /// [`RpcResponse::Error`].
    GetMerge {
        /// Echoed by the response.
        id: RequestId,
        /// The round whose merge is wanted.
        round: u64,
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

/// A hub's immediate answer to a [`RpcRequest::Push`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PushAnswer {
    /// Queued for this round's admission: a merge (or a refusal) follows.
    Accepted,
    /// The peer pushed to is not the pusher's hub; `hub` is the one it names.
    NotHub {
        /// The hub's encoded `PeerId` (non-empty, at most [`MAX_PEER_ID_BYTES`]).
        hub: Vec<u8>,
    },
    /// The hub holds as many pushes as it merges, or is not taking part this round.
    Busy,
    /// The push came after the hub closed its admission for the round.
    Late,
    /// The hub did not admit the pusher, or, with `foreign`, its own data refused the merge.
    Refused {
        /// The hub's data refused the merge, not its gate the pusher.
        foreign: bool,
    },
}

/// A sketch cosine as a [`RpcResponse::Merge`] carries it: in ten-thousandths, within
/// −10,000..=10,000 (the decoder refuses anything else).
///
/// A hub measures each pusher's embedding against its own to admit it; it sends that cosine
/// back with the merge, where the member keeps it as its anchor (`Cohort::merged` in
/// `kindred-routing`). Sending the number instead of the hub's embedding saves the merge
/// header's sketch (512 bytes by default) on every member's fetch; a hub could lie in either.
///
/// ```
/// use kindred_proto::rpc::SketchCosine;
/// let c = SketchCosine::from_f32(0.97);
/// assert_eq!(c.permyriad(), 9700);
/// assert!((c.to_f32() - 0.97).abs() < 1e-4);
/// assert_eq!(SketchCosine::from_f32(f32::NAN).permyriad(), 0);
/// assert_eq!(SketchCosine::from_f32(3.0).permyriad(), 10_000);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SketchCosine(i16);

impl SketchCosine {
    /// The largest magnitude: a cosine of 1.
    pub const SCALE: i16 = 10_000;

    /// `cosine` rounded to ten-thousandths, clamped to [−1, 1]; 0 if it is not finite.
    pub fn from_f32(cosine: f32) -> Self {
        if !cosine.is_finite() {
            return Self(0);
        }
        let scaled = (cosine.clamp(-1.0, 1.0) * f32::from(Self::SCALE)).round();
        // In −10,000..=10,000 after the clamp.
        Self(scaled as i16)
    }

    /// The cosine `permyriad` ten-thousandths, if within −10,000..=10,000.
    pub fn from_permyriad(permyriad: i16) -> Option<Self> {
        (-Self::SCALE..=Self::SCALE)
            .contains(&permyriad)
            .then_some(Self(permyriad))
    }

    /// The cosine in ten-thousandths.
    pub fn permyriad(self) -> i16 {
        self.0
    }

    /// The cosine.
    pub fn to_f32(self) -> f32 {
        f32::from(self.0) / f32::from(Self::SCALE)
    }
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
    /// The header of a snapshot whose body is over [`MAX_BODY_BYTES`]: verify it with
    /// [`crate::decode_snapshot_header`], then fetch the body it announces with
    /// [`RpcRequest::GetChunk`].
    SnapshotHeader {
        /// The request's id.
        id: RequestId,
        /// The encoded header, signed under the snapshot domain (at most [`MAX_HEADER_BYTES`]).
        header: Vec<u8>,
    },
    /// A hub's merge whose body is over [`MAX_BODY_BYTES`]: [`RpcResponse::Merge`] without its
    /// body. Verify the header with [`crate::decode_merge_header`], then fetch the body it
    /// announces with [`RpcRequest::GetChunk`].
    MergeHeader {
        /// The request's id.
        id: RequestId,
        /// The hub's sealed merge header (at most [`MAX_HEADER_BYTES`]), signed under the merge
        /// domain.
        header: Vec<u8>,
        /// As [`RpcResponse::Merge`]'s.
        cosine: SketchCosine,
        /// As [`RpcResponse::Merge`]'s.
        lineage: u64,
        /// As [`RpcResponse::Merge`]'s: at most [`MAX_KNOWN_PEERS`] encoded `PeerId`s.
        listed: Vec<Vec<u8>>,
    },
    /// A piece of a body, answering [`RpcRequest::GetChunk`] (at most [`MAX_CHUNK_BYTES`]).
    Chunk {
        /// The request's id.
        id: RequestId,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// The request could not be answered.
    Error {
        /// The request's id.
        id: RequestId,
        /// Why.
        code: RpcErrorCode,
    },
    /// A hub's answer to a push.
    PushAnswer {
        /// The request's id.
        id: RequestId,
        /// What the hub made of the push.
        answer: PushAnswer,
    },
    /// A hub's merge of a round: verify both with [`crate::OutcomePacket::decode_merge`] (the
    /// header is signed under the merge domain, [`crate::seal_merge`]).
    Merge {
        /// The request's id.
        id: RequestId,
        /// The hub's sealed merge header (at most [`MAX_HEADER_BYTES`]), signed under the merge
        /// domain.
        header: Vec<u8>,
        /// The merge's encoded body (at most [`MAX_BODY_BYTES`]).
        body: Vec<u8>,
        /// The hub's sketch cosine with the member's push (the merge header carries no
        /// embedding).
        cosine: SketchCosine,
        /// The lineage of the hub's model: a member whose model is of another lineage fetches
        /// it again (`kindred_routing::exchange::Exchange::lineage`).
        lineage: u64,
        /// The peers of the hub's view it lists, each an encoded `PeerId` (non-empty, at most
        /// [`MAX_PEER_ID_BYTES`]); at most [`MAX_KNOWN_PEERS`] of them.
        listed: Vec<Vec<u8>>,
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
    /// `Push` / `PushAnswer`.
    Push,
    /// `GetMerge` / `Merge`.
    Merge,
    /// `GetChunk` / `Chunk`.
    Chunk,
}

impl RpcKind {
    /// A short, stable label (`"headers"`, `"body"`, `"snapshot"`, `"push"`, `"merge"`,
    /// `"chunk"`) for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Self::Headers => "headers",
            Self::Body => "body",
            Self::Snapshot => "snapshot",
            Self::Push => "push",
            Self::Merge => "merge",
            Self::Chunk => "chunk",
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
    /// A peer id (in a peer list or a redirect) is empty.
    #[error("a peer id must not be empty")]
    EmptyPeerId,
    /// A `GetChunk` asks for no bytes.
    #[error("a snapshot chunk request must ask for at least one byte")]
    EmptyChunk,
}

#[derive(Serialize, Deserialize)]
enum WireRequest<'a> {
    HeadersByKeys {
        id: u64,
        keys: &'a [u8],
    },
    HeadersByIds {
        id: u64,
        ids: &'a [u8],
    },
    Body {
        id: u64,
        packet: [u8; 32],
    },
    // Appended last: postcard numbers variants in order, so the earlier encodings stay as
    // they were.
    HeadersLatest {
        id: u64,
    },
    Snapshot {
        id: u64,
    },
    /// Followed by `count` postcard byte strings (the `known` peers). Its tag is
    /// [`PUSH_TAG`].
    Push {
        id: u64,
        round: u64,
        header: &'a [u8],
        body: &'a [u8],
        count: u32,
    },
    GetMerge {
        id: u64,
        round: u64,
    },
    Chunk {
        id: u64,
        hash: [u8; 32],
        offset: u64,
        len: u32,
    },
}

/// The first byte of an encoded [`RpcRequest::Push`] (the postcard tag of its variant):
/// [`RpcRequest::decode`], and a transport reading a frame over [`MAX_REQUEST_BYTES`], read it
/// first to pick the size limit.
pub const PUSH_TAG: u8 = 5;

#[derive(Serialize, Deserialize)]
enum WireErrorCode {
    NotFound,
    Refused,
}

#[derive(Serialize, Deserialize)]
enum WirePushAnswer<'a> {
    Accepted,
    NotHub { hub: &'a [u8] },
    Busy,
    Late,
    Refused { foreign: bool },
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
    PushAnswer {
        id: u64,
        answer: WirePushAnswer<'a>,
    },
    /// Followed by `count` postcard byte strings (the `listed` peers).
    Merge {
        id: u64,
        header: &'a [u8],
        body: &'a [u8],
        cosine: i16,
        lineage: u64,
        count: u32,
    },
    SnapshotHeader {
        id: u64,
        header: &'a [u8],
    },
    Chunk {
        id: u64,
        bytes: &'a [u8],
    },
    /// Followed by `count` postcard byte strings (the `listed` peers).
    MergeHeader {
        id: u64,
        header: &'a [u8],
        cosine: i16,
        lineage: u64,
        count: u32,
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

/// postcard's zigzag mapping of a signed integer before its varint.
fn zigzag(v: i16) -> u64 {
    u64::from(((v << 1) ^ (v >> 15)) as u16)
}

/// Encoded length of a postcard byte string: varint length ‖ bytes.
fn byte_string_len(bytes: &[u8]) -> usize {
    varint_len(bytes.len() as u64) + bytes.len()
}

/// Encoded length of a peer list: its count, then each entry as a byte string.
fn peer_list_len(peers: &[Vec<u8>]) -> usize {
    varint_len(peers.len() as u64) + peers.iter().map(|p| byte_string_len(p)).sum::<usize>()
}

/// The first of a packet's header and body over its limit, as `(what, len, max)`: what a
/// sender must not send and a receiver refuses.
fn packet_over_limit(header: &[u8], body: &[u8]) -> Option<(&'static str, usize, usize)> {
    if header.len() > MAX_HEADER_BYTES {
        return Some(("header", header.len(), MAX_HEADER_BYTES));
    }
    (body.len() > MAX_BODY_BYTES).then_some(("body", body.len(), MAX_BODY_BYTES))
}

/// Refuse a packet header or body that receivers would refuse.
fn check_packet(header: &[u8], body: &[u8]) -> Result<(), RpcEncodeError> {
    match packet_over_limit(header, body) {
        Some((what, len, max)) => Err(oversize_enc(what, len, max)),
        None => Ok(()),
    }
}

/// A chunk request's length: 1..=[`MAX_CHUNK_BYTES`].
fn check_chunk_len(len: u32) -> Result<(), ()> {
    if len == 0 || len as usize > MAX_CHUNK_BYTES {
        return Err(());
    }
    Ok(())
}

/// Refuse a peer id that receivers would refuse: empty, or longer than [`MAX_PEER_ID_BYTES`].
fn check_peer_id(peer: &[u8]) -> Result<(), RpcEncodeError> {
    if peer.is_empty() {
        return Err(RpcEncodeError::EmptyPeerId);
    }
    if peer.len() > MAX_PEER_ID_BYTES {
        return Err(oversize_enc("peer id", peer.len(), MAX_PEER_ID_BYTES));
    }
    Ok(())
}

/// Refuse a peer list that receivers would refuse; its count for the wire otherwise.
fn check_peer_list(what: &'static str, peers: &[Vec<u8>]) -> Result<u32, RpcEncodeError> {
    if peers.len() > MAX_KNOWN_PEERS {
        return Err(oversize_enc(what, peers.len(), MAX_KNOWN_PEERS));
    }
    peers.iter().try_for_each(|p| check_peer_id(p))?;
    // At most MAX_KNOWN_PEERS, so it fits.
    Ok(peers.len() as u32)
}

/// Append each entry as a postcard byte string.
fn write_byte_strings(mut out: Vec<u8>, list: &[Vec<u8>]) -> Vec<u8> {
    for entry in list {
        out = postcard::to_extend(&entry.as_slice(), out).unwrap_or_default();
    }
    out
}

/// A received peer id, checked before it is copied.
fn read_peer_id(peer: &[u8]) -> Result<Vec<u8>, RpcDecodeError> {
    if peer.is_empty() {
        return Err(RpcDecodeError::Malformed {
            detail: "empty peer id",
        });
    }
    if peer.len() > MAX_PEER_ID_BYTES {
        return Err(oversize_dec("peer id", peer.len(), MAX_PEER_ID_BYTES));
    }
    Ok(peer.to_vec())
}

/// Read a peer list of `count` byte strings off the front of `rest`, checking the count before
/// allocating and each entry before copying it; returns the list and the bytes after it.
fn read_peer_list<'a>(
    what: &'static str,
    count: u32,
    mut rest: &'a [u8],
) -> Result<(Vec<Vec<u8>>, &'a [u8]), RpcDecodeError> {
    let count = count as usize;
    if count > MAX_KNOWN_PEERS {
        return Err(oversize_dec(what, count, MAX_KNOWN_PEERS));
    }
    // Every entry takes at least two bytes (its length and a non-empty id): a count the
    // remaining bytes cannot hold is rejected before the list is allocated.
    if rest.len() / 2 < count {
        return Err(RpcDecodeError::Truncated);
    }
    let mut peers = Vec::with_capacity(count);
    for _ in 0..count {
        let (peer, tail) = postcard::take_from_bytes::<&[u8]>(rest).map_err(postcard_error)?;
        peers.push(read_peer_id(peer)?);
        rest = tail;
    }
    Ok((peers, rest))
}

/// What a merge's answer carries besides the merge: the hub's cosine (checked in range) and its
/// listed peers, read off the front of `rest`; returns them and the bytes after.
type MergeAnswer<'a> = (SketchCosine, Vec<Vec<u8>>, &'a [u8]);

fn read_merge_answer(
    cosine: i16,
    count: u32,
    rest: &[u8],
) -> Result<MergeAnswer<'_>, RpcDecodeError> {
    let cosine = SketchCosine::from_permyriad(cosine).ok_or(RpcDecodeError::Malformed {
        detail: "cosine out of range",
    })?;
    let (listed, rest) = read_peer_list("listed peer list", count, rest)?;
    Ok((cosine, listed, rest))
}

/// Check a received packet header and body against their limits (before copying them).
fn check_received_packet(header: &[u8], body: &[u8]) -> Result<(), RpcDecodeError> {
    match packet_over_limit(header, body) {
        Some((what, len, max)) => Err(oversize_dec(what, len, max)),
        None => Ok(()),
    }
}

impl RpcRequest {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        match self {
            Self::GetHeaders { id, .. }
            | Self::GetBody { id, .. }
            | Self::GetSnapshot { id }
            | Self::GetChunk { id, .. }
            | Self::Push { id, .. }
            | Self::GetMerge { id, .. } => *id,
        }
    }

    /// Which exchange this request starts.
    pub fn kind(&self) -> RpcKind {
        match self {
            Self::GetHeaders { .. } => RpcKind::Headers,
            Self::GetBody { .. } => RpcKind::Body,
            Self::GetSnapshot { .. } => RpcKind::Snapshot,
            Self::Push { .. } => RpcKind::Push,
            Self::GetMerge { .. } => RpcKind::Merge,
            Self::GetChunk { .. } => RpcKind::Chunk,
        }
    }

    /// The largest response a requester should accept for this request (bytes).
    pub fn response_limit(&self) -> usize {
        match self.kind() {
            RpcKind::Headers => MAX_HEADERS_RESPONSE_BYTES,
            RpcKind::Body => MAX_BODY_RESPONSE_BYTES,
            RpcKind::Snapshot => MAX_SNAPSHOT_RESPONSE_BYTES,
            RpcKind::Push => MAX_PUSH_ANSWER_BYTES,
            RpcKind::Merge => MAX_MERGE_RESPONSE_BYTES,
            RpcKind::Chunk => MAX_CHUNK_RESPONSE_BYTES,
        }
    }

    /// Length of [`RpcRequest::encode`]'s output, computed without encoding (for a request
    /// `encode` refuses, the length it would have). Cheap: it walks a push's peer list, never
    /// its bytes.
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
            Self::Push {
                id,
                round,
                header,
                body,
                known,
            } => {
                1 + varint_len(id.0)
                    + varint_len(*round)
                    + byte_string_len(header)
                    + byte_string_len(body)
                    + peer_list_len(known)
            }
            Self::GetMerge { id, round } => 1 + varint_len(id.0) + varint_len(*round),
            Self::GetChunk {
                id, offset, len, ..
            } => 1 + varint_len(id.0) + KEY_LEN + varint_len(*offset) + varint_len(u64::from(*len)),
        }
    }

    /// Refuse what receivers would refuse.
    fn check(&self) -> Result<(), RpcEncodeError> {
        match self {
            Self::GetHeaders { query, .. } => {
                if query.is_empty() {
                    return Err(RpcEncodeError::EmptyQuery);
                }
                if query.len() > MAX_QUERY_ITEMS {
                    return Err(oversize_enc("query", query.len(), MAX_QUERY_ITEMS));
                }
                Ok(())
            }
            Self::Push {
                header,
                body,
                known,
                ..
            } => {
                check_packet(header, body)?;
                check_peer_list("known peer list", known).map(drop)
            }
            Self::GetChunk { len: 0, .. } => Err(RpcEncodeError::EmptyChunk),
            Self::GetChunk { len, .. } => check_chunk_len(*len)
                .map_err(|()| oversize_enc("chunk", *len as usize, MAX_CHUNK_BYTES)),
            Self::GetBody { .. } | Self::GetSnapshot { .. } | Self::GetMerge { .. } => Ok(()),
        }
    }

    /// Encode the request.
    ///
    /// # Errors
    /// [`RpcEncodeError`] when receivers would reject the request: a query that is empty or
    /// names more than [`MAX_QUERY_ITEMS`] items; a push whose header is over
    /// [`MAX_HEADER_BYTES`], whose body is over [`MAX_BODY_BYTES`], or that names more than
    /// [`MAX_KNOWN_PEERS`] peers or a peer id that is empty or over [`MAX_PEER_ID_BYTES`].
    /// Nothing is allocated for a refused request.
    pub fn encode(&self) -> Result<Vec<u8>, RpcEncodeError> {
        self.check()?;
        let out = Vec::with_capacity(self.encoded_len());
        // Serialising into a Vec only fails on allocation failure, which aborts anyway.
        Ok(match self {
            Self::GetHeaders { id, query } => {
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
                postcard::to_extend(&wire, out).unwrap_or_default()
            }
            Self::GetBody { id, packet } => postcard::to_extend(
                &WireRequest::Body {
                    id: id.0,
                    packet: packet.0,
                },
                out,
            )
            .unwrap_or_default(),
            Self::GetSnapshot { id } => {
                postcard::to_extend(&WireRequest::Snapshot { id: id.0 }, out).unwrap_or_default()
            }
            Self::Push {
                id,
                round,
                header,
                body,
                known,
            } => {
                let wire = WireRequest::Push {
                    id: id.0,
                    round: *round,
                    header,
                    body,
                    // Checked against MAX_KNOWN_PEERS above.
                    count: known.len() as u32,
                };
                let out = postcard::to_extend(&wire, out).unwrap_or_default();
                write_byte_strings(out, known)
            }
            Self::GetMerge { id, round } => postcard::to_extend(
                &WireRequest::GetMerge {
                    id: id.0,
                    round: *round,
                },
                out,
            )
            .unwrap_or_default(),
            Self::GetChunk {
                id,
                body_hash,
                offset,
                len,
            } => postcard::to_extend(
                &WireRequest::Chunk {
                    id: id.0,
                    hash: *body_hash,
                    offset: *offset,
                    len: *len,
                },
                out,
            )
            .unwrap_or_default(),
        })
    }

    /// Decode a request received from a peer.
    ///
    /// Takes at most [`MAX_PUSH_REQUEST_BYTES`]; once the tag is read, anything but a push over
    /// [`MAX_REQUEST_BYTES`] is refused before the rest is parsed.
    ///
    /// # Errors
    /// The first [`RpcDecodeError`] found; nothing is allocated for a list longer than
    /// [`MAX_QUERY_ITEMS`] or [`MAX_KNOWN_PEERS`], a count the remaining bytes cannot hold, or a
    /// message over its limit.
    pub fn decode(bytes: &[u8]) -> Result<Self, RpcDecodeError> {
        if bytes.len() > MAX_PUSH_REQUEST_BYTES {
            return Err(oversize_dec("request", bytes.len(), MAX_PUSH_REQUEST_BYTES));
        }
        if bytes.len() > MAX_REQUEST_BYTES {
            // Only a push may be this long. The tag is the same varint the full parse reads.
            let tag = postcard::take_from_bytes::<u32>(bytes).map(|(tag, _)| tag);
            if tag != Ok(u32::from(PUSH_TAG)) {
                return Err(oversize_dec("request", bytes.len(), MAX_REQUEST_BYTES));
            }
        }
        let (wire, rest) =
            postcard::take_from_bytes::<WireRequest<'_>>(bytes).map_err(postcard_error)?;
        let (request, rest) = match wire {
            WireRequest::HeadersByKeys { id, keys } => (
                Self::GetHeaders {
                    id: RequestId(id),
                    query: HeaderQuery::Keys(unpack_keys(keys)?),
                },
                rest,
            ),
            WireRequest::HeadersByIds { id, ids } => (
                Self::GetHeaders {
                    id: RequestId(id),
                    query: HeaderQuery::Ids(unpack_keys(ids)?.into_iter().map(PacketId).collect()),
                },
                rest,
            ),
            WireRequest::Body { id, packet } => (
                Self::GetBody {
                    id: RequestId(id),
                    packet: PacketId(packet),
                },
                rest,
            ),
            WireRequest::HeadersLatest { id } => (
                Self::GetHeaders {
                    id: RequestId(id),
                    query: HeaderQuery::Latest,
                },
                rest,
            ),
            WireRequest::Snapshot { id } => (Self::GetSnapshot { id: RequestId(id) }, rest),
            WireRequest::Push {
                id,
                round,
                header,
                body,
                count,
            } => {
                check_received_packet(header, body)?;
                let (known, rest) = read_peer_list("known peer list", count, rest)?;
                (
                    Self::Push {
                        id: RequestId(id),
                        round,
                        header: header.to_vec(),
                        body: body.to_vec(),
                        known,
                    },
                    rest,
                )
            }
            WireRequest::GetMerge { id, round } => (
                Self::GetMerge {
                    id: RequestId(id),
                    round,
                },
                rest,
            ),
            WireRequest::Chunk {
                id,
                hash,
                offset,
                len,
            } => {
                if check_chunk_len(len).is_err() {
                    if len == 0 {
                        return Err(RpcDecodeError::Malformed {
                            detail: "empty chunk request",
                        });
                    }
                    return Err(oversize_dec("chunk", len as usize, MAX_CHUNK_BYTES));
                }
                (
                    Self::GetChunk {
                        id: RequestId(id),
                        body_hash: hash,
                        offset,
                        len,
                    },
                    rest,
                )
            }
        };
        if !rest.is_empty() {
            return Err(RpcDecodeError::TrailingBytes { extra: rest.len() });
        }
        Ok(request)
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
            | Self::Error { id, .. }
            | Self::PushAnswer { id, .. }
            | Self::Merge { id, .. }
            | Self::SnapshotHeader { id, .. }
            | Self::MergeHeader { id, .. }
            | Self::Chunk { id, .. } => *id,
        }
    }

    /// Length of [`RpcResponse::encode`]'s output, computed without encoding (for a response
    /// `encode` refuses, the length it would have). Cheap: it walks lists of byte strings,
    /// never their bytes.
    pub fn encoded_len(&self) -> usize {
        match self {
            Self::Headers { id, headers } => {
                1 + varint_len(id.0)
                    + varint_len(headers.len() as u64)
                    + headers.iter().map(|h| byte_string_len(h)).sum::<usize>()
            }
            Self::Body { id, body } => 1 + varint_len(id.0) + byte_string_len(body),
            Self::Snapshot { id, header, body } => {
                1 + varint_len(id.0) + byte_string_len(header) + byte_string_len(body)
            }
            Self::Error { id, .. } => 1 + varint_len(id.0) + 1,
            Self::SnapshotHeader { id, header } => 1 + varint_len(id.0) + byte_string_len(header),
            Self::Chunk { id, bytes } => 1 + varint_len(id.0) + byte_string_len(bytes),
            Self::MergeHeader {
                id,
                header,
                cosine,
                lineage,
                listed,
            } => {
                1 + varint_len(id.0)
                    + byte_string_len(header)
                    + varint_len(zigzag(cosine.0))
                    + varint_len(*lineage)
                    + peer_list_len(listed)
            }
            Self::PushAnswer { id, answer } => {
                let answer = match answer {
                    PushAnswer::NotHub { hub } => 1 + byte_string_len(hub),
                    PushAnswer::Refused { .. } => 2,
                    PushAnswer::Accepted | PushAnswer::Busy | PushAnswer::Late => 1,
                };
                1 + varint_len(id.0) + answer
            }
            Self::Merge {
                id,
                header,
                body,
                cosine,
                lineage,
                listed,
            } => {
                1 + varint_len(id.0)
                    + byte_string_len(header)
                    + byte_string_len(body)
                    + varint_len(zigzag(cosine.0))
                    + varint_len(*lineage)
                    + peer_list_len(listed)
            }
        }
    }

    /// Refuse what receivers would refuse.
    fn check(&self) -> Result<(), RpcEncodeError> {
        match self {
            Self::Headers { headers, .. } => {
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
                Ok(())
            }
            Self::Body { body, .. } => check_packet(&[], body),
            Self::Snapshot { header, body, .. } => check_packet(header, body),
            Self::SnapshotHeader { header, .. } => check_packet(header, &[]),
            Self::MergeHeader { header, listed, .. } => {
                check_packet(header, &[])?;
                check_peer_list("listed peer list", listed).map(drop)
            }
            Self::Chunk { bytes, .. } if bytes.len() > MAX_CHUNK_BYTES => {
                Err(oversize_enc("chunk", bytes.len(), MAX_CHUNK_BYTES))
            }
            Self::Chunk { .. } | Self::Error { .. } => Ok(()),
            Self::PushAnswer { answer, .. } => match answer {
                PushAnswer::NotHub { hub } => check_peer_id(hub),
                PushAnswer::Accepted
                | PushAnswer::Busy
                | PushAnswer::Late
                | PushAnswer::Refused { .. } => Ok(()),
            },
            Self::Merge {
                header,
                body,
                listed,
                ..
            } => {
                check_packet(header, body)?;
                check_peer_list("listed peer list", listed).map(drop)
            }
        }
    }

    /// Encode the response.
    ///
    /// # Errors
    /// [`RpcEncodeError`] when receivers would reject the response: more than
    /// [`MAX_HEADERS_PER_RESPONSE`] headers, a header longer than [`MAX_HEADER_BYTES`] or a body
    /// longer than [`MAX_BODY_BYTES`] (in a snapshot or a merge too), or a peer list (a merge's
    /// `listed`) or redirect that names more than [`MAX_KNOWN_PEERS`] peers or a peer id that is
    /// empty or over [`MAX_PEER_ID_BYTES`]. Nothing is allocated for a refused response.
    pub fn encode(&self) -> Result<Vec<u8>, RpcEncodeError> {
        self.check()?;
        let out = Vec::with_capacity(self.encoded_len());
        // Serialising into a Vec only fails on allocation failure, which aborts anyway.
        Ok(match self {
            Self::Headers { id, headers } => {
                let wire = WireResponse::Headers {
                    id: id.0,
                    // Checked against MAX_HEADERS_PER_RESPONSE above.
                    count: headers.len() as u32,
                };
                let out = postcard::to_extend(&wire, out).unwrap_or_default();
                write_byte_strings(out, headers)
            }
            Self::Body { id, body } => {
                let wire = WireResponse::Body { id: id.0, body };
                postcard::to_extend(&wire, out).unwrap_or_default()
            }
            Self::Snapshot { id, header, body } => {
                let wire = WireResponse::Snapshot {
                    id: id.0,
                    header,
                    body,
                };
                postcard::to_extend(&wire, out).unwrap_or_default()
            }
            Self::Error { id, code } => {
                let code = match code {
                    RpcErrorCode::NotFound => WireErrorCode::NotFound,
                    RpcErrorCode::Refused => WireErrorCode::Refused,
                };
                postcard::to_extend(&WireResponse::Error { id: id.0, code }, out)
                    .unwrap_or_default()
            }
            Self::PushAnswer { id, answer } => {
                let answer = match answer {
                    PushAnswer::Accepted => WirePushAnswer::Accepted,
                    PushAnswer::NotHub { hub } => WirePushAnswer::NotHub { hub },
                    PushAnswer::Busy => WirePushAnswer::Busy,
                    PushAnswer::Late => WirePushAnswer::Late,
                    PushAnswer::Refused { foreign } => {
                        WirePushAnswer::Refused { foreign: *foreign }
                    }
                };
                postcard::to_extend(&WireResponse::PushAnswer { id: id.0, answer }, out)
                    .unwrap_or_default()
            }
            Self::Merge {
                id,
                header,
                body,
                cosine,
                lineage,
                listed,
            } => {
                let wire = WireResponse::Merge {
                    id: id.0,
                    header,
                    body,
                    cosine: cosine.0,
                    lineage: *lineage,
                    // Checked against MAX_KNOWN_PEERS above.
                    count: listed.len() as u32,
                };
                let out = postcard::to_extend(&wire, out).unwrap_or_default();
                write_byte_strings(out, listed)
            }
            Self::SnapshotHeader { id, header } => {
                let wire = WireResponse::SnapshotHeader { id: id.0, header };
                postcard::to_extend(&wire, out).unwrap_or_default()
            }
            Self::Chunk { id, bytes } => {
                let wire = WireResponse::Chunk { id: id.0, bytes };
                postcard::to_extend(&wire, out).unwrap_or_default()
            }
            Self::MergeHeader {
                id,
                header,
                cosine,
                lineage,
                listed,
            } => {
                let wire = WireResponse::MergeHeader {
                    id: id.0,
                    header,
                    cosine: cosine.0,
                    lineage: *lineage,
                    // Checked against MAX_KNOWN_PEERS above.
                    count: listed.len() as u32,
                };
                let out = postcard::to_extend(&wire, out).unwrap_or_default();
                write_byte_strings(out, listed)
            }
        })
    }

    /// Decode a response received from a peer, accepting at most `limit` bytes (use
    /// [`RpcRequest::response_limit`] of the request it answers; never more than
    /// [`MAX_RESPONSE_BYTES`]).
    ///
    /// # Errors
    /// The first [`RpcDecodeError`] found. A header list is checked against
    /// [`MAX_HEADERS_PER_RESPONSE`] and each header against [`MAX_HEADER_BYTES`] before they are
    /// copied; a merge's peer list against [`MAX_KNOWN_PEERS`] and each peer id (there and in a
    /// redirect) against [`MAX_PEER_ID_BYTES`].
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
                check_received_packet(header, body)?;
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
            WireResponse::PushAnswer { id, answer } => Self::PushAnswer {
                id: RequestId(id),
                answer: match answer {
                    WirePushAnswer::Accepted => PushAnswer::Accepted,
                    WirePushAnswer::NotHub { hub } => PushAnswer::NotHub {
                        hub: read_peer_id(hub)?,
                    },
                    WirePushAnswer::Busy => PushAnswer::Busy,
                    WirePushAnswer::Late => PushAnswer::Late,
                    WirePushAnswer::Refused { foreign } => PushAnswer::Refused { foreign },
                },
            },
            WireResponse::Merge {
                id,
                header,
                body,
                cosine,
                lineage,
                count,
            } => {
                check_received_packet(header, body)?;
                let (cosine, listed, tail) = read_merge_answer(cosine, count, rest)?;
                rest = tail;
                Self::Merge {
                    id: RequestId(id),
                    header: header.to_vec(),
                    body: body.to_vec(),
                    cosine,
                    lineage,
                    listed,
                }
            }
            WireResponse::SnapshotHeader { id, header } => {
                check_received_packet(header, &[])?;
                Self::SnapshotHeader {
                    id: RequestId(id),
                    header: header.to_vec(),
                }
            }
            WireResponse::Chunk { id, bytes } => {
                if bytes.len() > MAX_CHUNK_BYTES {
                    return Err(oversize_dec("chunk", bytes.len(), MAX_CHUNK_BYTES));
                }
                Self::Chunk {
                    id: RequestId(id),
                    bytes: bytes.to_vec(),
                }
            }
            WireResponse::MergeHeader {
                id,
                header,
                cosine,
                lineage,
                count,
            } => {
                check_received_packet(header, &[])?;
                let (cosine, listed, tail) = read_merge_answer(cosine, count, rest)?;
                rest = tail;
                Self::MergeHeader {
                    id: RequestId(id),
                    header: header.to_vec(),
                    cosine,
                    lineage,
                    listed,
                }
            }
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
        for v in [0i16, 1, -1, 63, -64, 64, 8191, -8192, 8192, 10_000, -10_000] {
            assert_eq!(
                varint_len(zigzag(v)),
                postcard::to_allocvec(&v).unwrap_or_default().len(),
                "{v}"
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
    fn push_tag_is_the_push_variant() {
        let push = RpcRequest::Push {
            id: RequestId(1),
            round: 2,
            header: vec![],
            body: vec![],
            known: vec![],
        };
        let bytes = push.encode().unwrap_or_default();
        assert_eq!(bytes.first().copied(), Some(PUSH_TAG));
    }

    #[test]
    fn largest_push_and_merge_fit_their_limits() {
        let known = vec![vec![0xff; MAX_PEER_ID_BYTES]; MAX_KNOWN_PEERS];
        let mut push = RpcRequest::Push {
            id: RequestId(u64::MAX),
            round: u64::MAX,
            header: vec![0xff; MAX_HEADER_BYTES],
            body: vec![0xff; MAX_BODY_BYTES],
            known,
        };
        let bytes = push.encode().unwrap_or_default();
        assert_eq!(bytes.len(), push.encoded_len());
        assert!(bytes.len() <= MAX_PUSH_REQUEST_BYTES, "{}", bytes.len());
        assert_eq!(RpcRequest::decode(&bytes).as_ref(), Ok(&push));
        drop(bytes);
        let RpcRequest::Push {
            header,
            body,
            known,
            ..
        } = &mut push
        else {
            return;
        };
        let merge = RpcResponse::Merge {
            id: RequestId(u64::MAX),
            header: std::mem::take(header),
            body: std::mem::take(body),
            cosine: SketchCosine::from_f32(-1.0),
            lineage: u64::MAX,
            listed: std::mem::take(known),
        };
        let bytes = merge.encode().unwrap_or_default();
        assert_eq!(bytes.len(), merge.encoded_len());
        assert!(bytes.len() <= MAX_MERGE_RESPONSE_BYTES, "{}", bytes.len());
        assert_eq!(
            RpcResponse::decode(&bytes, MAX_MERGE_RESPONSE_BYTES).as_ref(),
            Ok(&merge)
        );
    }

    #[test]
    fn largest_push_answer_fits_the_limit() {
        let answer = RpcResponse::PushAnswer {
            id: RequestId(u64::MAX),
            answer: PushAnswer::NotHub {
                hub: vec![0xff; MAX_PEER_ID_BYTES],
            },
        };
        assert!(answer.encoded_len() <= MAX_PUSH_ANSWER_BYTES);
        let error = RpcResponse::Error {
            id: RequestId(u64::MAX),
            code: RpcErrorCode::Refused,
        };
        assert!(error.encoded_len() <= MAX_PUSH_ANSWER_BYTES);
    }

    #[test]
    fn response_limit_is_the_largest_of_all() {
        for limit in [
            MAX_HEADERS_RESPONSE_BYTES,
            MAX_BODY_RESPONSE_BYTES,
            MAX_SNAPSHOT_RESPONSE_BYTES,
            MAX_PUSH_ANSWER_BYTES,
            MAX_MERGE_RESPONSE_BYTES,
        ] {
            assert!(limit <= MAX_RESPONSE_BYTES);
        }
        assert_eq!(MAX_RESPONSE_BYTES, MAX_MERGE_RESPONSE_BYTES);
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
