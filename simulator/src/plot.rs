//! SVG line charts (plotters' SVG backend: no system fonts needed, text is left to the viewer).

use std::path::Path;

use plotters::prelude::*;

/// One curve.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend label.
    pub label: String,
    /// `(x, y)` points in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Optional ± error per point (drawn as vertical bars).
    pub error: Option<Vec<f64>>,
    /// Draw markers at the points.
    pub markers: bool,
    /// Dashed (a fitted curve) rather than solid.
    pub dashed: bool,
}

impl Series {
    /// A solid curve with markers.
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            label: label.into(),
            points,
            error: None,
            markers: true,
            dashed: false,
        }
    }

    /// With ± error bars.
    pub fn with_error(mut self, error: Vec<f64>) -> Self {
        self.error = Some(error);
        self
    }

    /// A dashed curve without markers (for fits).
    pub fn fit(label: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            label: label.into(),
            points,
            error: None,
            markers: false,
            dashed: true,
        }
    }
}

/// A chart to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart<'a> {
    /// Title.
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// Logarithmic x axis.
    pub log_x: bool,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// Force the y range (otherwise fitted to the data).
    pub y_range: Option<(f64, f64)>,
}

/// Why a chart could not be drawn.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// Nothing to draw.
    #[error("no finite points to plot")]
    Empty,
    /// The backend failed.
    #[error("drawing {path} failed: {message}")]
    Draw {
        /// The file.
        path: String,
        /// The backend's message.
        message: String,
    },
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
];

fn bounds(
    series: &[Series],
    log: bool,
    pick: impl Fn(&(f64, f64), f64) -> f64,
) -> Option<(f64, f64)> {
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for s in series {
        for (i, p) in s.points.iter().enumerate() {
            let e = s
                .error
                .as_ref()
                .and_then(|e| e.get(i))
                .copied()
                .unwrap_or(0.0);
            for v in [pick(p, -e), pick(p, e)] {
                if v.is_finite() && (!log || v > 0.0) {
                    lo = lo.min(v);
                    hi = hi.max(v);
                }
            }
        }
    }
    (lo.is_finite() && hi.is_finite()).then_some((lo, hi))
}

fn pad(lo: f64, hi: f64, log: bool) -> (f64, f64) {
    if log {
        (lo / 1.3, hi * 1.3)
    } else if hi > lo {
        let m = (hi - lo) * 0.08;
        (lo - m, hi + m)
    } else {
        (lo - 1.0, hi + 1.0)
    }
}

/// Draw `series` into an SVG file at `path`.
///
/// # Errors
/// [`PlotError`] when there is nothing finite to draw or the file cannot be written.
pub fn line_chart(path: &Path, chart: &Chart<'_>, series: &[Series]) -> Result<(), PlotError> {
    let (x0, x1) = bounds(series, chart.log_x, |p, _| p.0).ok_or(PlotError::Empty)?;
    let (y0, y1) = match chart.y_range {
        Some(r) => r,
        None => {
            let (a, b) = bounds(series, chart.log_y, |p, e| p.1 + e).ok_or(PlotError::Empty)?;
            pad(a, b, chart.log_y)
        }
    };
    let (x0, x1) = pad(x0, x1, chart.log_x);
    let err = |e: Box<dyn std::error::Error>| PlotError::Draw {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    // Map log axes by hand (log10 of the value) so one code path serves both.
    let tx = |v: f64| if chart.log_x { v.log10() } else { v };
    let ty = |v: f64| if chart.log_y { v.log10() } else { v };
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(Box::new(e)))?;
    let mut c = ChartBuilder::on(&root)
        .caption(chart.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(62)
        .build_cartesian_2d(tx(x0)..tx(x1), ty(y0)..ty(y1))
        .map_err(|e| err(Box::new(e)))?;
    let fmt_x = |v: &f64| {
        if chart.log_x {
            human(10f64.powf(*v))
        } else {
            human(*v)
        }
    };
    let fmt_y = |v: &f64| {
        if chart.log_y {
            human(10f64.powf(*v))
        } else {
            human(*v)
        }
    };
    // On a log axis ask for about one label per decade, so labels land on powers of ten.
    let decades = |lo: f64, hi: f64| ((hi - lo).ceil() as usize + 1).clamp(2, 10);
    let x_labels = if chart.log_x {
        decades(tx(x0), tx(x1))
    } else {
        10
    };
    let y_labels = if chart.log_y {
        decades(ty(y0), ty(y1))
    } else {
        10
    };
    c.configure_mesh()
        .x_labels(x_labels)
        .y_labels(y_labels)
        .x_desc(chart.x_label)
        .y_desc(chart.y_label)
        .x_label_formatter(&fmt_x)
        .y_label_formatter(&fmt_y)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| err(Box::new(e)))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS.get(i % COLORS.len()).copied().unwrap_or(BLACK);
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| {
                p.0.is_finite()
                    && p.1.is_finite()
                    && (!chart.log_x || p.0 > 0.0)
                    && (!chart.log_y || p.1 > 0.0)
            })
            .map(|p| (tx(p.0), ty(p.1)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let style = ShapeStyle::from(&color).stroke_width(2);
        let anno = if s.dashed {
            c.draw_series(DashedLineSeries::new(pts.clone(), 6, 4, style))
                .map_err(|e| err(Box::new(e)))?
        } else {
            c.draw_series(LineSeries::new(pts.clone(), style))
                .map_err(|e| err(Box::new(e)))?
        };
        anno.label(s.label.clone()).legend(move |(x, y)| {
            PathElement::new(
                vec![(x, y), (x + 18, y)],
                ShapeStyle::from(&color).stroke_width(2),
            )
        });
        if s.markers {
            c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| err(Box::new(e)))?;
        }
        if let Some(errs) = &s.error {
            let bars: Vec<PathElement<(f64, f64)>> = s
                .points
                .iter()
                .zip(errs)
                .filter(|(p, e)| p.0.is_finite() && p.1.is_finite() && e.is_finite() && **e > 0.0)
                .map(|(p, e)| {
                    let lo = if chart.log_y {
                        (p.1 - e).max(p.1 / 10.0)
                    } else {
                        p.1 - e
                    };
                    PathElement::new(vec![(tx(p.0), ty(lo)), (tx(p.0), ty(p.1 + e))], color)
                })
                .collect();
            c.draw_series(bars).map_err(|e| err(Box::new(e)))?;
        }
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .draw()
        .map_err(|e| err(Box::new(e)))?;
    root.present().map_err(|e| err(Box::new(e)))?;
    Ok(())
}

/// Compact number formatting for axis labels: 1000 → "1k", 1e6 → "1M", 0.25 → "0.25".
pub fn human(v: f64) -> String {
    let a = v.abs();
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s
        }
    };
    if a >= 1e6 {
        format!("{}M", trim(format!("{:.1}", v / 1e6)))
    } else if a >= 1e3 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else if a >= 10.0 || a == 0.0 {
        trim(format!("{v:.1}"))
    } else {
        trim(format!("{v:.3}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg_without_fonts() {
        let dir = std::env::temp_dir().join(format!("kindred-sim-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.svg");
        let chart = Chart {
            title: "hops vs N",
            x_label: "nodes",
            y_label: "hops",
            log_x: true,
            log_y: false,
            y_range: None,
        };
        let s = vec![
            Series::new("hops", vec![(1e3, 2.0), (1e4, 3.0), (1e5, 3.5)])
                .with_error(vec![0.1, 0.2, 0.1]),
            Series::fit("fit", vec![(1e3, 2.1), (1e5, 3.6)]),
        ];
        line_chart(&path, &chart, &s).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("hops vs N") && svg.contains("<polyline"));
        assert!(matches!(
            line_chart(&path, &chart, &[]),
            Err(PlotError::Empty)
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn human_numbers() {
        assert_eq!(human(1000.0), "1k");
        assert_eq!(human(1_500_000.0), "1.5M");
        assert_eq!(human(0.25), "0.25");
        assert_eq!(human(12.0), "12");
    }
}
