//! LEB128 varints, the same encoding postcard uses for integers: used where the codec reads a
//! length before handing bytes to postcard, and for delta-coded top-k indices.

use crate::error::{DecodeError, Part};

/// A varint error, before it is attributed to a part of the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VarintError {
    /// The bytes ended inside the varint.
    Truncated,
    /// Too many continuation bytes, or a value past the integer's range.
    Overflow,
    /// An overlong encoding: a final byte of zero after a continuation byte, which the shortest
    /// encoding of the same value would not have.
    NonCanonical,
}

impl VarintError {
    pub(crate) fn at(self, part: Part) -> DecodeError {
        match self {
            Self::Truncated => DecodeError::Truncated { part },
            Self::Overflow => DecodeError::Malformed {
                part,
                detail: "bad varint",
            },
            Self::NonCanonical => DecodeError::NonCanonical {
                part,
                detail: "overlong varint",
            },
        }
    }
}

/// Bytes of the varint of `v` (1 to 5).
#[inline]
pub(crate) fn len_u32(v: u32) -> usize {
    // One byte per started group of 7 bits, and one for zero.
    (32 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

pub(crate) fn encode_u32(mut v: u32, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Decode a `u32` varint from the front of `bytes`; returns it and the rest.
#[inline]
pub(crate) fn decode_u32(bytes: &[u8]) -> Result<(u32, &[u8]), VarintError> {
    // Fast path: one byte, the common case for top-k deltas.
    if let Some((&b, rest)) = bytes.split_first()
        && b < 0x80
    {
        return Ok((u32::from(b), rest));
    }
    let mut value = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(5) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            if b == 0 && i > 0 {
                return Err(VarintError::NonCanonical);
            }
            let value = u32::try_from(value).map_err(|_| VarintError::Overflow)?;
            return Ok((value, bytes.get(i + 1..).unwrap_or_default()));
        }
    }
    if bytes.len() < 5 {
        Err(VarintError::Truncated)
    } else {
        Err(VarintError::Overflow)
    }
}

/// Decode a `u16` varint from the front of `bytes`.
pub(crate) fn decode_u16(bytes: &[u8]) -> Result<(u16, &[u8]), VarintError> {
    let (v, rest) = decode_u32(bytes)?;
    let v = u16::try_from(v).map_err(|_| VarintError::Overflow)?;
    Ok((v, rest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(v: u32, tail: Vec<u8>) {
            let mut buf = Vec::new();
            encode_u32(v, &mut buf);
            let postcard = postcard::to_allocvec(&v).unwrap();
            prop_assert_eq!(&buf, &postcard);
            prop_assert_eq!(len_u32(v), buf.len());
            buf.extend_from_slice(&tail);
            let (d, rest) = decode_u32(&buf).unwrap();
            prop_assert_eq!(d, v);
            prop_assert_eq!(rest, &tail[..]);
        }
    }

    #[test]
    fn length_at_every_seven_bit_boundary() {
        for v in [
            0u32,
            1,
            127,
            128,
            16_383,
            16_384,
            (1 << 21) - 1,
            1 << 21,
            (1 << 28) - 1,
            1 << 28,
            u32::MAX,
        ] {
            let mut buf = Vec::new();
            encode_u32(v, &mut buf);
            assert_eq!(len_u32(v), buf.len(), "{v}");
        }
    }

    #[test]
    fn rejects_truncated_and_overlong() {
        assert_eq!(decode_u32(&[]), Err(VarintError::Truncated));
        assert_eq!(decode_u32(&[0x80, 0x80]), Err(VarintError::Truncated));
        assert_eq!(decode_u32(&[0xff; 6]), Err(VarintError::Overflow));
        // 2^32 does not fit a u32.
        assert_eq!(
            decode_u32(&[0x80, 0x80, 0x80, 0x80, 0x10]),
            Err(VarintError::Overflow)
        );
        assert_eq!(decode_u16(&[0x80, 0x80, 0x04]), Err(VarintError::Overflow));
        // Overlong forms of 0 and 1.
        assert_eq!(decode_u32(&[0x80, 0x00]), Err(VarintError::NonCanonical));
        assert_eq!(
            decode_u32(&[0x81, 0x80, 0x00]),
            Err(VarintError::NonCanonical)
        );
    }

    proptest! {
        /// Every accepted varint is the one encoding of its value.
        #[test]
        fn accepted_varints_are_canonical(bytes in proptest::collection::vec(any::<u8>(), 0..7)) {
            if let Ok((v, rest)) = decode_u32(&bytes) {
                let mut buf = Vec::new();
                encode_u32(v, &mut buf);
                prop_assert_eq!(&bytes[..bytes.len() - rest.len()], &buf[..]);
            }
        }
    }
}
