//! The local semantic index: every verified header seen in a round window, searchable by cosine.
//!
//! A node ranks candidate partners by the cosine of their embedding sketches against its own.
//! Headers arrive from many providers over a round (and over several lookups), so they go into an
//! `hnsw_rs` graph per round window and sketch length (sketches of different lengths are not
//! comparable); ranking is then one approximate nearest-neighbour search, re-scored with the exact
//! [`Embedding::cosine`]. HNSW graphs do not support deletion, which fits how headers expire:
//! a whole window's graph is dropped once the window falls out of the retention horizon.
//!
//! Vectors are the int8 sketch converted to `f32` and L2-normalised; an all-zero sketch has no
//! direction and is refused, which also keeps `hnsw_rs` from ever seeing a degenerate distance.
//!
//! ```
//! use kindred_routing::index::SemanticIndex;
//! use kindred_routing::keys::RoundWindow;
//!
//! let index = SemanticIndex::new(1, 10_000);
//! assert!(index.is_empty());
//! assert!(index.nearest(RoundWindow(0), &[1, 2, 3], 5).is_empty());
//! ```

use std::collections::{BTreeMap, HashMap};

use hnsw_rs::prelude::{DistCosine, Hnsw};
use kindred_proto::{Embedding, MAX_SKETCH_LEN, PacketId, VerifiedHeader};
use libp2p::PeerId;

use crate::keys::RoundWindow;

/// HNSW graph degree: 16 links per node per layer is ample for a few thousand vectors.
const MAX_CONNECTIONS: usize = 16;
/// Layers in the graph.
const MAX_LAYERS: usize = 16;
/// Candidate list width while building.
const EF_CONSTRUCTION: usize = 64;
/// Minimum candidate list width while searching.
const EF_SEARCH: usize = 64;

/// One indexed header.
#[derive(Debug, Clone)]
pub struct IndexedHeader {
    /// The verified header.
    pub header: VerifiedHeader,
    /// Its encoded bytes, as received (what the node stores).
    pub header_bytes: Vec<u8>,
}

/// Why a header was not indexed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IndexError {
    /// The sketch is empty or all zero: it has no direction to compare.
    #[error("the embedding sketch is empty or all zero")]
    ZeroSketch,
    /// The window is older than the retention horizon.
    #[error("round window {0:?} has already been evicted")]
    Evicted(RoundWindow),
    /// The window's index is at capacity.
    #[error("the index for this round window is full ({0} headers)")]
    Full(usize),
}

impl IndexError {
    /// A short, stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ZeroSketch => "zero_sketch",
            Self::Evicted(_) => "evicted_window",
            Self::Full(_) => "index_full",
        }
    }
}

struct Graph {
    hnsw: Hnsw<'static, f32, DistCosine>,
    entries: Vec<IndexedHeader>,
    /// Per sender, the slot of its newest header: a window spans several rounds when the node
    /// follows its partners between discovery rounds, and only a sender's newest update is a
    /// candidate. HNSW cannot delete, so older slots stay in the graph and are skipped.
    newest: HashMap<PeerId, usize>,
    /// Slots that a newer header of the same sender replaced.
    superseded: usize,
}

/// Headers by round window, searchable by cosine.
pub struct SemanticIndex {
    graphs: BTreeMap<(RoundWindow, usize), Graph>,
    by_id: HashMap<PacketId, (RoundWindow, usize, usize)>,
    retain: u64,
    max_per_window: usize,
    horizon: RoundWindow,
}

impl std::fmt::Debug for SemanticIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SemanticIndex")
            .field("windows", &self.graphs.len())
            .field("headers", &self.by_id.len())
            .field("horizon", &self.horizon)
            .finish()
    }
}

/// Normalised `f32` copy of a sketch, or `None` when it is all zero.
fn unit_vector(sketch: &[i8]) -> Option<Vec<f32>> {
    let norm = sketch
        .iter()
        .map(|&x| f32::from(x) * f32::from(x))
        .sum::<f32>()
        .sqrt();
    if sketch.is_empty() || norm == 0.0 {
        return None;
    }
    Some(sketch.iter().map(|&x| f32::from(x) / norm).collect())
}

impl SemanticIndex {
    /// An empty index keeping the newest `retain` windows (at least 1), each holding at most
    /// `max_per_window` headers.
    pub fn new(retain: u64, max_per_window: usize) -> Self {
        Self {
            graphs: BTreeMap::new(),
            by_id: HashMap::new(),
            retain: retain.max(1),
            max_per_window,
            horizon: RoundWindow(0),
        }
    }

    /// Add a verified header to its window's graph. Adding the same packet twice is a no-op.
    ///
    /// # Errors
    /// [`IndexError`] when the sketch has no direction, the window is already evicted, or the
    /// window is full.
    pub fn insert(
        &mut self,
        window: RoundWindow,
        header: VerifiedHeader,
        header_bytes: Vec<u8>,
    ) -> Result<(), IndexError> {
        if window < self.horizon {
            return Err(IndexError::Evicted(window));
        }
        if self.by_id.contains_key(&header.id()) {
            return Ok(());
        }
        let sketch = &header.header().embedding.sketch;
        let vector = unit_vector(sketch).ok_or(IndexError::ZeroSketch)?;
        let dim = vector.len().min(MAX_SKETCH_LEN);
        let max = self.max_per_window;
        let graph = self.graphs.entry((window, dim)).or_insert_with(|| Graph {
            hnsw: Hnsw::new(
                MAX_CONNECTIONS,
                max.clamp(16, 4096),
                MAX_LAYERS,
                EF_CONSTRUCTION,
                DistCosine,
            ),
            entries: Vec::new(),
            newest: HashMap::new(),
            superseded: 0,
        });
        if graph.entries.len() >= max {
            return Err(IndexError::Full(max));
        }
        let slot = graph.entries.len();
        let h = header.header();
        let round_of = |slot: usize| graph.entries.get(slot).map(|e| e.header.header().round);
        match graph.newest.get(&h.sender).copied() {
            Some(old) if round_of(old).is_some_and(|r| r > h.round) => graph.superseded += 1,
            Some(_) => {
                graph.superseded += 1;
                graph.newest.insert(h.sender, slot);
            }
            None => {
                graph.newest.insert(h.sender, slot);
            }
        }
        graph.hnsw.insert((&vector, slot));
        self.by_id.insert(header.id(), (window, dim, slot));
        graph.entries.push(IndexedHeader {
            header,
            header_bytes,
        });
        Ok(())
    }

    /// The up to `k` indexed headers of `window` nearest to `sketch`, best first, with their
    /// exact sketch cosine. Only each sender's newest header of the window is returned.
    pub fn nearest(
        &self,
        window: RoundWindow,
        sketch: &[i8],
        k: usize,
    ) -> Vec<(&IndexedHeader, f32)> {
        let Some(query) = unit_vector(sketch) else {
            return Vec::new();
        };
        let Some(graph) = self.graphs.get(&(window, query.len())) else {
            return Vec::new();
        };
        if k == 0 {
            return Vec::new();
        }
        let probe = Embedding {
            sketch: sketch.to_vec(),
            ..Embedding::default()
        };
        // Ask for enough neighbours that `k` remain once superseded headers are skipped.
        let want = k.saturating_add(graph.superseded).min(graph.entries.len());
        let mut found: Vec<(&IndexedHeader, f32)> = graph
            .hnsw
            .search(&query, want, EF_SEARCH.max(2 * want))
            .into_iter()
            .filter(|n| {
                graph
                    .entries
                    .get(n.d_id)
                    .is_some_and(|e| graph.newest.get(&e.header.header().sender) == Some(&n.d_id))
            })
            .filter_map(|n| graph.entries.get(n.d_id))
            .map(|e| (e, probe.cosine(&e.header.header().embedding)))
            .collect();
        found.sort_by(|a, b| b.1.total_cmp(&a.1));
        found.truncate(k);
        found
    }

    /// The newest header `sender` has in `window`, if any.
    pub fn newest(&self, window: RoundWindow, sender: &PeerId) -> Option<&IndexedHeader> {
        self.graphs
            .range((window, 0)..=(window, usize::MAX))
            .filter_map(|(_, g)| g.newest.get(sender).and_then(|&slot| g.entries.get(slot)))
            .max_by_key(|e| e.header.header().round)
    }

    /// The indexed header with this id.
    pub fn get(&self, id: &PacketId) -> Option<&IndexedHeader> {
        let (window, dim, slot) = self.by_id.get(id)?;
        self.graphs.get(&(*window, *dim))?.entries.get(*slot)
    }

    /// Move the retention horizon to cover `latest`: windows older than `latest − retain + 1`
    /// are dropped. Returns how many headers were evicted.
    pub fn advance(&mut self, latest: RoundWindow) -> usize {
        let horizon = RoundWindow(latest.0.saturating_sub(self.retain - 1));
        if horizon <= self.horizon {
            return 0;
        }
        self.horizon = horizon;
        let keep = self.graphs.split_off(&(horizon, 0));
        let dropped = std::mem::replace(&mut self.graphs, keep);
        let evicted: usize = dropped.values().map(|g| g.entries.len()).sum();
        self.by_id.retain(|_, (w, _, _)| *w >= horizon);
        evicted
    }

    /// Headers indexed over all retained windows.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}
