//! Kindred's wire types: the signed **outcome packet** every other crate exchanges.
//!
//! A node distills each model update into an [`OutcomePacket`]-shaped pair of byte strings:
//!
//! - a small signed **header** ([`PacketHeader`]): model id, round, sender, loss, sample count,
//!   the update's [`Embedding`], the body's length and blake3 hash, and a compression summary;
//! - a **body** ([`PacketBody`]): one [`LayerPayload`] per layer in model order, each dense
//!   (f32/f16/bf16, or int8 with one scale), top-k (delta-coded indices; int8 values with one
//!   scale, or 4-bit log-spaced ones, [`TopK4`]) or 1-bit signs.
//!
//! Peers fetch headers first and bodies only for the few packets they will merge, so the header
//! alone must be verifiable: it is signed with the sender's libp2p ed25519 identity, names the
//! sender's `PeerId`, and commits to the body. A packet is identified by [`PacketId`], the blake3
//! hash of its encoded header.
//!
//! Everything here is pure: no I/O, no libp2p swarm. Decoders ([`decode_header`],
//! [`decode_body`]) treat their input as hostile: they compare every length against the limits
//! in [`limits`] before allocating, validate every field, and return a [`DecodeError`] naming the
//! exact cause. [`seal`] runs the same decoders on what it produces, so a node never sends a packet
//! its peers would reject.
//!
//! ```
//! use kindred_proto::*;
//! use libp2p_identity::ed25519;
//!
//! let key = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([9u8; 32]).unwrap());
//! let spec = ModelSpec::new(vec![
//!     LayerSpec::new("fc.weight", [10, 784], DType::F32),
//!     LayerSpec::new("fc.bias", [10], DType::F32),
//! ])?;
//! let body = PacketBody {
//!     layers: vec![
//!         LayerPayload::TopK(TopK { len: 7840, indices: vec![3, 70, 7000], values: vec![127, -64, 5], scale: 0.01 }),
//!         LayerPayload::Dense(DenseValues::F16(vec![half::f16::from_f32(0.25); 10])),
//!     ],
//! };
//! let fields = HeaderFields { round: 1, unix_ms: 0, samples: 600, loss: 0.4, embedding: Embedding::default() };
//! let sealed = seal(&key, &spec, fields, &body)?;
//!
//! // A receiver: header first, then the body it decides to fetch.
//! let header = decode_header(&sealed.header_bytes)?;
//! let received = decode_body(header.header(), &spec, &sealed.body_bytes)?;
//! assert_eq!(received, body);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(clippy::indexing_slicing)]

mod codec;
mod error;
mod header;
mod identity;
pub mod limits;
mod payload;
pub mod rpc;
mod spec;
mod varint;

pub use codec::{
    BodyEncoder, EncodedBody, HeaderFields, SealedPacket, check_body, decode_body, decode_header,
    decode_merge_header, decode_snapshot_header, encode_body, encode_header, encode_merge_header,
    encode_snapshot_header, encoded_layer_len, seal, seal_merge, seal_snapshot,
    seal_snapshot_encoded,
};
pub use error::{DecodeError, Part, SealError, SpecError};
pub use header::{BodyHash, Embedding, PacketHeader, PacketId, SimHash, VerifiedHeader};
pub use identity::{IdentityError, check_peer, check_public_key};
pub use limits::*;
pub use payload::{
    CompressionSummary, DenseValues, LayerPayload, PacketBody, PayloadKind, SignBits, TopK, TopK4,
};
pub use rpc::{HeaderQuery, RequestId, RpcDecodeError, RpcRequest, RpcResponse};
pub use spec::{DType, LayerSpec, ModelId, ModelSpec};

/// A whole outcome packet in decoded form: a verified header and the body it commits to.
///
/// Nodes handle the two halves separately (headers are fetched long before, and far more often
/// than, bodies); this pairs them once both are in hand.
#[derive(Debug, Clone, PartialEq)]
pub struct OutcomePacket {
    /// The verified header.
    pub header: VerifiedHeader,
    /// The body, decoded against the local model spec.
    pub body: PacketBody,
}

impl OutcomePacket {
    /// Decode and verify both halves of a packet received from a peer.
    ///
    /// # Errors
    /// The first [`DecodeError`] of [`decode_header`] or [`decode_body`].
    pub fn decode(
        header_bytes: &[u8],
        body_bytes: &[u8],
        spec: &ModelSpec,
    ) -> Result<Self, DecodeError> {
        let header = decode_header(header_bytes)?;
        let body = decode_body(header.header(), spec, body_bytes)?;
        Ok(Self { header, body })
    }

    /// Decode and verify both halves of a model snapshot ([`seal_snapshot`]) received from a
    /// peer.
    ///
    /// # Errors
    /// The first [`DecodeError`] of [`decode_snapshot_header`] or [`decode_body`].
    pub fn decode_snapshot(
        header_bytes: &[u8],
        body_bytes: &[u8],
        spec: &ModelSpec,
    ) -> Result<Self, DecodeError> {
        let header = decode_snapshot_header(header_bytes)?;
        let body = decode_body(header.header(), spec, body_bytes)?;
        Ok(Self { header, body })
    }

    /// Decode and verify both halves of a hub's merge ([`seal_merge`]) received from the hub.
    ///
    /// # Errors
    /// The first [`DecodeError`] of [`decode_merge_header`] or [`decode_body`].
    pub fn decode_merge(
        header_bytes: &[u8],
        body_bytes: &[u8],
        spec: &ModelSpec,
    ) -> Result<Self, DecodeError> {
        let header = decode_merge_header(header_bytes)?;
        let body = decode_body(header.header(), spec, body_bytes)?;
        Ok(Self { header, body })
    }

    /// The packet's id.
    pub fn id(&self) -> PacketId {
        self.header.id()
    }
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
