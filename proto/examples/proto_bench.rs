//! Packet codec throughput on one core, ending with one JSON line:
//! `{"header_verify_per_s":…,"body_encode_mb_s":…,"body_decode_mb_s":…}`.
//!
//! Run: `cargo run --release -p kindred-proto --example proto_bench`
//!
//! Each figure is the median of 7 timed runs of at least 0.3 s each, after a warm-up, on the
//! calling thread only. Body MB/s count encoded body bytes (1 MB = 10^6 bytes); the body is a
//! 1,068,810-parameter MLP update at 1% top-k density (top-k + int8 weights, f16 biases).
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use kindred_proto::{decode_body, decode_header, encode_body};

#[path = "../benches/support/fixture.rs"]
mod fixture;

const RUNS: usize = 7;
const MIN_RUN: Duration = Duration::from_millis(300);

/// Median over `RUNS` of operations per second of `op`.
fn rate(mut op: impl FnMut(usize)) -> f64 {
    for i in 0..100 {
        op(i);
    }
    let mut rates: Vec<f64> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            let mut n = 0;
            while start.elapsed() < MIN_RUN {
                for _ in 0..64 {
                    op(n);
                    n += 1;
                }
            }
            n as f64 / start.elapsed().as_secs_f64()
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[RUNS / 2]
}

fn main() {
    let spec = fixture::spec();
    let packets: Vec<_> = (0..256).map(fixture::sealed).collect();

    let headers: Vec<_> = packets.iter().map(|p| p.header_bytes.clone()).collect();
    let header_verify_per_s = rate(|i| {
        black_box(decode_header(black_box(&headers[i % headers.len()])).unwrap());
    });

    let body = fixture::body(1);
    let sealed = &packets[1];
    let body_bytes = sealed.body_bytes.len() as f64;
    let header = decode_header(&sealed.header_bytes).unwrap().into_header();
    let encode_per_s = rate(|_| {
        black_box(encode_body(black_box(&body)));
    });
    let decode_per_s = rate(|_| {
        black_box(decode_body(&header, &spec, black_box(&sealed.body_bytes)).unwrap());
    });

    println!(
        "params={} body_bytes={} header_bytes={} ratio_vs_f32={:.1}x",
        spec.numel(),
        sealed.body_bytes.len(),
        sealed.header_bytes.len(),
        spec.f32_bytes() as f64 / (sealed.body_bytes.len() + sealed.header_bytes.len()) as f64
    );
    println!(
        "{}",
        serde_json::json!({
            "header_verify_per_s": header_verify_per_s.round(),
            "body_encode_mb_s": (encode_per_s * body_bytes / 1e6 * 10.0).round() / 10.0,
            "body_decode_mb_s": (decode_per_s * body_bytes / 1e6 * 10.0).round() / 10.0,
        })
    );
}
