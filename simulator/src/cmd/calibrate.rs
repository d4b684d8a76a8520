//! `kindred-sim calibrate`: the routing model against a real in-process swarm.

use clap::Args;
use kindred_simulator::calibrate::{Calibration, SideFigures, calibrate};
use serde_json::{Value, json};

use super::common::{Common, progress_bar, progress_to};
use super::render::{Table, json_line, note};

/// Options of `kindred-sim calibrate`.
#[derive(Debug, Clone, Args)]
pub(crate) struct CalibrateArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Swarm sizes.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    pub(crate) nodes: Vec<usize>,
    /// Noise around the planted cluster directions (0.25 ≈ 14°).
    #[arg(long, default_value_t = 0.25)]
    pub(crate) noise: f32,
    /// Round lookups of the real swarm run at the same time.
    #[arg(long, default_value_t = 1)]
    pub(crate) parallel: usize,
    /// Agreement required on requests per provider lookup (model / real − 1).
    #[arg(long, default_value_t = 0.15)]
    pub(crate) tolerance: f64,
}

fn side(s: &SideFigures) -> Value {
    json!({
        "requests_per_lookup_mean": s.requests_mean,
        "requests_per_lookup_p50": s.requests_p50,
        "key_lookups_per_round": s.key_lookups_per_round,
        "success": s.success,
        "recall_at_5": s.recall_at_5,
        "announce_requests_mean": s.announce_requests_mean,
        "announce_bytes_per_key": s.announce_bytes_per_key,
        "lookup_bytes_per_key": s.lookup_bytes_per_key,
        "seconds": s.seconds,
    })
}

fn entry(c: &Calibration, tolerance: f64) -> Value {
    json!({
        "nodes": c.nodes,
        "clusters": c.clusters,
        "real": side(&c.real),
        "model": side(&c.model),
        "requests_ratio": c.requests_ratio(),
        "bytes_ratio": c.bytes_ratio(),
        "within_tolerance": (c.requests_ratio() - 1.0).abs() <= tolerance,
    })
}

/// Run `kindred-sim calibrate`.
pub(crate) fn run(args: &CalibrateArgs) -> anyhow::Result<()> {
    let json = args.common.json;
    let out = args.common.out_dir()?;
    let pb = progress_bar(json);
    let t = std::time::Instant::now();
    let mut runs = Vec::new();
    for &n in &args.nodes {
        pb.set_prefix(format!("N={n}"));
        let cb = progress_to(&pb);
        runs.push(calibrate(
            n,
            args.noise,
            args.common.seed,
            args.parallel,
            &cb,
        )?);
    }
    pb.finish_and_clear();
    let mut table = Table::new(
        "kindred-sim calibrate: real in-process swarm (kindred-routing, libp2p memory transport) vs model",
        &[
            "nodes",
            "side",
            "req/lookup mean",
            "req/lookup p50",
            "lookups/round",
            "success",
            "recall@5",
            "req/announce",
            "B/announce",
            "B/lookup",
            "s",
        ],
    );
    for c in &runs {
        for (name, s) in [("real", &c.real), ("model", &c.model)] {
            table.row(vec![
                c.nodes.to_string(),
                name.into(),
                format!("{:.2}", s.requests_mean),
                format!("{:.1}", s.requests_p50),
                format!("{:.1}", s.key_lookups_per_round),
                format!("{:.3}", s.success),
                format!("{:.3}", s.recall_at_5),
                format!("{:.2}", s.announce_requests_mean),
                format!("{:.0}", s.announce_bytes_per_key),
                format!("{:.0}", s.lookup_bytes_per_key),
                format!("{:.1}", s.seconds),
            ]);
        }
        table.row(vec![
            c.nodes.to_string(),
            "model/real".into(),
            format!("{:.3}", c.requests_ratio()),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            format!("bytes {:.3}", c.bytes_ratio()),
            String::new(),
            String::new(),
        ]);
    }
    table.print(json);
    let peak = kindred_simulator::mem::peak_rss_mb().unwrap_or(f64::NAN);
    if let Some(dir) = &out {
        let rows: Vec<Vec<String>> = runs
            .iter()
            .flat_map(|c| {
                [("real", &c.real), ("model", &c.model)].map(|(name, s)| {
                    vec![
                        c.nodes.to_string(),
                        name.to_owned(),
                        format!("{:.6}", s.requests_mean),
                        format!("{:.6}", s.requests_p50),
                        format!("{:.6}", s.key_lookups_per_round),
                        format!("{:.6}", s.success),
                        format!("{:.6}", s.recall_at_5),
                        format!("{:.6}", s.announce_requests_mean),
                        format!("{:.1}", s.announce_bytes_per_key),
                        format!("{:.1}", s.lookup_bytes_per_key),
                        format!("{:.3}", s.seconds),
                    ]
                })
            })
            .collect();
        kindred_simulator::csv::write(
            &dir.join("calibrate.csv"),
            &[
                "nodes",
                "side",
                "requests_mean",
                "requests_p50",
                "key_lookups_per_round",
                "success",
                "recall_at_5",
                "announce_requests_mean",
                "announce_bytes_per_key",
                "lookup_bytes_per_key",
                "seconds",
            ],
            &rows,
        )?;
        note(json, &format!("CSV written to {}", dir.display()));
    }
    let all_within = runs
        .iter()
        .all(|c| (c.requests_ratio() - 1.0).abs() <= args.tolerance);
    let mut line = json!({
        "nodes": args.nodes,
        "tolerance": args.tolerance,
        "within_tolerance": all_within,
        "seconds": t.elapsed().as_secs_f64(),
        "peak_rss_mb": peak,
        "runs": runs.iter().map(|c| entry(c, args.tolerance)).collect::<Vec<_>>(),
    });
    if let (Some(o), Some(last)) = (line.as_object_mut(), runs.last()) {
        o.insert(
            "requests_per_lookup_real".into(),
            json!(last.real.requests_mean),
        );
        o.insert(
            "requests_per_lookup_model".into(),
            json!(last.model.requests_mean),
        );
        o.insert("bytes_ratio".into(), json!(last.bytes_ratio()));
        o.insert("success_real".into(), json!(last.real.success));
        o.insert("success_model".into(), json!(last.model.success));
    }
    json_line(&line);
    Ok(())
}
