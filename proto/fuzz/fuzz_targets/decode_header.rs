//! Arbitrary bytes into the header decoders (packet, snapshot and hub-merge domains): they must
//! return, never panic, and never allocate past the limits (run with
//! `-rss_limit_mb`/`-malloc_limit_mb`); one signature never verifies under two domains.
#![no_main]

use kindred_proto::{
    MAX_HEADER_BYTES, MAX_SKETCH_LEN, VerifiedHeader, decode_header, decode_merge_header,
    decode_snapshot_header,
};
use libfuzzer_sys::fuzz_target;

/// What every accepted header must be, whatever its domain.
fn within_limits(data: &[u8], header: &VerifiedHeader) {
    assert!(data.len() <= MAX_HEADER_BYTES);
    assert!(header.header().embedding.sketch.len() <= MAX_SKETCH_LEN);
}

fuzz_target!(|data: &[u8]| {
    let packet = decode_header(data);
    let snapshot = decode_snapshot_header(data);
    let merge = decode_merge_header(data);
    let accepted = [&packet, &snapshot, &merge]
        .iter()
        .filter(|r| r.is_ok())
        .count();
    assert!(accepted <= 1, "one header verified under {accepted} domains");
    for header in [packet, snapshot, merge].iter().flatten() {
        within_limits(data, header);
    }
});
