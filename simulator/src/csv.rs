//! Minimal CSV output (RFC 4180 quoting), one file per table.

use std::io::Write;
use std::path::Path;

/// Quote a field if it holds a comma, quote or newline.
pub fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// A number cell: six decimals, or empty for NaN and infinities (a missing value, not a
/// string a spreadsheet would choke on).
pub fn number(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.6}")
    } else {
        String::new()
    }
}

/// Write `header` and `rows` to `path`.
///
/// # Errors
/// The I/O error of creating or writing the file.
pub fn write(path: &Path, header: &[&str], rows: &[Vec<String>]) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let line = |cells: Vec<String>| cells.join(",");
    writeln!(out, "{}", line(header.iter().map(|h| field(h)).collect()))?;
    for r in rows {
        writeln!(out, "{}", line(r.iter().map(|c| field(c)).collect()))?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    #[test]
    fn quoting() {
        assert_eq!(super::field("a"), "a");
        assert_eq!(super::field("a,b"), "\"a,b\"");
        assert_eq!(super::field("say \"x\""), "\"say \"\"x\"\"\"");
    }

    #[test]
    fn numbers() {
        assert_eq!(super::number(0.5), "0.500000");
        assert_eq!(super::number(f64::NAN), "");
        assert_eq!(super::number(f64::INFINITY), "");
    }
}
