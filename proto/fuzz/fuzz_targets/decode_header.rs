//! Arbitrary bytes into the header decoders (packet and snapshot): they must return, never panic,
//! and never allocate past the limits (run with `-rss_limit_mb`/`-malloc_limit_mb`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = kindred_proto::decode_header(data) {
        // Anything accepted must be within the limits.
        assert!(data.len() <= kindred_proto::MAX_HEADER_BYTES);
        assert!(header.header().embedding.sketch.len() <= kindred_proto::MAX_SKETCH_LEN);
        // One signature never verifies under both domains.
        assert!(kindred_proto::decode_snapshot_header(data).is_err());
    }
    if let Ok(header) = kindred_proto::decode_snapshot_header(data) {
        assert!(data.len() <= kindred_proto::MAX_HEADER_BYTES);
        assert!(header.header().embedding.sketch.len() <= kindred_proto::MAX_SKETCH_LEN);
    }
});
