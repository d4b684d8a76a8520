//! `kindred bench-model` runs its node processes through real rounds and ends with the JSON
//! line scripts read (issue 33's contract): small model, so it fits CI; the sizes that matter
//! are benchmark runs (BENCHMARKS.md).
#![allow(clippy::unwrap_used)]

use std::process::Command;

use kindred_tests::{TempDir, kindred_bin};
use serde_json::Value;

#[test]
fn bench_model_measures_a_round_between_node_processes() {
    let dir = TempDir::new("bench-model");
    let out = Command::new(kindred_bin())
        .args([
            "bench-model",
            "--params",
            "300000",
            "--nodes",
            "3",
            "--rounds",
            "2",
            "--warmup",
            "3",
            "--round-secs",
            "3",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench-model failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    for field in [
        "params",
        "peak_rss_bytes",
        "peak_rss_total_bytes",
        "distill_gelem_s",
        "round_seconds",
        "wire_bytes_per_node_round",
        "bytes_allreduce",
    ] {
        assert!(r[field].is_number(), "{field} missing in {r}");
    }
    assert_eq!(r["params"], 300_000);
    let peak = r["peak_rss_bytes"].as_u64().unwrap();
    // A node holds the model at least once, and three of them more than one.
    assert!(peak >= 1_200_000, "{r}");
    assert!(
        r["peak_rss_total_bytes"].as_u64().unwrap() > 2 * peak,
        "{r}"
    );
    assert!(r["distill_gelem_s"].as_f64().unwrap() > 0.0, "{r}");
    let round = r["round_seconds"].as_f64().unwrap();
    assert!(round > 0.0 && round < 6.0, "{r}");
    // 2 × 2/3 × 4 × params for three nodes.
    assert_eq!(r["bytes_allreduce"], 1_600_000);
    let wire = r["wire_bytes_per_node_round"].as_u64().unwrap();
    assert!(wire > 0 && wire < 1_600_000, "{r}");
    // Measuring starts once every node merged: the measured rounds applied merges.
    assert!(r["warmup_rounds"].as_u64().unwrap() >= 3, "{r}");
    assert!(r["applied"]["merge"].as_u64().unwrap_or(0) > 0, "{r}");
}
