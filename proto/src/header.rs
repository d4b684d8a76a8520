//! The packet header: small, signed, fetched first.
//!
//! A node decides from headers alone whom it will merge with (model, round, embedding, cost), so
//! the header carries everything needed for that decision and commits to the body by length and
//! blake3 hash. Bodies are fetched only for the few best-ranked headers.

use libp2p_identity::PeerId;

use crate::limits::SIMHASH_BITS;
use crate::payload::CompressionSummary;
use crate::spec::ModelId;

/// 256-bit SimHash signature of an update's embedding.
///
/// Bit `i` is bit `i % 8` of byte `i / 8`. Similar updates differ in few bits: the probability
/// that one bit differs is θ/π for updates at angle θ.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SimHash(pub [u8; SIMHASH_BITS / 8]);

impl SimHash {
    /// Bit `i` (`false` past the end).
    ///
    /// ```
    /// use kindred_proto::SimHash;
    /// let mut bytes = [0u8; 32];
    /// bytes[1] = 0b0000_0100;
    /// assert!(SimHash(bytes).bit(10));
    /// assert!(!SimHash(bytes).bit(11));
    /// ```
    pub fn bit(&self, i: usize) -> bool {
        self.0.get(i / 8).is_some_and(|b| (b >> (i % 8)) & 1 == 1)
    }

    /// Number of differing bits.
    pub fn hamming(&self, other: &Self) -> u32 {
        self.0
            .iter()
            .zip(&other.0)
            .map(|(a, b)| (a ^ b).count_ones())
            .sum()
    }

    /// Bits `[start, start + len)` as an integer, bit `start` lowest (`len` ≤ 64; bits past the
    /// end read as zero). Used to cut LSH bands.
    pub fn bits(&self, start: usize, len: usize) -> u64 {
        (0..len.min(64)).fold(0u64, |acc, j| acc | (u64::from(self.bit(start + j)) << j))
    }
}

impl std::fmt::Debug for SimHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimHash(")?;
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        f.write_str(")")
    }
}

/// The compact embedding of an update that routing keys on and ranks by.
///
/// `simhash` gives the DHT keys (LSH bands); `sketch` is an int8 count-sketch of the centred,
/// per-layer normalised update, precise enough to re-rank candidates by cosine.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Embedding {
    /// SimHash signature.
    pub simhash: SimHash,
    /// int8 sketch, at most [`crate::MAX_SKETCH_LEN`] entries.
    pub sketch: Vec<i8>,
    /// Dequantisation scale of the sketch: finite and non-negative.
    pub sketch_scale: f32,
}

impl Embedding {
    /// Cosine similarity of two sketches, in `[-1, 1]`; 0 when either is all zero or their
    /// lengths differ (sketches from different configurations are not comparable).
    ///
    /// ```
    /// use kindred_proto::Embedding;
    /// let a = Embedding { sketch: vec![3, 4, 0], ..Default::default() };
    /// let b = Embedding { sketch: vec![6, 8, 0], ..Default::default() };
    /// assert!((a.cosine(&b) - 1.0).abs() < 1e-6);
    /// ```
    pub fn cosine(&self, other: &Self) -> f32 {
        if self.sketch.len() != other.sketch.len() {
            return 0.0;
        }
        let (mut dot, mut na, mut nb) = (0i64, 0i64, 0i64);
        for (&a, &b) in self.sketch.iter().zip(&other.sketch) {
            let (a, b) = (i64::from(a), i64::from(b));
            dot += a * b;
            na += a * a;
            nb += b * b;
        }
        if na == 0 || nb == 0 {
            return 0.0;
        }
        (dot as f64 / ((na as f64).sqrt() * (nb as f64).sqrt())) as f32
    }
}

/// blake3 hash of a packet body.
pub type BodyHash = [u8; 32];

/// The content of a packet header (everything that is signed).
#[derive(Debug, Clone, PartialEq)]
pub struct PacketHeader {
    /// The model this update is for.
    pub model: ModelId,
    /// The sender's training round.
    pub round: u64,
    /// The sender; the header is signed by this peer's ed25519 key.
    pub sender: PeerId,
    /// When the packet was made, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// Training samples behind this update (a merge weight).
    pub samples: u64,
    /// The sender's local training loss this round: finite.
    pub loss: f32,
    /// The update's embedding.
    pub embedding: Embedding,
    /// Length of the encoded body in bytes.
    pub body_len: u32,
    /// blake3 of the encoded body.
    pub body_hash: BodyHash,
    /// How the body was compressed.
    pub compression: CompressionSummary,
}

/// A packet's identity: blake3 of its encoded, signed header.
///
/// The header commits to the body by length and hash, so this id names the whole packet, and a
/// node that has fetched only a header can already ask for its body by id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PacketId(pub [u8; 32]);

impl PacketId {
    /// The id of an encoded header.
    pub fn of_header_bytes(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }
}

impl std::fmt::Debug for PacketId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PacketId({self})")
    }
}

impl std::fmt::Display for PacketId {
    /// The first 8 bytes in hex.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A header whose encoding, fields and signature have been checked.
///
/// Only [`crate::decode_header`] and [`crate::seal`] make one, so holding a `VerifiedHeader` means
/// the sender named in it really signed it.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifiedHeader {
    header: PacketHeader,
    id: PacketId,
    /// The seal as received: the signer's public key and the signature.
    public_key: [u8; 32],
    signature: [u8; 64],
}

impl VerifiedHeader {
    pub(crate) fn new(
        header: PacketHeader,
        id: PacketId,
        public_key: [u8; 32],
        signature: [u8; 64],
    ) -> Self {
        Self {
            header,
            id,
            public_key,
            signature,
        }
    }

    /// The header's one encoding: exactly the bytes it was decoded from (decoders accept only
    /// canonical encodings), so `PacketId::of_header_bytes(&h.to_bytes()) == h.id()`.
    ///
    /// ```
    /// # use kindred_proto::*;
    /// # use libp2p_identity::ed25519;
    /// # let key = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([1u8; 32]).unwrap());
    /// # let spec = ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])?;
    /// # let body = PacketBody { layers: vec![LayerPayload::Dense(DenseValues::F32(vec![0.5; 4]))] };
    /// # let fields = HeaderFields { round: 3, unix_ms: 0, samples: 32, loss: 0.7, embedding: Embedding::default() };
    /// let packet = seal(&key, &spec, fields, &body)?;
    /// let header = decode_header(&packet.header_bytes)?;
    /// assert_eq!(header.to_bytes(), packet.header_bytes);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_bytes(&self) -> Vec<u8> {
        crate::codec::encode_sealed(&self.header, &self.public_key, &self.signature)
    }

    /// The verified content.
    pub fn header(&self) -> &PacketHeader {
        &self.header
    }

    /// The packet's id.
    pub fn id(&self) -> PacketId {
        self.id
    }

    /// Take the content.
    pub fn into_header(self) -> PacketHeader {
        self.header
    }
}
