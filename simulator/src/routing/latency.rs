//! Link latency: a log-normal round-trip time per link, or a measured site-to-site matrix.

use std::path::Path;

use super::Micros;

/// How round-trip times between nodes are drawn.
#[derive(Debug, Clone, PartialEq)]
pub enum Latency {
    /// Every link has its own fixed RTT, log-normal across links: `exp(μ + σ·z)` with
    /// `exp(μ)` the median.
    LogNormal {
        /// Median RTT in milliseconds.
        median_ms: f64,
        /// Standard deviation of `ln(RTT)`.
        sigma: f64,
    },
    /// Nodes are spread uniformly over the sites of a measured RTT matrix (milliseconds); a
    /// link's RTT is its sites' entry plus a per-link jitter of up to 10 %, at least 1 ms.
    Matrix {
        /// Number of sites.
        sites: usize,
        /// Row-major `sites × sites` RTTs.
        rtt_ms: Vec<f32>,
    },
}

impl Default for Latency {
    /// Median 80 ms, σ = 0.5 (the middle 90 % of links between 35 and 180 ms).
    fn default() -> Self {
        Self::LogNormal {
            median_ms: 80.0,
            sigma: 0.5,
        }
    }
}

/// Why a latency matrix file was rejected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LatencyError {
    /// The file could not be read.
    #[error("cannot read latency matrix {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A value is not a finite, non-negative number.
    #[error("latency matrix line {line}: {value:?} is not a finite non-negative RTT in ms")]
    Value {
        /// 1-based line.
        line: usize,
        /// The text.
        value: String,
    },
    /// Rows of different lengths, or not square.
    #[error("latency matrix is not square: {rows} rows, row {row} has {len} values")]
    NotSquare {
        /// Rows read.
        rows: usize,
        /// The offending row (1-based).
        row: usize,
        /// Its length.
        len: usize,
    },
}

impl Latency {
    /// Parse a square matrix of RTTs in milliseconds: one row per line, values separated by
    /// commas or whitespace, `#` comments and blank lines ignored.
    ///
    /// # Errors
    /// [`LatencyError`] naming the line or row at fault.
    pub fn from_matrix_file(path: &Path) -> Result<Self, LatencyError> {
        let text = std::fs::read_to_string(path).map_err(|source| LatencyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse_matrix(&text)
    }

    /// Parse matrix text (see [`Latency::from_matrix_file`]).
    ///
    /// # Errors
    /// [`LatencyError`] naming the line or row at fault.
    pub fn parse_matrix(text: &str) -> Result<Self, LatencyError> {
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut row = Vec::new();
            for tok in line.split(|c: char| c == ',' || c.is_whitespace()) {
                if tok.is_empty() {
                    continue;
                }
                let v: f32 = tok.parse().map_err(|_| LatencyError::Value {
                    line: i + 1,
                    value: tok.to_owned(),
                })?;
                if !v.is_finite() || v < 0.0 {
                    return Err(LatencyError::Value {
                        line: i + 1,
                        value: tok.to_owned(),
                    });
                }
                row.push(v);
            }
            rows.push(row);
        }
        let n = rows.len();
        for (r, row) in rows.iter().enumerate() {
            if row.len() != n {
                return Err(LatencyError::NotSquare {
                    rows: n,
                    row: r + 1,
                    len: row.len(),
                });
            }
        }
        if n == 0 {
            return Err(LatencyError::NotSquare {
                rows: 0,
                row: 0,
                len: 0,
            });
        }
        Ok(Self::Matrix {
            sites: n,
            rtt_ms: rows.into_iter().flatten().collect(),
        })
    }

    /// Round-trip time between nodes `a` and `b` (symmetric, fixed per link) in microseconds.
    #[inline]
    pub fn rtt(&self, seed: u64, a: u32, b: u32) -> Micros {
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        let link = kindred_kernels::rng::hash_index(
            seed ^ 0x1A7E_0C1E,
            u64::from(lo) << 32 | u64::from(hi),
        );
        let ms = match self {
            Self::LogNormal { median_ms, sigma } => {
                let z = crate::rng::normal_quantile(crate::rng::unit_open(link));
                median_ms * (sigma * z).exp()
            }
            Self::Matrix { sites, rtt_ms } => {
                let site = |n: u32| {
                    (kindred_kernels::rng::hash_index(seed ^ 0x517E, u64::from(n)) % *sites as u64)
                        as usize
                };
                let base = rtt_ms
                    .get(site(lo) * sites + site(hi))
                    .copied()
                    .unwrap_or(1.0);
                let jitter = 1.0 + 0.1 * crate::rng::unit_open(link);
                (f64::from(base) * jitter).max(1.0)
            }
        };
        (ms * 1000.0) as Micros
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lognormal_median_and_symmetry() {
        let l = Latency::default();
        let mut v: Vec<Micros> = (0..20_000u32).map(|i| l.rtt(1, i, i + 7)).collect();
        assert_eq!(l.rtt(1, 3, 9), l.rtt(1, 9, 3));
        v.sort_unstable();
        let median = v[v.len() / 2] as f64 / 1000.0;
        assert!((median - 80.0).abs() < 3.0, "{median}");
    }

    #[test]
    fn matrix_parses_and_rejects() {
        let m = Latency::parse_matrix("# rtt ms\n0, 100\n100 0\n").unwrap();
        let Latency::Matrix { sites, .. } = &m else {
            panic!("not a matrix")
        };
        assert_eq!(*sites, 2);
        for i in 0..100 {
            let r = m.rtt(3, i, i + 1) as f64 / 1000.0;
            assert!(
                r >= 1.0 && (r <= 1.1 || (100.0..=110.0).contains(&r)),
                "{r}"
            );
        }
        assert!(matches!(
            Latency::parse_matrix("0 1\n1"),
            Err(LatencyError::NotSquare { .. })
        ));
        assert!(matches!(
            Latency::parse_matrix("0 x\n1 0"),
            Err(LatencyError::Value { line: 1, .. })
        ));
        assert!(Latency::parse_matrix("0 -1\n1 0").is_err());
    }
}
