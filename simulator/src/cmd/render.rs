//! Everything `kindred-sim` prints: summary tables and the final JSON line. Deliberately the only
//! module allowed to write to stdout and stderr.
#![allow(clippy::print_stdout, clippy::print_stderr)]

/// A table of strings printed with aligned columns.
#[derive(Debug, Clone, Default)]
pub(crate) struct Table {
    pub(crate) title: String,
    pub(crate) header: Vec<String>,
    pub(crate) rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(title: &str, header: &[&str]) -> Self {
        Self {
            title: title.to_owned(),
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let cols = self.header.len();
        let mut width = vec![0usize; cols];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |r: &Vec<String>| {
            r.iter()
                .zip(&width)
                .map(|(c, w)| format!("{c:>w$}"))
                .collect::<Vec<_>>()
                .join("  ")
        };
        let mut s = format!("{}\n{}\n", self.title, line(&self.header));
        s.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * cols.saturating_sub(1)));
        s.push('\n');
        for r in &self.rows {
            s.push_str(&line(r));
            s.push('\n');
        }
        s
    }

    /// Print to stdout, or to stderr when stdout is reserved for JSON.
    pub(crate) fn print(&self, json: bool) {
        if json {
            eprintln!("{}", self.render());
        } else {
            println!("{}", self.render());
        }
    }
}

/// A note for the human reader (stderr with `--json`).
pub(crate) fn note(json: bool, text: &str) {
    if json {
        eprintln!("{text}");
    } else {
        println!("{text}");
    }
}

/// The final machine-readable line. Always printed last, always on stdout.
pub(crate) fn json_line(value: &serde_json::Value) {
    println!("{value}");
}

/// `mean ± sd` with `digits` decimals (just the mean when sd is 0 or there is one run).
pub(crate) fn pm(mean: f64, sd: f64, digits: usize) -> String {
    if sd > 0.0 {
        format!("{mean:.digits$} ± {sd:.digits$}")
    } else {
        format!("{mean:.digits$}")
    }
}
