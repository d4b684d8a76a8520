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

use ed25519_dalek::{Signature, VerifyingKey};
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

/// Parse a public key under the strict rule: 32 bytes, a canonical encoding, not of small order.
pub(crate) fn strict_key(bytes: &[u8]) -> Result<VerifyingKey, IdentityError> {
    let array: &[u8; PUBLIC_KEY_LEN] = bytes.try_into().map_err(|_| IdentityError::NotAKey)?;
    let key = VerifyingKey::from_bytes(array).map_err(|_| IdentityError::NotAKey)?;
    if key.to_edwards().compress().as_bytes() != array {
        return Err(IdentityError::NonCanonical);
    }
    if key.is_weak() {
        return Err(IdentityError::Weak);
    }
    Ok(key)
}

/// Verify `signature` over `message` under the strict rule (see the module docs).
pub(crate) fn verify_strict(key: &VerifyingKey, message: &[u8], signature: &[u8]) -> bool {
    Signature::from_slice(signature).is_ok_and(|s| key.verify_strict(message, &s).is_ok())
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

    #[test]
    fn every_small_order_point_is_weak() {
        for point in EIGHT_TORSION {
            let bytes = point.compress().to_bytes();
            assert_eq!(strict_key(&bytes).err(), Some(IdentityError::Weak), "{bytes:?}");
        }
    }

    #[test]
    fn non_canonical_encoding_is_refused() {
        // y = p + 1 ≡ 1: the identity point, encoded with y ≥ p.
        let mut bytes = [0xffu8; 32];
        bytes[0] = 0xee;
        bytes[31] = 0x7f;
        assert_eq!(strict_key(&bytes).err(), Some(IdentityError::NonCanonical));
    }

    #[test]
    fn honest_key_passes() {
        let key = libp2p_identity::ed25519::Keypair::from(
            libp2p_identity::ed25519::SecretKey::try_from_bytes([7u8; 32]).unwrap(),
        );
        let public = PublicKey::from(key.public());
        assert!(check_public_key(&public).is_ok());
        assert!(check_peer(&public.to_peer_id()).is_ok());
    }
}
