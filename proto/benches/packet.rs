//! Criterion benchmarks of the outcome-packet codec: header decode + signature verification, and
//! body encode / decode of a 1M-parameter update at 1% top-k density.
#![allow(clippy::unwrap_used, missing_docs)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kindred_proto::{decode_body, decode_header, encode_body};
use std::hint::black_box;

#[path = "support/fixture.rs"]
mod fixture;

fn header(c: &mut Criterion) {
    let packets: Vec<_> = (0..64).map(|r| fixture::sealed(r).header_bytes).collect();
    let mut g = c.benchmark_group("header");
    g.throughput(Throughput::Elements(1));
    let mut i = 0;
    g.bench_function("decode_and_verify", |b| {
        b.iter(|| {
            i = (i + 1) % packets.len();
            black_box(decode_header(black_box(&packets[i])).unwrap())
        })
    });
    g.finish();
}

fn body(c: &mut Criterion) {
    let spec = fixture::spec();
    let sealed = fixture::sealed(1);
    let body = fixture::body(1);
    let header = decode_header(&sealed.header_bytes).unwrap().into_header();
    let mut g = c.benchmark_group("body_1m_params");
    g.throughput(Throughput::Bytes(sealed.body_bytes.len() as u64));
    g.bench_function("encode", |b| {
        b.iter(|| black_box(encode_body(black_box(&body))))
    });
    g.bench_function("decode", |b| {
        b.iter(|| black_box(decode_body(&header, &spec, black_box(&sealed.body_bytes)).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, header, body);
criterion_main!(benches);
