//! Semantic keys: LSH bands of an update's SimHash turned into DHT keys.
//!
//! libp2p-kad hashes every record key before measuring XOR distance, so keys that differ in one
//! bit land on unrelated nodes; locality cannot come from the DHT's geometry. It comes instead
//! from *exact-bucket rendezvous*: the 256-bit SimHash is cut into `L` bands of `b` bits, and band
//! `i` with value `v` becomes the key
//!
//! ```text
//! key_i = blake3(domain ‖ network id ‖ model id ‖ round window ‖ L ‖ b ‖ i ‖ v)
//! ```
//!
//! Two updates at angle θ agree on one SimHash bit with probability `1 − θ/π`, so on a whole band
//! with probability `(1 − θ/π)^b`, and on at least one of `L` bands with probability
//! `1 − (1 − (1 − θ/π)^b)^L`: near-identical updates almost surely meet under some key, unrelated
//! ones almost never do. Each key is one O(log N) provider lookup.
//!
//! **Multi-probe** ([`ProbeSequence`]) recovers neighbours that missed every band by a bit or
//! two: a bit whose projection was close to zero (a small *margin*) is the likeliest to differ in
//! a similar update, so probes flip the lowest-margin bits first, in increasing order of the
//! summed margins of the flipped bits (the query-directed probing of Lv et al., 2007).
//!
//! **Sharding** spreads a hot key, one whose provider count passes a threshold, over several
//! salted keys ([`shard_key`]); an announcer picks one shard from its own id ([`announce_shard`])
//! and a looker queries them all. [`next_shard_count`] is the pure policy that grows and shrinks
//! the shard count from observed provider counts.
//!
//! **On the wire** a semantic key is not sent as its 32 raw bytes: [`dht_key`] wraps the blake3
//! digest as a binary CIDv1 (`0x01` version, `0x55` raw codec, then the multihash: `0x1e` blake3,
//! `0x20` length, the digest; 36 bytes), and that is the Kademlia record key of every
//! `ADD_PROVIDER` and `GET_PROVIDERS`. Why a CID and not a bare multihash: libp2p-kad (Rust) and
//! go-libp2p-kad-dht take provider keys as opaque bytes (go only caps them at 80 bytes), but
//! js-libp2p's kad-dht decodes every provider key with `CID.decode` and answers "Invalid CID"
//! otherwise. `CID.decode` reads a bare multihash as a CIDv0 only when it is sha2-256
//! (`0x12 0x20 …`); a bare blake3 multihash (`0x1e 0x20 …`) reads as "CID version 30" and is
//! refused. A CIDv1 is accepted by all three, names the hash function honestly, and still carries
//! the standard multihash (bytes `2..`). The derivation of the digest itself is unchanged, and
//! the RPCs (`GetHeaders` by key) keep using the 32-byte [`SemanticKey`].
//!
//! Everything here is a pure function of its inputs, allocation-free except the probe heap, and
//! independent of libp2p types, so the simulator can call the same code for 10^6 virtual nodes.
//!
//! ```
//! use kindred_proto::{ModelId, SimHash};
//! use kindred_routing::keys::*;
//!
//! let ctx = KeyContext::new(NetworkId::from_name("demo"), ModelId([7; 32]), RoundWindow(3), KeyConfig::default());
//! let a = SimHash([0b1010_1010; 32]);
//! let mut b = a;
//! b.0[0] ^= 1; // differs in one bit, so in exactly one band
//! let ka: Vec<_> = ctx.band_keys(&a).collect();
//! let kb: Vec<_> = ctx.band_keys(&b).collect();
//! assert_eq!(ka.iter().zip(&kb).filter(|(x, y)| x == y).count(), 15);
//! ```

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use kindred_proto::{ModelId, SIMHASH_BITS, SimHash};

/// A 32-byte semantic key (a blake3 digest). Plain bytes so that callers outside libp2p (the
/// simulator) can use them; the libp2p layer turns them into `kad::RecordKey`s of [`dht_key`].
pub type SemanticKey = [u8; 32];

/// Multicodec of the blake3 hash function, as a multihash code.
pub const BLAKE3_MULTIHASH_CODE: u8 = 0x1e;
/// Multicodec of raw binary content, as a CIDv1 codec.
pub const RAW_CODEC: u8 = 0x55;
/// Prefix of every DHT key: CID version 1, raw codec, blake3 multihash of 32 bytes (each a
/// one-byte varint).
const DHT_KEY_PREFIX: [u8; 4] = [0x01, RAW_CODEC, BLAKE3_MULTIHASH_CODE, 32];
/// Length of a DHT key: the 4-byte CID/multihash prefix and the 32-byte digest.
pub const DHT_KEY_LEN: usize = DHT_KEY_PREFIX.len() + 32;

/// The Kademlia record key under which `key` is provided and looked up: the binary CIDv1
/// `0x01 0x55 0x1e 0x20 ‖ key` (raw codec, blake3 multihash). See the module docs for why a CID.
///
/// ```
/// use kindred_routing::keys::{dht_key, semantic_key_of};
/// let key = [7u8; 32];
/// let wire = dht_key(&key);
/// assert_eq!(wire[..4], [0x01, 0x55, 0x1e, 0x20]);
/// assert_eq!(semantic_key_of(&wire), Some(key));
/// ```
pub fn dht_key(key: &SemanticKey) -> [u8; DHT_KEY_LEN] {
    let mut out = [0u8; DHT_KEY_LEN];
    let (prefix, digest) = out.split_at_mut(DHT_KEY_PREFIX.len());
    prefix.copy_from_slice(&DHT_KEY_PREFIX);
    digest.copy_from_slice(key);
    out
}

/// The semantic key inside a DHT key, if `bytes` is exactly one made by [`dht_key`].
pub fn semantic_key_of(bytes: &[u8]) -> Option<SemanticKey> {
    let digest = bytes.strip_prefix(DHT_KEY_PREFIX.as_slice())?;
    digest.try_into().ok()
}

const BAND_DOMAIN: &[u8] = b"kindred/lsh-band-key/v1\0";
const SHARD_DOMAIN: &[u8] = b"kindred/lsh-shard/v1\0";
const ANNOUNCE_SHARD_DOMAIN: &[u8] = b"kindred/announce-shard/v1\0";
const LOOKUP_SHARD_DOMAIN: &[u8] = b"kindred/lookup-shard/v1\0";

/// Identifies one Kindred network (deployment); keys of different networks never collide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NetworkId(pub [u8; 32]);

impl NetworkId {
    /// The id of a network named by a human-readable string.
    pub fn from_name(name: &str) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(b"kindred/network/v1\0");
        h.update(name.as_bytes());
        Self(*h.finalize().as_bytes())
    }
}

/// A window of consecutive rounds under which keys are announced and looked up, named by its
/// first round ([`crate::Discovery::window`] says which window a round is in).
///
/// Keys change with the window, so stale announcements stop matching on their own and the DHT
/// never accumulates providers across windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RoundWindow(pub u64);

/// How a SimHash is cut into bands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyConfig {
    bands: u16,
    band_bits: u8,
    /// Whether the bands move along the SimHash from one round window to the next
    /// ([`KeyConfig::rotating`]).
    rotate: bool,
    /// The bit band 0 starts at ([`KeyConfig::at_window`]).
    offset: u16,
}

/// Why a [`KeyConfig`] is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyConfigError {
    /// Band width outside `1..=64`.
    #[error("band width {0} is outside 1..=64 bits")]
    BandBits(u8),
    /// No bands, or the bands need more bits than the SimHash has.
    #[error("{bands} bands of {band_bits} bits do not fit a {SIMHASH_BITS}-bit SimHash")]
    Bands {
        /// Bands asked for.
        bands: u16,
        /// Bits per band.
        band_bits: u8,
    },
}

impl KeyConfig {
    /// `bands` bands of `band_bits` bits each, taken from the front of the SimHash.
    ///
    /// # Errors
    /// [`KeyConfigError`] when a band is wider than 64 bits or narrower than 1, or the bands do
    /// not fit in the 256-bit signature.
    pub fn new(bands: u16, band_bits: u8) -> Result<Self, KeyConfigError> {
        if band_bits == 0 || band_bits > 64 {
            return Err(KeyConfigError::BandBits(band_bits));
        }
        if bands == 0 || usize::from(bands) * usize::from(band_bits) > SIMHASH_BITS {
            return Err(KeyConfigError::Bands { bands, band_bits });
        }
        Ok(Self {
            bands,
            band_bits,
            rotate: false,
            offset: 0,
        })
    }

    /// The same bands, moved along the SimHash in each round window: window `w`'s bands start
    /// at bit `w·L·b` (modulo the positions where they fit). Few, narrow bands read a small
    /// part of the signature; two cohorts of one task whose hubs' signatures differ in those
    /// bits never find each other through them, window after window. Moving the bands gives
    /// every window a fresh draw of bits. Bands that fill the signature do not move.
    ///
    /// ```
    /// use kindred_routing::keys::{KeyConfig, RoundWindow};
    ///
    /// let keys = KeyConfig::new(3, 4).unwrap().rotating();
    /// assert_eq!(keys.at_window(RoundWindow(0)).offset(), 0);
    /// assert_eq!(keys.at_window(RoundWindow(1)).offset(), 12);
    /// assert_eq!(KeyConfig::new(3, 4).unwrap().at_window(RoundWindow(1)).offset(), 0);
    /// ```
    pub fn rotating(mut self) -> Self {
        self.rotate = true;
        self
    }

    /// The layout of window `window`: for rotating bands ([`KeyConfig::rotating`]), where they
    /// start in it.
    pub fn at_window(mut self, window: RoundWindow) -> Self {
        let used = self.bands().saturating_mul(self.band_bits());
        let positions = SIMHASH_BITS.saturating_sub(used).saturating_add(1) as u64;
        self.offset = if self.rotate {
            let step = used as u64;
            u16::try_from(window.0.wrapping_mul(step) % positions.max(1)).unwrap_or(0)
        } else {
            0
        };
        self
    }

    /// The bit band 0 starts at (0 unless [`KeyConfig::rotating`]).
    pub fn offset(&self) -> usize {
        usize::from(self.offset)
    }

    /// Number of bands `L`.
    pub fn bands(&self) -> usize {
        usize::from(self.bands)
    }

    /// Bits per band `b`.
    pub fn band_bits(&self) -> usize {
        usize::from(self.band_bits)
    }

    /// Value of band `band` of `simhash` (bit `offset + band·b` lowest). Bands past the end
    /// read as zero.
    pub fn band_value(&self, simhash: &SimHash, band: usize) -> u64 {
        simhash.bits(self.offset() + band * self.band_bits(), self.band_bits())
    }
}

impl Default for KeyConfig {
    /// 16 bands of 16 bits.
    fn default() -> Self {
        Self {
            bands: 16,
            band_bits: 16,
            rotate: false,
            offset: 0,
        }
    }
}

/// Everything a key depends on besides the band: network, model, round window and band layout.
///
/// Built once per (model, window); deriving a key then costs one short blake3 update.
#[derive(Clone)]
pub struct KeyContext {
    config: KeyConfig,
    window: RoundWindow,
    prefix: blake3::Hasher,
}

impl std::fmt::Debug for KeyContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyContext")
            .field("config", &self.config)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

impl KeyContext {
    /// The context for keys of `model` in `window` on `network`.
    pub fn new(network: NetworkId, model: ModelId, window: RoundWindow, config: KeyConfig) -> Self {
        let config = config.at_window(window);
        let mut prefix = blake3::Hasher::new();
        prefix.update(BAND_DOMAIN);
        prefix.update(&network.0);
        prefix.update(&model.0);
        prefix.update(&window.0.to_le_bytes());
        prefix.update(&config.bands.to_le_bytes());
        prefix.update(&[config.band_bits]);
        Self {
            config,
            window,
            prefix,
        }
    }

    /// The band layout, as of its window ([`KeyConfig::at_window`]).
    pub fn config(&self) -> KeyConfig {
        self.config
    }

    /// The round window.
    pub fn window(&self) -> RoundWindow {
        self.window
    }

    /// The key of band `band` holding `value` (only the low `b` bits of `value` count).
    pub fn band_key(&self, band: usize, value: u64) -> SemanticKey {
        let bits = self.config.band_bits();
        let value = if bits == 64 {
            value
        } else {
            value & ((1u64 << bits) - 1)
        };
        let mut h = self.prefix.clone();
        h.update(&(band as u16).to_le_bytes());
        h.update(&value.to_le_bytes());
        *h.finalize().as_bytes()
    }

    /// The `L` band keys of a signature, band 0 first.
    pub fn band_keys<'a>(&'a self, simhash: &'a SimHash) -> impl Iterator<Item = SemanticKey> + 'a {
        (0..self.config.bands()).map(move |i| self.band_key(i, self.config.band_value(simhash, i)))
    }

    /// The key a probe stands for.
    pub fn probe_key(&self, probe: &Probe) -> SemanticKey {
        self.band_key(usize::from(probe.band), probe.value)
    }
}

/// Salted shard `shard` of a hot key; shard 0 is the key itself.
///
/// ```
/// use kindred_routing::keys::shard_key;
/// let k = [5u8; 32];
/// assert_eq!(shard_key(&k, 0), k);
/// assert_ne!(shard_key(&k, 1), k);
/// assert_ne!(shard_key(&k, 1), shard_key(&k, 2));
/// ```
pub fn shard_key(key: &SemanticKey, shard: u32) -> SemanticKey {
    if shard == 0 {
        return *key;
    }
    let mut h = blake3::Hasher::new();
    h.update(SHARD_DOMAIN);
    h.update(key);
    h.update(&shard.to_le_bytes());
    *h.finalize().as_bytes()
}

/// The shard (in `0..shards`) an announcer with identity bytes `salt` (its peer id) uses for
/// `key`: a deterministic, uniform choice, so announcers spread evenly and each stays put.
pub fn announce_shard(salt: &[u8], key: &SemanticKey, shards: u32) -> u32 {
    if shards <= 1 {
        return 0;
    }
    salted_shard(ANNOUNCE_SHARD_DOMAIN, salt, key, shards)
}

/// A uniform, deterministic shard in `0..shards` (`shards` ≥ 1) for `salt` and `key`.
fn salted_shard(domain: &[u8], salt: &[u8], key: &SemanticKey, shards: u32) -> u32 {
    let mut h = blake3::Hasher::new();
    h.update(domain);
    h.update(salt);
    h.update(key);
    let hash = h.finalize();
    let word = hash
        .as_bytes()
        .first_chunk::<8>()
        .copied()
        .unwrap_or_default();
    (u64::from_le_bytes(word) % u64::from(shards.max(1))) as u32
}

/// The shards of a key split `shards` ways that a looker with identity bytes `salt` asks when it
/// asks at most `limit` of them: all of them when `limit` is 0 or covers them, otherwise `limit`
/// consecutive shards (wrapping) from a start drawn from `salt` and the key. Keys change every
/// window, so the same looker reads different shards in different windows, and different
/// lookers spread over every shard.
///
/// ```
/// use kindred_routing::keys::lookup_shards;
/// let k = [5u8; 32];
/// assert_eq!(lookup_shards(b"peer", &k, 4, 16).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
/// let two: Vec<u32> = lookup_shards(b"peer", &k, 16, 2).collect();
/// assert_eq!(two.len(), 2);
/// assert_eq!(two[1], (two[0] + 1) % 16);
/// ```
pub fn lookup_shards(
    salt: &[u8],
    key: &SemanticKey,
    shards: u32,
    limit: u32,
) -> impl Iterator<Item = u32> + use<> {
    let shards = shards.max(1);
    let (start, count) = if limit == 0 || limit >= shards {
        (0, shards)
    } else {
        (salted_shard(LOOKUP_SHARD_DOMAIN, salt, key, shards), limit)
    };
    (0..count).map(move |k| (start + k) % shards)
}

/// When to split or merge a key's shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardPolicy {
    /// A key (all its shards together) with at least this many providers per shard is hot: its
    /// shard count doubles for the next window.
    pub threshold: usize,
    /// Upper bound on shards per key (a power of two).
    pub max_shards: u32,
}

impl Default for ShardPolicy {
    /// Split at 5 providers per shard, up to 16 shards. libp2p-kad returns at most `k`
    /// providers per response (`k = 5` in [`crate::KadConfig`]'s default), so a key whose
    /// holders return `k` providers is saturated: anyone past the first `k` is invisible until
    /// the key is split.
    fn default() -> Self {
        Self {
            threshold: 5,
            max_shards: 16,
        }
    }
}

/// The shard count to use next, given the current count and the providers seen over all current
/// shards: doubles while each shard holds `threshold` or more, halves once they hold under a
/// quarter of it, and stays within `1..=max_shards`.
///
/// ```
/// use kindred_routing::keys::{next_shard_count, ShardPolicy};
/// let p = ShardPolicy { threshold: 20, max_shards: 16 };
/// assert_eq!(next_shard_count(1, 25, p), 2);
/// assert_eq!(next_shard_count(2, 30, p), 2);
/// assert_eq!(next_shard_count(4, 8, p), 2);
/// assert_eq!(next_shard_count(16, 10_000, p), 16);
/// ```
pub fn next_shard_count(current: u32, providers: usize, policy: ShardPolicy) -> u32 {
    let current = current.clamp(1, policy.max_shards.max(1));
    let per_shard = providers / current as usize;
    if per_shard >= policy.threshold.max(1) {
        (current * 2).min(policy.max_shards.max(1))
    } else if current > 1 && per_shard * 4 < policy.threshold {
        current / 2
    } else {
        current
    }
}

/// One multi-probe: band `band` with the bits in `flipped` (band-local positions) inverted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probe {
    /// Which band.
    pub band: u16,
    /// The probed band value (the signature's value with `flipped` bits inverted).
    pub value: u64,
    /// Band-local bit positions that were flipped.
    pub flipped: u64,
    /// Sum of the margins of the flipped bits: lower is likelier to hold a neighbour.
    pub score: f32,
}

/// Why a probe sequence cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// Margins must give one value per SimHash bit.
    #[error("expected {SIMHASH_BITS} margins (one per SimHash bit), got {found}")]
    MarginCount {
        /// Margins given.
        found: usize,
    },
}

/// A heap entry: a set of indices into one band's margin-sorted bits.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    score: f32,
    band: u16,
    /// Bit `j` set: the `j`-th lowest-margin bit of the band is flipped.
    set: u64,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    /// Reversed, so that `BinaryHeap` pops the lowest score first; ties broken by band and set
    /// for a deterministic order.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .score
            .total_cmp(&self.score)
            .then_with(|| other.band.cmp(&self.band))
            .then_with(|| other.set.cmp(&self.set))
    }
}

/// Multi-probe perturbations of a signature, cheapest (lowest summed margin) first.
///
/// An iterator of [`Probe`]s over every non-empty set of bits within one band, all bands merged,
/// in non-decreasing score order. Uses the shift/expand generation of Lv et al.: each band's bits
/// are sorted by margin, sets are index sets into that order, and each popped set pushes its
/// *shift* (largest index + 1) and *expand* (add largest index + 1) successors, which never score
/// lower. The heap holds at most `L + 2·(probes taken)` entries.
///
/// ```
/// use kindred_proto::SimHash;
/// use kindred_routing::keys::{KeyConfig, ProbeSequence};
///
/// let mut margins = vec![1.0f32; 256];
/// margins[37] = 0.01; // bit 5 of band 2 is nearly undecided
/// margins[200] = 0.02; // bit 8 of band 12
/// let probes: Vec<_> = ProbeSequence::new(&SimHash::default(), &margins, KeyConfig::default())?
///     .take(2)
///     .collect();
/// assert_eq!((probes[0].band, probes[0].value), (2, 1 << 5));
/// assert_eq!((probes[1].band, probes[1].value), (12, 1 << 8));
/// # Ok::<(), kindred_routing::keys::ProbeError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ProbeSequence {
    config: KeyConfig,
    /// Band values of the signature.
    values: [u64; SIMHASH_BITS],
    /// For band `i`, entries `i·b..(i+1)·b`: band-local bit positions sorted by margin.
    order: [u8; SIMHASH_BITS],
    /// Margins aligned with `order`.
    sorted: [f32; SIMHASH_BITS],
    heap: BinaryHeap<Candidate>,
}

impl ProbeSequence {
    /// Probes of `simhash` given its per-bit `margins` (|projection| of each SimHash bit; NaN is
    /// treated as +∞, i.e. never flipped early, and negative values by magnitude).
    ///
    /// # Errors
    /// [`ProbeError::MarginCount`] unless there is exactly one margin per SimHash bit.
    pub fn new(simhash: &SimHash, margins: &[f32], config: KeyConfig) -> Result<Self, ProbeError> {
        if margins.len() != SIMHASH_BITS {
            return Err(ProbeError::MarginCount {
                found: margins.len(),
            });
        }
        let b = config.band_bits();
        let mut values = [0u64; SIMHASH_BITS];
        let mut order = [0u8; SIMHASH_BITS];
        let mut sorted = [f32::INFINITY; SIMHASH_BITS];
        let mut heap = BinaryHeap::with_capacity(config.bands() * 3);
        for band in 0..config.bands() {
            if let Some(v) = values.get_mut(band) {
                *v = config.band_value(simhash, band);
            }
            let start = band * b;
            let bit = config.offset() + start;
            let (Some(ord), Some(srt), Some(m)) = (
                order.get_mut(start..start + b),
                sorted.get_mut(start..start + b),
                margins.get(bit..bit + b),
            ) else {
                continue;
            };
            for (j, o) in ord.iter_mut().enumerate() {
                *o = j as u8;
            }
            let key = |j: &u8| {
                let x = m.get(usize::from(*j)).copied().unwrap_or(f32::INFINITY);
                if x.is_nan() { f32::INFINITY } else { x.abs() }
            };
            ord.sort_by(|x, y| key(x).total_cmp(&key(y)).then(x.cmp(y)));
            for (s, o) in srt.iter_mut().zip(ord.iter()) {
                *s = key(o);
            }
            heap.push(Candidate {
                score: srt.first().copied().unwrap_or(f32::INFINITY),
                band: band as u16,
                set: 1,
            });
        }
        Ok(Self {
            config,
            values,
            order,
            sorted,
            heap,
        })
    }

    fn margin(&self, band: u16, j: u32) -> f32 {
        let idx = usize::from(band) * self.config.band_bits() + j as usize;
        self.sorted.get(idx).copied().unwrap_or(f32::INFINITY)
    }
}

impl Iterator for ProbeSequence {
    type Item = Probe;

    fn next(&mut self) -> Option<Probe> {
        let c = self.heap.pop()?;
        let b = self.config.band_bits() as u32;
        let top = 63 - c.set.leading_zeros(); // largest index in the set
        if top + 1 < b {
            let next = 1u64 << (top + 1);
            let shift_score = c.score - self.margin(c.band, top) + self.margin(c.band, top + 1);
            self.heap.push(Candidate {
                score: shift_score,
                band: c.band,
                set: (c.set & !(1u64 << top)) | next,
            });
            self.heap.push(Candidate {
                score: c.score + self.margin(c.band, top + 1),
                band: c.band,
                set: c.set | next,
            });
        }
        let base = usize::from(c.band) * self.config.band_bits();
        let mut flipped = 0u64;
        let mut rest = c.set;
        while rest != 0 {
            let j = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let pos = self.order.get(base + j).copied().unwrap_or(0);
            flipped |= 1u64 << pos;
        }
        let value = self.values.get(usize::from(c.band)).copied().unwrap_or(0) ^ flipped;
        Some(Probe {
            band: c.band,
            value,
            flipped,
            score: c.score,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;

    fn ctx(window: u64) -> KeyContext {
        KeyContext::new(
            NetworkId::from_name("test"),
            ModelId([1; 32]),
            RoundWindow(window),
            KeyConfig::default(),
        )
    }

    fn lcg_hash(seed: u64) -> SimHash {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let mut out = [0u8; 32];
        for b in &mut out {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *b = (s >> 33) as u8;
        }
        SimHash(out)
    }

    /// DHT keys are binary CIDv1s whose multihash (blake3, 32 bytes) is the semantic key, as
    /// libp2p's own multihash parser reads them.
    #[test]
    fn dht_keys_are_blake3_multihashes_in_a_cid() {
        let key = ctx(4).band_key(2, 0xbeef);
        let wire = dht_key(&key);
        assert_eq!(wire.len(), 36);
        // CID version 1, raw codec.
        assert_eq!(wire[..2], [0x01, 0x55]);
        let mh = libp2p::multihash::Multihash::<64>::from_bytes(&wire[2..]).unwrap();
        assert_eq!(mh.code(), 0x1e);
        assert_eq!(mh.size(), 32);
        assert_eq!(mh.digest(), key);
        assert_eq!(mh.to_bytes(), wire[2..]);
        // Golden bytes: the derivation of the digest is unchanged, only the framing is new.
        let mut expected = vec![0x01, 0x55, 0x1e, 0x20];
        expected.extend_from_slice(&key);
        assert_eq!(wire.to_vec(), expected);
        // Distinct semantic keys stay distinct; the framing round-trips and rejects anything else.
        assert_ne!(dht_key(&ctx(4).band_key(2, 0xbeee)), wire);
        assert_eq!(semantic_key_of(&wire), Some(key));
        assert_eq!(semantic_key_of(&key), None);
        assert_eq!(semantic_key_of(&wire[..35]), None);
        let mut sha = wire;
        sha[2] = 0x12;
        assert_eq!(semantic_key_of(&sha), None);
    }

    #[test]
    fn config_validation() {
        assert!(KeyConfig::new(16, 16).is_ok());
        assert!(KeyConfig::new(4, 64).is_ok());
        assert!(KeyConfig::new(256, 1).is_ok());
        assert_eq!(KeyConfig::new(1, 0), Err(KeyConfigError::BandBits(0)));
        assert_eq!(KeyConfig::new(1, 65), Err(KeyConfigError::BandBits(65)));
        assert!(KeyConfig::new(17, 16).is_err());
        assert!(KeyConfig::new(0, 16).is_err());
    }

    #[test]
    fn band_keys_follow_the_formula() {
        let c = ctx(9);
        let sh = lcg_hash(3);
        let keys: Vec<_> = c.band_keys(&sh).collect();
        assert_eq!(keys.len(), 16);
        for (i, key) in keys.iter().enumerate() {
            let mut h = blake3::Hasher::new();
            h.update(BAND_DOMAIN);
            h.update(&NetworkId::from_name("test").0);
            h.update(&[1u8; 32]);
            h.update(&9u64.to_le_bytes());
            h.update(&16u16.to_le_bytes());
            h.update(&[16u8]);
            h.update(&(i as u16).to_le_bytes());
            h.update(&sh.bits(i * 16, 16).to_le_bytes());
            assert_eq!(key, h.finalize().as_bytes());
        }
    }

    #[test]
    fn keys_depend_on_every_input() {
        let sh = lcg_hash(1);
        let base: Vec<_> = ctx(1).band_keys(&sh).collect();
        let other_window: Vec<_> = ctx(2).band_keys(&sh).collect();
        let other_model: Vec<_> = KeyContext::new(
            NetworkId::from_name("test"),
            ModelId([2; 32]),
            RoundWindow(1),
            KeyConfig::default(),
        )
        .band_keys(&sh)
        .collect();
        let other_net: Vec<_> = KeyContext::new(
            NetworkId::from_name("other"),
            ModelId([1; 32]),
            RoundWindow(1),
            KeyConfig::default(),
        )
        .band_keys(&sh)
        .collect();
        let other_layout: Vec<_> = KeyContext::new(
            NetworkId::from_name("test"),
            ModelId([1; 32]),
            RoundWindow(1),
            KeyConfig::new(8, 32).unwrap(),
        )
        .band_keys(&sh)
        .collect();
        for other in [&other_window, &other_model, &other_net, &other_layout] {
            assert!(base.iter().all(|k| !other.contains(k)));
        }
        // All 16 keys of one signature are distinct (band index is hashed in).
        let mut sorted = base.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 16);
    }

    #[test]
    fn a_flipped_bit_changes_exactly_its_band() {
        let c = ctx(0);
        let sh = lcg_hash(11);
        let base: Vec<_> = c.band_keys(&sh).collect();
        for bit in [0usize, 15, 16, 100, 255] {
            let mut other = sh;
            other.0[bit / 8] ^= 1 << (bit % 8);
            let keys: Vec<_> = c.band_keys(&other).collect();
            for (band, (a, b)) in base.iter().zip(&keys).enumerate() {
                assert_eq!(a == b, band != bit / 16, "bit {bit} band {band}");
            }
        }
    }

    #[test]
    fn band_key_masks_high_bits() {
        let c = ctx(0);
        assert_eq!(c.band_key(3, 0x1_0005), c.band_key(3, 0x5));
        let wide = KeyContext::new(
            NetworkId::from_name("x"),
            ModelId([0; 32]),
            RoundWindow(0),
            KeyConfig::new(4, 64).unwrap(),
        );
        assert_ne!(wide.band_key(0, u64::MAX), wide.band_key(0, u64::MAX >> 1));
    }

    #[test]
    fn probes_come_in_nondecreasing_score_order_and_are_unique() {
        let sh = lcg_hash(5);
        let margins: Vec<f32> = (0..256)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let probes: Vec<_> = ProbeSequence::new(&sh, &margins, KeyConfig::default())
            .unwrap()
            .take(2000)
            .collect();
        assert_eq!(probes.len(), 2000);
        for w in probes.windows(2) {
            assert!(w[0].score <= w[1].score, "{:?} then {:?}", w[0], w[1]);
        }
        let mut seen = std::collections::HashSet::new();
        for p in &probes {
            assert_ne!(p.flipped, 0);
            assert!(seen.insert((p.band, p.flipped)), "duplicate probe {p:?}");
            // The value is the band with exactly the flipped bits inverted.
            let orig = KeyConfig::default().band_value(&sh, usize::from(p.band));
            assert_eq!(orig ^ p.value, p.flipped);
            // The score is the sum of the flipped bits' margins.
            let mut sum = 0.0f32;
            for j in 0..16 {
                if p.flipped >> j & 1 == 1 {
                    sum += margins[usize::from(p.band) * 16 + j];
                }
            }
            assert!((sum - p.score).abs() < 1e-3, "{sum} vs {}", p.score);
        }
    }

    #[test]
    fn first_probes_are_the_lowest_margin_single_bits() {
        let sh = lcg_hash(8);
        let margins: Vec<f32> = (0..256).map(|i| 1.0 + ((i * 37) % 256) as f32).collect();
        let mut by_margin: Vec<usize> = (0..256).collect();
        by_margin.sort_by(|&a, &b| margins[a].total_cmp(&margins[b]));
        // With all margins ≥ 1 and distinct, the cheapest pair costs more than the three
        // cheapest single bits.
        let probes: Vec<_> = ProbeSequence::new(&sh, &margins, KeyConfig::default())
            .unwrap()
            .take(3)
            .collect();
        for (p, &bit) in probes.iter().zip(&by_margin) {
            assert_eq!(usize::from(p.band), bit / 16);
            assert_eq!(p.flipped, 1 << (bit % 16));
        }
    }

    #[test]
    fn rotating_bands_read_and_probe_the_bits_of_their_window() {
        let sh = lcg_hash(9);
        let keys = KeyConfig::new(3, 4).unwrap().rotating();
        for w in 0..30u64 {
            let at = keys.at_window(RoundWindow(w));
            let offset = at.offset();
            assert!(offset + 12 <= SIMHASH_BITS, "window {w}: {offset}");
            for band in 0..3 {
                assert_eq!(at.band_value(&sh, band), sh.bits(offset + 4 * band, 4));
            }
            // The context of a window uses that window's bands.
            let ctx = KeyContext::new(
                NetworkId::from_name("t"),
                ModelId([1; 32]),
                RoundWindow(w),
                keys,
            );
            assert_eq!(ctx.config().offset(), offset);
            // The cheapest margin inside the window's bands is the first probe.
            let mut margins = vec![10.0f32; SIMHASH_BITS];
            margins[offset + 6] = 0.1;
            let first = ProbeSequence::new(&sh, &margins, at)
                .unwrap()
                .next()
                .unwrap();
            assert_eq!((first.band, first.flipped), (1, 1 << 2));
        }
        // Windows draw different bits; bands that fill the signature never move.
        assert_ne!(
            keys.at_window(RoundWindow(1)).offset(),
            keys.at_window(RoundWindow(2)).offset()
        );
        let full = KeyConfig::default().rotating();
        assert_eq!(full.at_window(RoundWindow(7)).offset(), 0);
    }

    #[test]
    fn probe_sequence_is_exhaustive_for_small_bands() {
        let config = KeyConfig::new(2, 3).unwrap();
        let margins = vec![0.5f32; 256];
        let n = ProbeSequence::new(&SimHash::default(), &margins, config)
            .unwrap()
            .count();
        assert_eq!(n, 2 * 7);
    }

    #[test]
    fn odd_margins_are_handled() {
        assert_eq!(
            ProbeSequence::new(&SimHash::default(), &[1.0; 10], KeyConfig::default()).err(),
            Some(ProbeError::MarginCount { found: 10 })
        );
        let mut margins = vec![f32::NAN; 256];
        margins[3] = -0.5;
        let first = ProbeSequence::new(&SimHash::default(), &margins, KeyConfig::default())
            .unwrap()
            .next()
            .unwrap();
        assert_eq!((first.band, first.flipped), (0, 1 << 3));
        assert_eq!(first.score, 0.5);
    }

    #[test]
    fn shard_keys_and_announce_shards() {
        let key = [9u8; 32];
        let shards: std::collections::HashSet<_> = (0..16).map(|s| shard_key(&key, s)).collect();
        assert_eq!(shards.len(), 16);
        assert_eq!(announce_shard(b"peer", &key, 1), 0);
        assert_eq!(announce_shard(b"peer", &key, 0), 0);
        let mut counts = [0usize; 4];
        for i in 0..4000u32 {
            let s = announce_shard(&i.to_le_bytes(), &key, 4);
            assert_eq!(s, announce_shard(&i.to_le_bytes(), &key, 4));
            counts[s as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn lookup_shards_cover_all_or_a_spread_run() {
        let key = [9u8; 32];
        assert_eq!(lookup_shards(b"p", &key, 0, 2).collect::<Vec<_>>(), vec![0]);
        assert_eq!(lookup_shards(b"p", &key, 1, 0).collect::<Vec<_>>(), vec![0]);
        assert_eq!(lookup_shards(b"p", &key, 8, 8).count(), 8);
        // 0: no limit.
        assert_eq!(lookup_shards(b"p", &key, 8, 0).count(), 8);
        let mut starts = std::collections::HashSet::new();
        for i in 0u32..200 {
            let salt = i.to_le_bytes();
            let run: Vec<u32> = lookup_shards(&salt, &key, 16, 2).collect();
            assert_eq!(run.len(), 2);
            assert!(run.iter().all(|&s| s < 16));
            assert_eq!(run, lookup_shards(&salt, &key, 16, 2).collect::<Vec<_>>());
            assert_ne!(run[0], run[1]);
            starts.insert(run[0]);
        }
        // Lookers spread over every shard.
        assert_eq!(starts.len(), 16);
    }

    #[test]
    fn shard_policy_grows_and_shrinks() {
        let p = ShardPolicy {
            threshold: 20,
            max_shards: 8,
        };
        assert_eq!(next_shard_count(1, 0, p), 1);
        assert_eq!(next_shard_count(1, 19, p), 1);
        assert_eq!(next_shard_count(1, 20, p), 2);
        assert_eq!(next_shard_count(2, 40, p), 4);
        assert_eq!(next_shard_count(8, 1000, p), 8);
        assert_eq!(next_shard_count(8, 30, p), 4);
        assert_eq!(next_shard_count(2, 9, p), 1);
        assert_eq!(next_shard_count(0, 5, p), 1);
        assert_eq!(next_shard_count(100, 5, p), 4);
    }

    /// Similar signatures meet under some band at the rate LSH predicts; unrelated ones do not.
    #[test]
    fn collision_rates() {
        let c = ctx(0);
        let trials = 400u64;
        let mut rng = 12345u64;
        let mut next = move || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as usize
        };
        // 32 distinct flipped bits of 256: all 16 bands hit with probability ≈ 0.11 (by
        // enumeration), so they share a band ≈ 89% of the time.
        let mut met = 0;
        for t in 0..trials {
            let a = lcg_hash(t);
            let mut b = a;
            let mut flipped = std::collections::HashSet::new();
            while flipped.len() < 32 {
                let i = next() % 256;
                if flipped.insert(i) {
                    b.0[i / 8] ^= 1 << (i % 8);
                }
            }
            let ka: Vec<_> = c.band_keys(&a).collect();
            if c.band_keys(&b).any(|k| ka.contains(&k)) {
                met += 1;
            }
        }
        let rate = met as f64 / trials as f64;
        assert!((0.8..0.97).contains(&rate), "rate {rate}");
        // Unrelated signatures: 16 bands × 2^-16 chance each.
        let unrelated = (0..trials)
            .filter(|&t| {
                let ka: Vec<_> = c.band_keys(&lcg_hash(t)).collect();
                c.band_keys(&lcg_hash(t + 50_000)).any(|k| ka.contains(&k))
            })
            .count();
        assert_eq!(unrelated, 0);
    }
}
