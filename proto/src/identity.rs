//! Strict ed25519 identities: the one place Kindred decides whether a public key may speak.
//!
//! Plain ed25519 verification (what `libp2p_identity::ed25519::PublicKey::verify` does) accepts
//! *weak* keys: the eight points of small order, for which a signature with R = identity and
//! S = 0 verifies for almost every message. Whoever uses such a key needs no secret, so anyone can
//! speak for its `PeerId`. It also accepts non-canonical encodings of a point (a y coordinate at
//! or above the field prime), which give one key several byte strings and so several `PeerId`s.
//!
//! Every signature Kindred checks goes through [`verify_strict`]: the key must be canonical and of
//! large order, the signature's S canonical and its R canonical and of large order (ed25519-dalek's
//! `verify_strict`). [`check_peer`] applies the same key rule to a peer met on a connection: the
//! Noise handshake verifies the peer's identity with the permissive check, so the routing
//! behaviour refuses such peers itself.

use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use libp2p_identity::{PeerId, PublicKey};

/// Length of an encoded ed25519 public key.
pub(crate) const PUBLIC_KEY_LEN: usize = 32;
/// Length of an ed25519 signature.
pub(crate) const SIGNATURE_LEN: usize = 64;

/// Why a public key or a peer's identity is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// Not 32 bytes, or not the encoding of a curve point.
    #[error("not an ed25519 public key")]
    NotAKey,
    /// A valid point, but not in its one canonical encoding.
    #[error("non-canonical ed25519 public key encoding")]
    NonCanonical,
    /// A point of small order: signatures under it can be forged without a secret.
    #[error("weak (small-order) ed25519 public key")]
    Weak,
    /// The peer id does not carry an ed25519 key inline (Kindred identities always do).
    #[error("peer id does not carry an inline ed25519 key")]
    NotEd25519,
}

/// The canonical encodings of the eight points of small order (the torsion subgroup): the
/// identity, the point of order 2, two of order 4 and four of order 8. A unit test checks them
/// against curve25519-dalek's `EIGHT_TORSION`.
const SMALL_ORDER_ENCODINGS: [[u8; 32]; 8] = [
    hex32("0100000000000000000000000000000000000000000000000000000000000000"),
    hex32("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"),
    hex32("0000000000000000000000000000000000000000000000000000000000000080"),
    hex32("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"),
    hex32("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    hex32("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85"),
    hex32("0000000000000000000000000000000000000000000000000000000000000000"),
    hex32("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa"),
];

// Evaluated at compile time on the literals above: an index out of range is a build error.
#[allow(clippy::indexing_slicing)]
const fn hex32(s: &str) -> [u8; 32] {
    const fn nibble(c: u8) -> u8 {
        match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => panic!("not lowercase hex"),
        }
    }
    let s = s.as_bytes();
    assert!(s.len() == 64, "32 bytes of hex");
    let mut out = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = nibble(s[2 * i]) << 4 | nibble(s[2 * i + 1]);
        i += 1;
    }
    out
}

/// Whether the 255-bit y coordinate of an encoded point is at or above the field prime
/// 2^255 - 19 (so that it is a second encoding of y - p): checked on the bytes, without the field
/// inversion a re-compression would cost on every header.
fn y_not_reduced(bytes: &[u8; 32]) -> bool {
    let [low, middle @ .., high] = bytes;
    high & 0x7f == 0x7f && middle.iter().all(|&b| b == 0xff) && *low >= 0xed
}

/// Parse a public key under the strict rule: 32 bytes, a canonical encoding, not of small order.
pub(crate) fn strict_key(bytes: &[u8]) -> Result<VerifyingKey, IdentityError> {
    let array: &[u8; PUBLIC_KEY_LEN] = bytes.try_into().map_err(|_| IdentityError::NotAKey)?;
    if y_not_reduced(array) {
        return Err(IdentityError::NonCanonical);
    }
    let key = VerifyingKey::from_bytes(array).map_err(|_| IdentityError::NotAKey)?;
    // With y reduced, the only other non-canonical form is x = 0 with the sign bit set, and
    // x = 0 means y = ±1: two small-order points, refused here as weak.
    if key.is_weak() {
        return Err(IdentityError::Weak);
    }
    Ok(key)
}

/// Verify `signature` over `message` under the strict rule (see the module docs), for a key from
/// [`strict_key`].
///
/// The same checks as ed25519-dalek's `verify_strict`, at the cost of a plain `verify`: dalek's
/// `verify` compares the canonical compression of the recomputed R with the signature's R bytes
/// (so a non-canonical R never verifies) and parses S only if canonical; the key is already known
/// to be canonical and of large order; what remains is that R is not of small order, which for a
/// canonical R is one of eight fixed encodings. (`verify_strict` decompresses R for that, a field
/// square root per header.)
pub(crate) fn verify_strict(key: &VerifyingKey, message: &[u8], signature: &[u8]) -> bool {
    let Ok(signature) = Signature::from_slice(signature) else {
        return false;
    };
    !SMALL_ORDER_ENCODINGS.contains(signature.r_bytes()) && key.verify(message, &signature).is_ok()
}

/// The `PeerId` bytes of an ed25519 key: the identity multihash (code 0, length 36) of the key's
/// protobuf encoding (field 1: key type 1 = Ed25519; field 2: the 32 key bytes). Built without
/// decompressing the key again.
pub(crate) fn peer_id_bytes(key: &[u8; PUBLIC_KEY_LEN]) -> [u8; 38] {
    let mut out = [0u8; 38];
    let (prefix, rest) = out.split_at_mut(6);
    prefix.copy_from_slice(&[0x00, 0x24, 0x08, 0x01, 0x12, 0x20]);
    rest.copy_from_slice(key);
    out
}

/// Check a libp2p public key under the strict rule.
///
/// ```
/// use libp2p_identity::{PublicKey, ed25519};
/// // An honest key passes.
/// let honest = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([7u8; 32]).unwrap());
/// assert!(kindred_proto::check_public_key(&PublicKey::from(honest.public())).is_ok());
/// // The identity point (y = 1) is a valid point of order 1: refused.
/// let mut identity = [0u8; 32];
/// identity[0] = 1;
/// let weak = PublicKey::from(ed25519::PublicKey::try_from_bytes(&identity).unwrap());
/// assert_eq!(kindred_proto::check_public_key(&weak), Err(kindred_proto::IdentityError::Weak));
/// ```
///
/// # Errors
/// The reason the key is refused.
pub fn check_public_key(key: &PublicKey) -> Result<(), IdentityError> {
    let key = key
        .clone()
        .try_into_ed25519()
        .map_err(|_| IdentityError::NotEd25519)?;
    strict_key(&key.to_bytes()).map(|_| ())
}

/// Check the identity a `PeerId` names: it must inline an ed25519 key (an identity multihash of
/// the key's protobuf encoding, as every ed25519 `PeerId` does) that passes [`check_public_key`].
///
/// ```
/// use libp2p_identity::{PublicKey, ed25519};
/// let honest = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([7u8; 32]).unwrap());
/// let peer = PublicKey::from(honest.public()).to_peer_id();
/// assert!(kindred_proto::check_peer(&peer).is_ok());
/// ```
///
/// # Errors
/// The reason the peer is refused.
pub fn check_peer(peer: &PeerId) -> Result<(), IdentityError> {
    // Multihash code 0x00: the identity hash, whose digest is the encoded key itself.
    let multihash = peer.as_ref();
    if multihash.code() != 0x00 {
        return Err(IdentityError::NotEd25519);
    }
    let key =
        PublicKey::try_decode_protobuf(multihash.digest()).map_err(|_| IdentityError::NotAKey)?;
    check_public_key(&key)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use curve25519_dalek::constants::EIGHT_TORSION;
    use libp2p_identity::ed25519;

    fn keypair(n: u8) -> ed25519::Keypair {
        ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([n; 32]).unwrap())
    }

    #[test]
    fn every_small_order_point_is_weak() {
        for point in EIGHT_TORSION {
            let bytes = point.compress().to_bytes();
            assert_eq!(
                strict_key(&bytes).err(),
                Some(IdentityError::Weak),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn the_small_order_table_is_the_torsion_subgroup() {
        let mut table = SMALL_ORDER_ENCODINGS;
        let mut torsion = EIGHT_TORSION.map(|p| p.compress().to_bytes());
        table.sort_unstable();
        torsion.sort_unstable();
        assert_eq!(table, torsion);
    }

    #[test]
    fn peer_id_bytes_match_libp2p() {
        let key = keypair(9);
        let peer = PublicKey::from(key.public()).to_peer_id();
        assert_eq!(peer.to_bytes(), peer_id_bytes(&key.public().to_bytes()));
    }

    #[test]
    fn strict_verification_refuses_a_small_order_r() {
        let key = keypair(9);
        let strict = strict_key(&key.public().to_bytes()).unwrap();
        let good = key.sign(b"m");
        assert!(verify_strict(&strict, b"m", &good));
        assert!(!verify_strict(&strict, b"n", &good));
        for r in SMALL_ORDER_ENCODINGS {
            let forged = [r, [0u8; 32]].concat();
            assert!(!verify_strict(&strict, b"m", &forged));
        }
    }

    #[test]
    fn every_non_reduced_y_is_refused() {
        // y = p + k for k in 0..19 (y = p + 1 is a second encoding of the identity point), with
        // either sign bit.
        let y = |low: u8, high: u8| {
            let mut bytes = [0xffu8; 32];
            bytes[0] = low;
            bytes[31] = high;
            bytes
        };
        for low in 0xedu8..=0xff {
            for high in [0x7f, 0xff] {
                assert_eq!(
                    strict_key(&y(low, high)).err(),
                    Some(IdentityError::NonCanonical)
                );
            }
        }
        // p - 1 (y = -1, the point of order 2) is reduced: refused as weak, not as non-canonical.
        assert_eq!(strict_key(&y(0xec, 0x7f)).err(), Some(IdentityError::Weak));
    }

    #[test]
    fn honest_key_passes() {
        let key = keypair(7);
        let public = PublicKey::from(key.public());
        assert!(check_public_key(&public).is_ok());
        assert!(check_peer(&public.to_peer_id()).is_ok());
    }
}
