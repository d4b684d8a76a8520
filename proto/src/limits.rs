//! Explicit size limits of the v1 wire format.
//!
//! Every decoder in this crate compares a length against one of these constants *before* it
//! allocates or copies anything, so a hostile peer cannot make a node reserve more memory than
//! these bounds, whatever the bytes claim. Changing a limit changes what honest nodes accept: treat
//! it as a wire change and bump [`FORMAT_VERSION`].

/// The only outcome-packet format version this crate encodes and accepts.
pub const FORMAT_VERSION: u16 = 1;

/// Largest encoded, signed packet header accepted (bytes).
///
/// A v1 header with the largest embedding sketch ([`MAX_SKETCH_LEN`]) and the longest peer id
/// ([`MAX_PEER_ID_BYTES`]) encodes to well under 2 KiB; the rest is headroom.
pub const MAX_HEADER_BYTES: usize = 4096;

/// Largest body carried whole in one message (bytes): 64 MiB, in a `Push` or a `Body`,
/// `Snapshot` or `Merge` response.
///
/// Outcome packets are meant to be 20-100x smaller than the raw update, so this admits updates of
/// several hundred million parameters at the default density, and a 16M-parameter layer dense in
/// f32. A larger body travels in pieces ([`MAX_PIECED_BODY_BYTES`]).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Largest body any header may announce (bytes): 2 GiB, a 10^9-parameter model's int8 snapshot
/// with room to spare.
///
/// A snapshot is the whole model, so unlike a packet it grows with the model, not with the
/// density; a packet or a hub's merge of 5% of a model past about 6.5 × 10^8 parameters outgrows
/// one message too. A body over [`MAX_BODY_BYTES`] travels in pieces of at most
/// [`MAX_CHUNK_BYTES`] (`RpcRequest::GetChunk`: a hub pulls a large push from its member, a
/// member a large merge or snapshot from its hub), each response bounded on its own, and the
/// whole is checked against the signed header's length and blake3 hash before it is decoded.
/// A packet over [`MAX_BODY_BYTES`] cannot be fetched with `GetBody` (the pairwise exchange
/// passes over it).
pub const MAX_PIECED_BODY_BYTES: usize = 2 << 30;
/// Largest piece of a body one response carries (bytes): 4 MiB.
pub const MAX_CHUNK_BYTES: usize = 4 << 20;
/// Most layers a model spec, and therefore a packet body, may have.
pub const MAX_LAYERS: usize = 4096;

/// Most elements in one layer (2^32 − 1, about 4.3 × 10^9: the embedding of a model of
/// billions of parameters fits). A layer's length and its indices are `u32` on the wire, so
/// this is also what keeps every one representable. A dense layer that large is still bounded
/// by the body limits ([`MAX_PIECED_BODY_BYTES`]): it travels as top-k or sign.
pub const MAX_LAYER_ELEMS: u64 = u32::MAX as u64;

/// Most dimensions in one layer's shape.
pub const MAX_DIMS: usize = 8;

/// Longest layer name in a model spec (bytes of UTF-8).
pub const MAX_NAME_BYTES: usize = 256;

/// Most entries in an embedding's int8 sketch (used for exact cosine re-ranking).
pub const MAX_SKETCH_LEN: usize = 1024;

/// Longest encoded libp2p `PeerId` (a multihash of at most 64 bytes plus its prefix).
pub const MAX_PEER_ID_BYTES: usize = 72;

/// Bits in an embedding's SimHash signature.
pub const SIMHASH_BITS: usize = 256;

/// Most training samples one update may claim (2^32).
///
/// A merge weighs updates by their claimed samples, so an unbounded claim is a lever; this bound
/// keeps every claim (and every sum of claims a merge computes) far from overflow. It does not
/// make claims honest: merges also cap each peer's weight relative to the other claims
/// (`kindred_distill::SynthConfig::max_samples_ratio`).
pub const MAX_SAMPLES: u64 = 1 << 32;

/// Largest magnitude of a reported training loss. Losses are finite; a larger one is a corrupt or
/// hostile report, not a training signal.
pub const MAX_ABS_LOSS: f32 = 1.0e6;
