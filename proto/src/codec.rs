//! The v1 wire encoding: postcard structures over borrowed byte slices.
//!
//! Decoding happens in two steps. First postcard parses the structure into wire types that only
//! *borrow* the input ([`WireHeader`], [`WireLayer`]): no field can make the decoder allocate,
//! because every variable-length field is a slice whose length postcard checks against the bytes
//! actually present. Then each wire value is validated and converted into its owned domain type,
//! allocating only lengths that are already checked against [`crate::limits`] and the local
//! [`ModelSpec`]. The same decoders back [`seal`], so a node cannot send what its peers reject.
//!
//! Layout of a signed header: `postcard(WireHeader) ‖ postcard(WireSeal)`; the signature covers
//! `domain ‖ postcard(WireHeader)` exactly as received. The domain says what the header seals: an
//! outcome packet (an update, [`seal`]), a model snapshot ([`seal_snapshot`]) or a hub's merge
//! ([`seal_merge`]). All have the same layout, but a signature made for one never verifies as
//! another, so a peer cannot pass off a node's snapshot or merge as one of its updates. A body is `varint(layer count) ‖
//! postcard(WireLayer)*`, byte-identical to postcard's encoding of a `Vec<WireLayer>`.
//!
//! Only canonical encodings are accepted (every varint and length prefix in its shortest form,
//! inside and outside the signed part; [`DecodeError::NonCanonical`] otherwise), and signatures
//! are verified strictly (no small-order key or R, canonical S and point encodings; see
//! [`crate::check_peer`]). So an accepted header has exactly one byte form and one [`PacketId`]:
//! a third party can neither forge a signature nor re-encode a real one under a new id.

use std::borrow::Cow;

use half::{bf16, f16};
use libp2p_identity::{PeerId, PublicKey, ed25519};
use serde::{Deserialize, Serialize};

use crate::error::{DecodeError, Part, SealError};
use crate::header::{Embedding, PacketHeader, PacketId, SimHash, VerifiedHeader};
use crate::identity::{
    IdentityError, PUBLIC_KEY_LEN, SIGNATURE_LEN, peer_id_bytes, strict_key, verify_strict,
};
use crate::limits::{
    FORMAT_VERSION, MAX_ABS_LOSS, MAX_HEADER_BYTES, MAX_LAYER_ELEMS, MAX_LAYERS, MAX_PEER_ID_BYTES,
    MAX_PIECED_BODY_BYTES, MAX_SAMPLES, MAX_SKETCH_LEN,
};
use crate::payload::{
    CompressionSummary, DenseValues, LayerPayload, PacketBody, SignBits, TopK, TopK4,
};
use crate::spec::{DType, LayerSpec, ModelId, ModelSpec};
use crate::varint;

/// What a signature covers, prefixed to every signed message: a packet signature can never be
/// replayed as a signature of another libp2p structure made with the same identity key, nor a
/// snapshot's as a packet's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Domain {
    /// An outcome packet: one round's distilled update.
    Packet,
    /// A model snapshot: a node's cumulative update, served on request.
    Snapshot,
    /// A hub's merge of its cohort's pushes for one round, served to its members.
    Merge,
}

impl Domain {
    fn prefix(self) -> &'static [u8] {
        match self {
            Self::Packet => b"kindred/packet-header/v1\0",
            Self::Snapshot => b"kindred/snapshot-header/v1\0",
            Self::Merge => b"kindred/merge-header/v1\0",
        }
    }
}

#[derive(Serialize, Deserialize)]
struct WireHeader<'a> {
    version: u16,
    model: [u8; 32],
    round: u64,
    sender: &'a [u8],
    unix_ms: u64,
    samples: u64,
    loss: f32,
    simhash: [u8; 32],
    sketch: &'a [u8],
    sketch_scale: f32,
    body_len: u32,
    body_hash: [u8; 32],
    dense_layers: u16,
    topk_layers: u16,
    sign_layers: u16,
    params: u64,
    carried: u64,
}

#[derive(Serialize, Deserialize)]
struct WireSeal<'a> {
    public_key: &'a [u8],
    signature: &'a [u8],
}

#[derive(Serialize, Deserialize)]
enum WireDtype {
    F32,
    F16,
    BF16,
}

#[derive(Serialize, Deserialize)]
enum WireLayer<'a> {
    Dense {
        dtype: WireDtype,
        bytes: &'a [u8],
    },
    TopK {
        len: u32,
        count: u32,
        index_deltas: &'a [u8],
        values: &'a [u8],
        scale: f32,
    },
    Sign {
        len: u32,
        words: &'a [u8],
        scale: f32,
    },
    // Appended, so that the variants before each keep their wire indices.
    DenseInt8 {
        values: &'a [u8],
        scale: f32,
    },
    TopK4 {
        len: u32,
        count: u32,
        index_deltas: &'a [u8],
        codes: &'a [u8],
        scale: f32,
        ratio: f32,
    },
}

/// Header fields the caller chooses when sealing a packet; the rest (model, sender, body length,
/// hash and compression summary) are derived.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderFields {
    /// The sender's training round.
    pub round: u64,
    /// Creation time, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// Training samples behind the update.
    pub samples: u64,
    /// Local training loss: finite.
    pub loss: f32,
    /// The update's embedding.
    pub embedding: Embedding,
}

/// A packet ready to store and serve: validated, signed and encoded.
#[derive(Debug, Clone, PartialEq)]
pub struct SealedPacket {
    /// The signed header, as peers will see it after verification.
    pub header: VerifiedHeader,
    /// The encoded, signed header.
    pub header_bytes: Vec<u8>,
    /// The encoded body.
    pub body_bytes: Vec<u8>,
}

impl SealedPacket {
    /// The packet's id.
    pub fn id(&self) -> PacketId {
        self.header.id()
    }
}

/// Encode, sign and validate an outcome packet.
///
/// The body is checked against `spec` and the header fields against the protocol limits with the
/// very decoders receivers run, so the result is a packet every honest peer accepts.
///
/// ```
/// use kindred_proto::*;
/// use libp2p_identity::ed25519;
///
/// let key = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([1u8; 32]).unwrap());
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])?;
/// let body = PacketBody { layers: vec![LayerPayload::Dense(DenseValues::F32(vec![0.5; 4]))] };
/// let fields = HeaderFields { round: 3, unix_ms: 0, samples: 32, loss: 0.7, embedding: Embedding::default() };
/// let packet = seal(&key, &spec, fields, &body)?;
///
/// let header = decode_header(&packet.header_bytes)?;
/// assert_eq!(header.id(), packet.id());
/// assert_eq!(decode_body(header.header(), &spec, &packet.body_bytes)?, body);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`SealError::Invalid`] with the reason a receiver would give for rejecting the packet.
pub fn seal(
    keypair: &ed25519::Keypair,
    spec: &ModelSpec,
    fields: HeaderFields,
    body: &PacketBody,
) -> Result<SealedPacket, SealError> {
    seal_in(Domain::Packet, keypair, spec, fields, body)
}

/// Encode, sign and validate a model snapshot: a body holding a node's whole cumulative update
/// (see `kindred_distill::snapshot`), served to peers that ask for it.
///
/// Same layout and checks as [`seal`], signed under the snapshot domain: verify it with
/// [`decode_snapshot_header`]; [`decode_header`] rejects it, as `decode_snapshot_header` rejects
/// a packet.
///
/// ```
/// use kindred_proto::*;
/// use libp2p_identity::ed25519;
///
/// let key = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([1u8; 32]).unwrap());
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])?;
/// let body = PacketBody { layers: vec![LayerPayload::Dense(DenseValues::F16(vec![half::f16::ONE; 4]))] };
/// let fields = HeaderFields { round: 3, unix_ms: 0, samples: 0, loss: 0.0, embedding: Embedding::default() };
/// let snapshot = seal_snapshot(&key, &spec, fields, &body)?;
///
/// let header = decode_snapshot_header(&snapshot.header_bytes)?;
/// assert_eq!(decode_body(header.header(), &spec, &snapshot.body_bytes)?, body);
/// assert_eq!(decode_header(&snapshot.header_bytes), Err(DecodeError::BadSignature));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`SealError::Invalid`] with the reason a receiver would give for rejecting the snapshot.
pub fn seal_snapshot(
    keypair: &ed25519::Keypair,
    spec: &ModelSpec,
    fields: HeaderFields,
    body: &PacketBody,
) -> Result<SealedPacket, SealError> {
    seal_in(Domain::Snapshot, keypair, spec, fields, body)
}

/// [`seal_snapshot`] of a body already encoded a layer at a time ([`BodyEncoder`]): what a node
/// seals its whole model with, so that neither the layers nor a second copy of the bytes are
/// ever held beside the encoded body. Validated as [`seal_snapshot`] validates.
///
/// ```
/// use kindred_proto::*;
/// use libp2p_identity::ed25519;
///
/// let key = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([1u8; 32]).unwrap());
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])?;
/// let layer = LayerPayload::Dense(DenseValues::Int8 { values: vec![1, -2, 3, 0], scale: 0.5 });
/// let mut encoder = BodyEncoder::new(1, 16);
/// encoder.push(&layer);
/// let fields = HeaderFields { round: 3, unix_ms: 0, samples: 0, loss: 0.0, embedding: Embedding::default() };
/// let snapshot = seal_snapshot_encoded(&key, &spec, fields, encoder.finish())?;
///
/// let header = decode_snapshot_header(&snapshot.header_bytes)?;
/// assert_eq!(decode_body(header.header(), &spec, &snapshot.body_bytes)?.layers, [layer]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`SealError::Invalid`] with the reason a receiver would give for rejecting the snapshot
/// (a layer count unlike the spec's among them).
pub fn seal_snapshot_encoded(
    keypair: &ed25519::Keypair,
    spec: &ModelSpec,
    fields: HeaderFields,
    body: EncodedBody,
) -> Result<SealedPacket, SealError> {
    seal_encoded(Domain::Snapshot, keypair, spec, fields, body)
}

/// Encode, sign and validate a hub's merge of round `fields.round`: the update it serves its
/// cohort's members for that round.
///
/// Same layout and checks as [`seal`], signed under the merge domain: verify it with
/// [`decode_merge_header`]. A merge never passes for an update of the hub's own (nor a
/// snapshot), and the round and sender it is bound to are signed, so a member checks that the
/// merge is of the round it pushed for and from the hub it pushed to: an old merge cannot be
/// replayed into a later round, nor one hub's merge served as another's.
///
/// ```
/// use kindred_proto::*;
/// use libp2p_identity::ed25519;
///
/// let key = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([1u8; 32]).unwrap());
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])?;
/// let body = PacketBody { layers: vec![LayerPayload::Dense(DenseValues::F32(vec![0.5; 4]))] };
/// let fields = HeaderFields { round: 3, unix_ms: 0, samples: 96, loss: 0.7, embedding: Embedding::default() };
/// let merge = seal_merge(&key, &spec, fields, &body)?;
///
/// let header = decode_merge_header(&merge.header_bytes)?;
/// assert_eq!(header.header().round, 3);
/// assert_eq!(decode_header(&merge.header_bytes), Err(DecodeError::BadSignature));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`SealError::Invalid`] with the reason a receiver would give for rejecting the merge.
pub fn seal_merge(
    keypair: &ed25519::Keypair,
    spec: &ModelSpec,
    fields: HeaderFields,
    body: &PacketBody,
) -> Result<SealedPacket, SealError> {
    seal_in(Domain::Merge, keypair, spec, fields, body)
}

fn seal_in(
    domain: Domain,
    keypair: &ed25519::Keypair,
    spec: &ModelSpec,
    fields: HeaderFields,
    body: &PacketBody,
) -> Result<SealedPacket, SealError> {
    seal_encoded(domain, keypair, spec, fields, encode(body))
}

fn seal_encoded(
    domain: Domain,
    keypair: &ed25519::Keypair,
    spec: &ModelSpec,
    fields: HeaderFields,
    body: EncodedBody,
) -> Result<SealedPacket, SealError> {
    let EncodedBody {
        bytes: body_bytes,
        compression,
    } = body;
    let oversize = || DecodeError::Oversize {
        what: "body",
        len: body_bytes.len() as u64,
        max: MAX_PIECED_BODY_BYTES as u64,
    };
    if body_bytes.len() > MAX_PIECED_BODY_BYTES {
        return Err(oversize().into());
    }
    let body_len = u32::try_from(body_bytes.len()).map_err(|_| oversize())?;
    let header = PacketHeader {
        model: spec.id(),
        round: fields.round,
        sender: PublicKey::from(keypair.public()).to_peer_id(),
        unix_ms: fields.unix_ms,
        samples: fields.samples,
        loss: fields.loss,
        embedding: fields.embedding,
        body_len,
        body_hash: *blake3::hash(&body_bytes).as_bytes(),
        compression,
    };
    let header_bytes = encode_header_in(domain, &header, keypair);
    let verified = decode_header_in(domain, &header_bytes)?;
    // Checked as a receiver decodes it, a layer at a time: the body is never held twice.
    check_body(verified.header(), spec, &body_bytes)?;
    Ok(SealedPacket {
        header: verified,
        header_bytes,
        body_bytes,
    })
}

/// Encode and sign a header as-is, without validating it.
///
/// Most callers want [`seal`]. This is the raw encoder, public so that tests and tools can build
/// packets that receivers must reject.
pub fn encode_header(header: &PacketHeader, keypair: &ed25519::Keypair) -> Vec<u8> {
    encode_header_in(Domain::Packet, header, keypair)
}

/// [`encode_header`] under the snapshot domain ([`seal_snapshot`]'s raw encoder).
pub fn encode_snapshot_header(header: &PacketHeader, keypair: &ed25519::Keypair) -> Vec<u8> {
    encode_header_in(Domain::Snapshot, header, keypair)
}

/// [`encode_header`] under the merge domain ([`seal_merge`]'s raw encoder).
pub fn encode_merge_header(header: &PacketHeader, keypair: &ed25519::Keypair) -> Vec<u8> {
    encode_header_in(Domain::Merge, header, keypair)
}

fn encode_header_in(domain: Domain, header: &PacketHeader, keypair: &ed25519::Keypair) -> Vec<u8> {
    let out = encode_unsigned(header);
    let signature = keypair.sign(&signing_message(domain, &out));
    append_seal(out, &keypair.public().to_bytes(), &signature)
}

/// A header with a given seal: the inverse of [`decode_header`] for a [`VerifiedHeader`].
pub(crate) fn encode_sealed(header: &PacketHeader, public_key: &[u8], signature: &[u8]) -> Vec<u8> {
    append_seal(encode_unsigned(header), public_key, signature)
}

fn append_seal(out: Vec<u8>, public_key: &[u8], signature: &[u8]) -> Vec<u8> {
    postcard::to_extend(
        &WireSeal {
            public_key,
            signature,
        },
        out,
    )
    .unwrap_or_default()
}

/// The signed part of a header: `postcard(WireHeader)`.
fn encode_unsigned(header: &PacketHeader) -> Vec<u8> {
    let sender = header.sender.to_bytes();
    let sketch: &[u8] = bytemuck::cast_slice(&header.embedding.sketch);
    let wire = WireHeader {
        version: FORMAT_VERSION,
        model: header.model.0,
        round: header.round,
        sender: &sender,
        unix_ms: header.unix_ms,
        samples: header.samples,
        loss: header.loss,
        simhash: header.embedding.simhash.0,
        sketch,
        sketch_scale: header.embedding.sketch_scale,
        body_len: header.body_len,
        body_hash: header.body_hash,
        dense_layers: header.compression.dense_layers,
        topk_layers: header.compression.topk_layers,
        sign_layers: header.compression.sign_layers,
        params: header.compression.params,
        carried: header.compression.carried,
    };
    let out = Vec::with_capacity(256 + SEAL_LEN + sketch.len());
    // Serialising into a Vec only fails on allocation failure, which aborts anyway.
    postcard::to_extend(&wire, out).unwrap_or_default()
}

fn signing_message(domain: Domain, header: &[u8]) -> Vec<u8> {
    let prefix = domain.prefix();
    let mut msg = Vec::with_capacity(prefix.len() + header.len());
    msg.extend_from_slice(prefix);
    msg.extend_from_slice(header);
    msg
}

/// Decode and verify a signed header received from a peer.
///
/// Checks, in order: size limit, format version, structure, that the bytes are the canonical
/// encoding (no overlong varint or length prefix, inside or outside the signed part), every
/// field's range (including [`crate::MAX_SAMPLES`] and [`crate::MAX_ABS_LOSS`]), that the
/// signing key is a strict identity (canonical, not of small order: see [`crate::check_peer`])
/// belonging to the named sender, and the signature under strict verification.
///
/// # Errors
/// The first [`DecodeError`] found; nothing is allocated beyond [`MAX_HEADER_BYTES`].
pub fn decode_header(bytes: &[u8]) -> Result<VerifiedHeader, DecodeError> {
    decode_header_in(Domain::Packet, bytes)
}

/// Decode and verify the signed header of a model snapshot ([`seal_snapshot`]).
///
/// The same checks as [`decode_header`], against the snapshot signing domain: a packet header
/// fails here with [`DecodeError::BadSignature`].
///
/// # Errors
/// The first [`DecodeError`] found; nothing is allocated beyond [`MAX_HEADER_BYTES`].
pub fn decode_snapshot_header(bytes: &[u8]) -> Result<VerifiedHeader, DecodeError> {
    decode_header_in(Domain::Snapshot, bytes)
}

/// Decode and verify the signed header of a hub's merge ([`seal_merge`]).
///
/// The same checks as [`decode_header`], against the merge signing domain: a packet or snapshot
/// header fails here with [`DecodeError::BadSignature`].
///
/// # Errors
/// The first [`DecodeError`] found; nothing is allocated beyond [`MAX_HEADER_BYTES`].
pub fn decode_merge_header(bytes: &[u8]) -> Result<VerifiedHeader, DecodeError> {
    decode_header_in(Domain::Merge, bytes)
}

fn decode_header_in(domain: Domain, bytes: &[u8]) -> Result<VerifiedHeader, DecodeError> {
    if bytes.len() > MAX_HEADER_BYTES {
        return Err(DecodeError::Oversize {
            what: "header",
            len: bytes.len() as u64,
            max: MAX_HEADER_BYTES as u64,
        });
    }
    let (version, _) = varint::decode_u16(bytes).map_err(|e| e.at(Part::Header))?;
    if version != FORMAT_VERSION {
        return Err(DecodeError::UnknownVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let (wire, rest) = postcard::take_from_bytes::<WireHeader<'_>>(bytes)
        .map_err(|e| postcard_error(e, Part::Header))?;
    let signed = bytes
        .get(..bytes.len() - rest.len())
        .ok_or(DecodeError::Truncated { part: Part::Header })?;
    let seal_bytes = rest;
    let (seal, rest) = postcard::take_from_bytes::<WireSeal<'_>>(seal_bytes)
        .map_err(|e| postcard_error(e, Part::Header))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            part: Part::Header,
            extra: rest.len(),
        });
    }
    check_canonical_header(&wire, signed)?;
    let header = header_from_wire(&wire)?;

    if seal.public_key.len() != PUBLIC_KEY_LEN {
        return Err(DecodeError::InvalidPublicKey);
    }
    if seal.signature.len() != SIGNATURE_LEN {
        return Err(DecodeError::BadSignature);
    }
    // Both lengths fit one varint byte: anything longer is an overlong prefix outside the signed
    // bytes, which would give the same signed header another packet id.
    if seal_bytes.len() != SEAL_LEN {
        return Err(DecodeError::NonCanonical {
            part: Part::Header,
            detail: "seal length prefix",
        });
    }
    let key = strict_key(seal.public_key).map_err(|e| match e {
        IdentityError::Weak => DecodeError::WeakPublicKey,
        IdentityError::NonCanonical => DecodeError::NonCanonical {
            part: Part::Header,
            detail: "public key point encoding",
        },
        _ => DecodeError::InvalidPublicKey,
    })?;
    let signer = peer_id_bytes(key.as_bytes());
    if wire.sender != signer {
        return Err(DecodeError::SenderMismatch {
            claimed: Box::new(header.sender),
            actual: Box::new(
                PeerId::from_bytes(&signer).map_err(|_| DecodeError::InvalidPublicKey)?,
            ),
        });
    }
    if !verify_strict(&key, &signing_message(domain, signed), seal.signature) {
        return Err(DecodeError::BadSignature);
    }
    let mut public_key = [0u8; PUBLIC_KEY_LEN];
    public_key.copy_from_slice(seal.public_key);
    let mut signature = [0u8; SIGNATURE_LEN];
    signature.copy_from_slice(seal.signature);
    Ok(VerifiedHeader::new(
        header,
        PacketId::of_header_bytes(bytes),
        public_key,
        signature,
    ))
}

/// Bytes of an encoded [`WireSeal`]: two one-byte length prefixes, the key and the signature.
const SEAL_LEN: usize = 1 + PUBLIC_KEY_LEN + 1 + SIGNATURE_LEN;

/// The signed bytes must be postcard's one encoding of what they decode to. postcard accepts
/// overlong varints (a length prefix or an integer padded with `0x80 … 0x00`), so the same
/// content could be signed in several forms with several packet ids; re-encoding (at most
/// [`MAX_HEADER_BYTES`], on the stack) and comparing catches every such form at once.
fn check_canonical_header(wire: &WireHeader<'_>, signed: &[u8]) -> Result<(), DecodeError> {
    let mut buf = [0u8; MAX_HEADER_BYTES];
    match postcard::to_slice(wire, &mut buf) {
        Ok(canonical) if *canonical == *signed => Ok(()),
        _ => Err(DecodeError::NonCanonical {
            part: Part::Header,
            detail: "overlong varint or length prefix",
        }),
    }
}

fn header_from_wire(w: &WireHeader<'_>) -> Result<PacketHeader, DecodeError> {
    let invalid = |field, reason| DecodeError::InvalidField { field, reason };
    if w.sender.len() > MAX_PEER_ID_BYTES {
        return Err(DecodeError::Oversize {
            what: "sender peer id",
            len: w.sender.len() as u64,
            max: MAX_PEER_ID_BYTES as u64,
        });
    }
    let sender = PeerId::from_bytes(w.sender).map_err(|_| invalid("sender", "not a PeerId"))?;
    if !(w.loss.is_finite() && w.loss.abs() <= MAX_ABS_LOSS) {
        return Err(invalid(
            "loss",
            "not finite, or its magnitude is over MAX_ABS_LOSS",
        ));
    }
    if w.samples > MAX_SAMPLES {
        return Err(invalid("samples", "over MAX_SAMPLES"));
    }
    if w.sketch.len() > MAX_SKETCH_LEN {
        return Err(DecodeError::Oversize {
            what: "embedding sketch",
            len: w.sketch.len() as u64,
            max: MAX_SKETCH_LEN as u64,
        });
    }
    if !(w.sketch_scale.is_finite() && w.sketch_scale >= 0.0) {
        return Err(invalid("sketch_scale", "not a finite non-negative number"));
    }
    // A body past one message's limit (MAX_BODY_BYTES) travels in pieces, up to this.
    if w.body_len as usize > MAX_PIECED_BODY_BYTES {
        return Err(DecodeError::Oversize {
            what: "body",
            len: u64::from(w.body_len),
            max: MAX_PIECED_BODY_BYTES as u64,
        });
    }
    let compression = CompressionSummary {
        dense_layers: w.dense_layers,
        topk_layers: w.topk_layers,
        sign_layers: w.sign_layers,
        params: w.params,
        carried: w.carried,
    };
    let layers = compression.layers();
    if layers == 0 || layers > MAX_LAYERS {
        return Err(invalid("compression", "layer count outside 1..=MAX_LAYERS"));
    }
    if compression.carried > compression.params
        || compression.params > layers as u64 * MAX_LAYER_ELEMS
    {
        return Err(invalid("compression", "carried or params out of range"));
    }
    Ok(PacketHeader {
        model: ModelId(w.model),
        round: w.round,
        sender,
        unix_ms: w.unix_ms,
        samples: w.samples,
        loss: w.loss,
        embedding: Embedding {
            simhash: SimHash(w.simhash),
            sketch: bytemuck::cast_slice::<u8, i8>(w.sketch).to_vec(),
            sketch_scale: w.sketch_scale,
        },
        body_len: w.body_len,
        body_hash: w.body_hash,
        compression,
    })
}

/// Encode a body without validating it (see [`seal`] for the validating path).
pub fn encode_body(body: &PacketBody) -> Vec<u8> {
    encode(body).bytes
}

/// `body` through a [`BodyEncoder`], its bytes and summary in one pass.
fn encode(body: &PacketBody) -> EncodedBody {
    let layer_bytes: usize = body.layers.iter().map(encoded_layer_len).sum();
    let mut encoder = BodyEncoder::new(body.layers.len(), layer_bytes);
    for layer in &body.layers {
        encoder.push(layer);
    }
    encoder.finish()
}

/// A body encoded a layer at a time, with the summary of what it holds: a whole model's snapshot
/// is encoded as each layer is quantised, never built as a [`PacketBody`] first.
///
/// The layer count is written first, so it is given up front; a body whose pushed layers do
/// not match it (or the spec) is refused when sealed ([`seal_snapshot_encoded`]).
///
/// ```
/// use kindred_proto::{BodyEncoder, DenseValues, LayerPayload, PacketBody, encode_body};
/// let layers = vec![
///     LayerPayload::Dense(DenseValues::F32(vec![0.5, -1.0])),
///     LayerPayload::Dense(DenseValues::Int8 { values: vec![3, 0, -7], scale: 0.25 }),
/// ];
/// let mut encoder = BodyEncoder::new(layers.len(), 0);
/// for layer in &layers {
///     encoder.push(layer);
/// }
/// let body = encoder.finish();
/// assert_eq!(body.bytes, encode_body(&PacketBody { layers }));
/// assert_eq!(body.compression.dense_layers, 2);
/// ```
#[derive(Debug)]
pub struct BodyEncoder {
    out: Vec<u8>,
    compression: CompressionSummary,
    /// Top-k index deltas of the layer being encoded (reused).
    deltas: Vec<u8>,
}

/// What [`BodyEncoder::finish`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedBody {
    /// The body's bytes.
    pub bytes: Vec<u8>,
    /// What its layers are ([`CompressionSummary::of`] the body they encode).
    pub compression: CompressionSummary,
}

impl BodyEncoder {
    /// An encoder of a body of `layers` layers, with room for `capacity` bytes (memory is
    /// only reserved: what the layers do not fill is never touched).
    pub fn new(layers: usize, capacity: usize) -> Self {
        let mut out = Vec::with_capacity(capacity.saturating_add(5));
        // A count over u32 cannot match any spec (at most `MAX_LAYERS`): saturated, refused
        // when sealed.
        varint::encode_u32(u32::try_from(layers).unwrap_or(u32::MAX), &mut out);
        Self {
            out,
            compression: CompressionSummary::default(),
            deltas: Vec::new(),
        }
    }

    /// Append the next layer.
    pub fn push(&mut self, layer: &LayerPayload) {
        self.compression.add(layer);
        let f32_bytes;
        let f16_bytes;
        let words_bytes;
        let wire = match layer {
            LayerPayload::Dense(DenseValues::F32(v)) => {
                f32_bytes = le_bytes(v, f32::to_le_bytes);
                WireLayer::Dense {
                    dtype: WireDtype::F32,
                    bytes: &f32_bytes,
                }
            }
            LayerPayload::Dense(DenseValues::F16(v)) => {
                f16_bytes = le_bytes(v, f16::to_le_bytes);
                WireLayer::Dense {
                    dtype: WireDtype::F16,
                    bytes: &f16_bytes,
                }
            }
            LayerPayload::Dense(DenseValues::BF16(v)) => {
                f16_bytes = le_bytes(v, bf16::to_le_bytes);
                WireLayer::Dense {
                    dtype: WireDtype::BF16,
                    bytes: &f16_bytes,
                }
            }
            LayerPayload::Dense(DenseValues::Int8 { values, scale }) => WireLayer::DenseInt8 {
                values: bytemuck::cast_slice(values),
                scale: *scale,
            },
            LayerPayload::TopK(t) => {
                encode_deltas(&t.indices, &mut self.deltas);
                WireLayer::TopK {
                    len: t.len,
                    count: t.indices.len() as u32,
                    index_deltas: &self.deltas,
                    values: bytemuck::cast_slice(&t.values),
                    scale: t.scale,
                }
            }
            LayerPayload::TopK4(t) => {
                encode_deltas(&t.indices, &mut self.deltas);
                WireLayer::TopK4 {
                    len: t.len,
                    count: t.indices.len() as u32,
                    index_deltas: &self.deltas,
                    codes: &t.codes,
                    scale: t.scale,
                    ratio: t.ratio,
                }
            }
            LayerPayload::Sign(s) => {
                words_bytes = le_bytes(&s.words, u64::to_le_bytes);
                WireLayer::Sign {
                    len: s.len,
                    words: &words_bytes,
                    scale: s.scale,
                }
            }
        };
        // Serialising into a `Vec` cannot fail (postcard's `to_extend` only extends it).
        self.out = postcard::to_extend(&wire, std::mem::take(&mut self.out)).unwrap_or_default();
    }

    /// The encoded body.
    pub fn finish(self) -> EncodedBody {
        EncodedBody {
            bytes: self.out,
            compression: self.compression,
        }
    }
}

/// Bytes `layer` takes inside an encoded body, computed without encoding it: the body is the
/// varint of the layer count followed by exactly these sizes, so a distiller can report per-layer
/// bytes on every round without encoding twice.
///
/// ```
/// use kindred_proto::{encode_body, encoded_layer_len, LayerPayload, PacketBody, TopK};
/// let layer = LayerPayload::TopK(TopK { len: 1000, indices: vec![3, 200, 999], values: vec![5, -7, 1], scale: 0.5 });
/// let body = PacketBody { layers: vec![layer.clone()] };
/// assert_eq!(encode_body(&body).len(), 1 + encoded_layer_len(&layer));
/// ```
pub fn encoded_layer_len(layer: &LayerPayload) -> usize {
    // postcard: an enum variant is the varint of its index (one byte here), a u32 a varint, a
    // byte slice the varint of its length and the bytes, an f32 four bytes.
    let bytes = |n: usize| varint::len_u32(n as u32) + n;
    1 + match layer {
        // Float dtypes: the dtype's variant byte and the bytes; int8: the bytes and the scale.
        LayerPayload::Dense(values) => match values {
            DenseValues::F32(v) => 1 + bytes(v.len() * 4),
            DenseValues::F16(v) => 1 + bytes(v.len() * 2),
            DenseValues::BF16(v) => 1 + bytes(v.len() * 2),
            DenseValues::Int8 { values, .. } => bytes(values.len()) + 4,
        },
        LayerPayload::TopK(t) => {
            varint::len_u32(t.len)
                + varint::len_u32(t.indices.len() as u32)
                + bytes(deltas_len(&t.indices))
                + bytes(t.values.len())
                + 4
        }
        LayerPayload::TopK4(t) => {
            varint::len_u32(t.len)
                + varint::len_u32(t.indices.len() as u32)
                + bytes(deltas_len(&t.indices))
                + bytes(t.codes.len())
                + 8
        }
        LayerPayload::Sign(s) => varint::len_u32(s.len) + bytes(s.words.len() * 8) + 4,
    }
}

/// Top-k `indices` as the wire's delta-coded varints (the first index, then each difference),
/// into `out` (cleared first).
fn encode_deltas(indices: &[u32], out: &mut Vec<u8>) {
    out.clear();
    let mut prev = 0u32;
    for (i, &idx) in indices.iter().enumerate() {
        varint::encode_u32(if i == 0 { idx } else { idx.wrapping_sub(prev) }, out);
        prev = idx;
    }
}

/// Bytes [`encode_deltas`] writes for `indices`.
fn deltas_len(indices: &[u32]) -> usize {
    let mut prev = 0u32;
    let mut len = 0;
    for (i, &idx) in indices.iter().enumerate() {
        len += varint::len_u32(if i == 0 { idx } else { idx.wrapping_sub(prev) });
        prev = idx;
    }
    len
}

/// Little-endian bytes of a slice of plain numbers: a free reinterpretation on little-endian
/// machines, a converted copy elsewhere.
fn le_bytes<T: bytemuck::Pod, const N: usize>(v: &[T], to_le: fn(T) -> [u8; N]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|&x| to_le(x)).collect())
    }
}

/// Decode a body received from a peer, against the header that announced it and the local spec.
///
/// Checks, in order: size limit, the length and blake3 hash the signed header commits to, that
/// the header is for this model, the layer count, then each layer against its spec (element count,
/// index order and range, finite scales and values, sign padding), and finally that the header's
/// compression summary describes the body.
///
/// # Errors
/// The first [`DecodeError`] found. Allocations are bounded by the spec's layer sizes, which are
/// checked before each allocation.
pub fn decode_body(
    header: &PacketHeader,
    spec: &ModelSpec,
    bytes: &[u8],
) -> Result<PacketBody, DecodeError> {
    let mut layers = Vec::new();
    walk_body(header, spec, bytes, |layer| layers.push(layer))?;
    Ok(PacketBody { layers })
}

/// [`decode_body`]'s checks, every one, without keeping the layers: each is decoded, checked
/// and dropped before the next, so memory stays at one layer's (what [`seal`] validates its
/// own bodies with).
///
/// # Errors
/// As [`decode_body`].
pub fn check_body(
    header: &PacketHeader,
    spec: &ModelSpec,
    bytes: &[u8],
) -> Result<(), DecodeError> {
    walk_body(header, spec, bytes, drop)
}

/// Decode and check a body's layers in order, handing each to `each`.
fn walk_body(
    header: &PacketHeader,
    spec: &ModelSpec,
    bytes: &[u8],
    mut each: impl FnMut(LayerPayload),
) -> Result<(), DecodeError> {
    if bytes.len() > MAX_PIECED_BODY_BYTES {
        return Err(DecodeError::Oversize {
            what: "body",
            len: bytes.len() as u64,
            max: MAX_PIECED_BODY_BYTES as u64,
        });
    }
    if bytes.len() as u64 != u64::from(header.body_len) {
        return Err(DecodeError::BodyLengthMismatch {
            expected: u64::from(header.body_len),
            found: bytes.len() as u64,
        });
    }
    if blake3::hash(bytes).as_bytes() != &header.body_hash {
        return Err(DecodeError::BodyHashMismatch);
    }
    if header.model != spec.id() {
        return Err(DecodeError::ModelMismatch);
    }
    let (count, mut rest) = varint::decode_u32(bytes).map_err(|e| e.at(Part::Body))?;
    let count = count as usize;
    if count > MAX_LAYERS {
        return Err(DecodeError::Oversize {
            what: "layer count",
            len: count as u64,
            max: MAX_LAYERS as u64,
        });
    }
    if count != spec.layers().len() {
        return Err(DecodeError::LayerCountMismatch {
            expected: spec.layers().len(),
            found: count,
        });
    }
    let mut compression = CompressionSummary::default();
    for (i, layer_spec) in spec.layers().iter().enumerate() {
        let (wire, tail) = postcard::take_from_bytes::<WireLayer<'_>>(rest)
            .map_err(|e| postcard_error(e, Part::Layer(i)))?;
        // Every field is either fixed-size or a varint, and an overlong varint is longer than the
        // shortest: a layer is canonical exactly when it takes the bytes its fields need. (The
        // top-k index deltas inside their byte string are checked one by one as they decode.)
        if rest.len() - tail.len() != canonical_wire_len(&wire) {
            return Err(DecodeError::NonCanonical {
                part: Part::Layer(i),
                detail: "overlong varint or length prefix",
            });
        }
        let layer = layer_from_wire(i, layer_spec, wire)?;
        compression.add(&layer);
        each(layer);
        rest = tail;
    }
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            part: Part::Body,
            extra: rest.len(),
        });
    }
    if compression != header.compression {
        return Err(DecodeError::SummaryMismatch);
    }
    Ok(())
}

/// Bytes postcard's shortest encoding of `wire` takes: O(1), from the fields' values.
fn canonical_wire_len(wire: &WireLayer<'_>) -> usize {
    let bytes = |b: &[u8]| varint::len_u32(b.len() as u32) + b.len();
    // Variant tags and the dtype tag are single bytes (all below 128).
    1 + match wire {
        WireLayer::Dense { bytes: b, .. } => 1 + bytes(b),
        WireLayer::TopK {
            len,
            count,
            index_deltas,
            values,
            ..
        } => {
            varint::len_u32(*len)
                + varint::len_u32(*count)
                + bytes(index_deltas)
                + bytes(values)
                + 4
        }
        WireLayer::Sign { len, words, .. } => varint::len_u32(*len) + bytes(words) + 4,
        WireLayer::DenseInt8 { values, .. } => bytes(values) + 4,
        WireLayer::TopK4 {
            len,
            count,
            index_deltas,
            codes,
            ..
        } => {
            varint::len_u32(*len) + varint::len_u32(*count) + bytes(index_deltas) + bytes(codes) + 8
        }
    }
}

fn layer_from_wire(
    i: usize,
    spec: &LayerSpec,
    wire: WireLayer<'_>,
) -> Result<LayerPayload, DecodeError> {
    let numel = spec.numel();
    let shape_check = |found: u64| {
        if found == numel {
            Ok(())
        } else {
            Err(DecodeError::ShapeMismatch {
                layer: i,
                expected: numel,
                found,
            })
        }
    };
    let scale_check = |scale: f32| {
        if scale.is_finite() && scale >= 0.0 {
            Ok(())
        } else {
            Err(DecodeError::NonFiniteScale { layer: i, scale })
        }
    };
    // Int8 values are symmetric, ±127 (as every quantiser writes them), and 127 steps of the
    // scale stay finite: so every value a receiver dequantises is finite.
    let int8_check = |values: &[u8], scale: f32| {
        scale_check(scale)?;
        if !(scale * 127.0).is_finite() {
            return Err(DecodeError::NonFiniteScale { layer: i, scale });
        }
        if values.contains(&0x80) {
            return Err(DecodeError::Malformed {
                part: Part::Layer(i),
                detail: "int8 value -128 (values are within ±127)",
            });
        }
        Ok(())
    };
    match wire {
        WireLayer::Dense { dtype, bytes } => {
            let dtype = match dtype {
                WireDtype::F32 => DType::F32,
                WireDtype::F16 => DType::F16,
                WireDtype::BF16 => DType::BF16,
            };
            if bytes.len() % dtype.size() != 0 {
                return Err(DecodeError::Malformed {
                    part: Part::Layer(i),
                    detail: "dense bytes are not a whole number of elements",
                });
            }
            shape_check((bytes.len() / dtype.size()) as u64)?;
            let values = match dtype {
                DType::F32 => DenseValues::F32(from_le(bytes, f32::from_le_bytes)),
                DType::F16 => DenseValues::F16(from_le(bytes, f16::from_le_bytes)),
                DType::BF16 => DenseValues::BF16(from_le(bytes, bf16::from_le_bytes)),
            };
            let bad = match &values {
                DenseValues::F32(v) => v.iter().position(|x| !x.is_finite()),
                DenseValues::F16(v) => v.iter().position(|x| !x.is_finite()),
                DenseValues::BF16(v) => v.iter().position(|x| !x.is_finite()),
                DenseValues::Int8 { .. } => None,
            };
            match bad {
                Some(index) => Err(DecodeError::NonFiniteValue { layer: i, index }),
                None => Ok(LayerPayload::Dense(values)),
            }
        }
        WireLayer::TopK {
            len,
            count,
            index_deltas,
            values,
            scale,
        } => {
            shape_check(u64::from(len))?;
            int8_check(values, scale)?;
            let k = count as usize;
            if values.len() != k {
                return Err(DecodeError::Malformed {
                    part: Part::Layer(i),
                    detail: "top-k value count differs from index count",
                });
            }
            let indices = decode_indices(i, numel, count, index_deltas)?;
            Ok(LayerPayload::TopK(TopK {
                len,
                indices,
                values: bytemuck::cast_slice::<u8, i8>(values).to_vec(),
                scale,
            }))
        }
        WireLayer::TopK4 {
            len,
            count,
            index_deltas,
            codes,
            scale,
            ratio,
        } => {
            shape_check(u64::from(len))?;
            scale_check(scale)?;
            // ratio ≤ 1 keeps every level at most `scale`, so every value finite.
            if !(ratio > 0.0 && ratio <= 1.0) {
                return Err(DecodeError::Malformed {
                    part: Part::Layer(i),
                    detail: "4-bit level ratio outside (0, 1]",
                });
            }
            if codes.len() as u64 != u64::from(count).div_ceil(2) {
                return Err(DecodeError::Malformed {
                    part: Part::Layer(i),
                    detail: "4-bit code bytes do not match the entry count",
                });
            }
            if !count.is_multiple_of(2) && codes.last().is_some_and(|b| b >> 4 != 0) {
                return Err(DecodeError::Malformed {
                    part: Part::Layer(i),
                    detail: "unused 4-bit code is not zero",
                });
            }
            let indices = decode_indices(i, numel, count, index_deltas)?;
            Ok(LayerPayload::TopK4(TopK4 {
                len,
                indices,
                codes: codes.to_vec(),
                scale,
                ratio,
            }))
        }
        WireLayer::DenseInt8 { values, scale } => {
            shape_check(values.len() as u64)?;
            int8_check(values, scale)?;
            Ok(LayerPayload::Dense(DenseValues::Int8 {
                values: bytemuck::cast_slice::<u8, i8>(values).to_vec(),
                scale,
            }))
        }
        WireLayer::Sign { len, words, scale } => {
            shape_check(u64::from(len))?;
            scale_check(scale)?;
            let n_words = (len as usize).div_ceil(64);
            if words.len() != n_words * 8 {
                return Err(DecodeError::Malformed {
                    part: Part::Layer(i),
                    detail: "sign word bytes do not match the element count",
                });
            }
            let words = from_le(words, u64::from_le_bytes);
            let tail_bits = len % 64;
            if tail_bits != 0 && words.last().is_some_and(|w| w >> tail_bits != 0) {
                return Err(DecodeError::SignPadding { layer: i });
            }
            Ok(LayerPayload::Sign(SignBits { len, words, scale }))
        }
    }
}

/// The `count` top-k indices of layer `i` (of `numel` elements) from their delta-coded
/// varints: strictly increasing, below `numel`, every byte used. The count is bounded by the
/// layer and by the bytes (a varint takes at least one) before anything is allocated.
fn decode_indices(
    i: usize,
    numel: u64,
    count: u32,
    index_deltas: &[u8],
) -> Result<Vec<u32>, DecodeError> {
    if u64::from(count) > numel {
        return Err(DecodeError::Oversize {
            what: "top-k count",
            len: u64::from(count),
            max: numel,
        });
    }
    let k = count as usize;
    if index_deltas.len() < k {
        return Err(DecodeError::Truncated {
            part: Part::Layer(i),
        });
    }
    let mut indices = Vec::with_capacity(k);
    let mut rest = index_deltas;
    let mut prev = 0u64;
    for position in 0..k {
        let (delta, tail) = varint::decode_u32(rest).map_err(|e| e.at(Part::Layer(i)))?;
        rest = tail;
        if position > 0 && delta == 0 {
            return Err(DecodeError::IndexNotIncreasing { layer: i, position });
        }
        let index = if position == 0 {
            u64::from(delta)
        } else {
            prev + u64::from(delta)
        };
        if index >= numel {
            return Err(DecodeError::IndexOutOfRange {
                layer: i,
                index,
                len: numel,
            });
        }
        // index < numel ≤ MAX_LAYER_ELEMS = u32::MAX
        indices.push(index as u32);
        prev = index;
    }
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            part: Part::Layer(i),
            extra: rest.len(),
        });
    }
    Ok(indices)
}

/// Read little-endian numbers from bytes whose length is a multiple of `N` (checked by callers).
fn from_le<T, const N: usize>(bytes: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            from(a)
        })
        .collect()
}

fn postcard_error(err: postcard::Error, part: Part) -> DecodeError {
    use postcard::Error as E;
    let detail = match err {
        E::DeserializeUnexpectedEnd => return DecodeError::Truncated { part },
        E::DeserializeBadVarint => "bad varint",
        // serde's derived enum visitors report an unknown variant index as a custom error.
        E::DeserializeBadEnum | E::SerdeDeCustom => "unknown enum tag",
        E::DeserializeBadUtf8 => "invalid UTF-8",
        E::DeserializeBadBool => "invalid bool",
        E::DeserializeBadOption => "invalid option tag",
        _ => "undecodable bytes",
    };
    DecodeError::Malformed { part, detail }
}
