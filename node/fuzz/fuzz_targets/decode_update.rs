//! Arbitrary bytes into the upload decoder (`POST /v1/update`'s safetensors body), fed in pieces
//! whose size the first byte picks, against a small model with three layers. Whatever the pieces,
//! the answer must be the one a single whole feed gets, and an accepted update is the model's
//! size with every value finite and within bounds.
#![no_main]

use std::sync::OnceLock;

use kindred_node::api::MAX_ABS_UPDATE_VALUE;
use kindred_node::update_stream::{UpdateDecoder, UpdateError};
use kindred_proto::{DType, LayerSpec, ModelSpec};
use libfuzzer_sys::fuzz_target;

fn spec() -> &'static ModelSpec {
    static SPEC: OnceLock<ModelSpec> = OnceLock::new();
    SPEC.get_or_init(|| {
        ModelSpec::new(vec![
            LayerSpec::new("w", [4, 3], DType::F32),
            LayerSpec::new("b", [4], DType::F32),
            LayerSpec::new("c", [2, 1, 2], DType::F32),
        ])
        .unwrap_or_else(|e| panic!("fixed spec is valid: {e}"))
    })
}

/// Header limit: enough for a real header of the spec, small enough to reach the refusal.
const MAX_HEADER: usize = 1024;

fn decode(file: &[u8], piece: usize) -> Result<Vec<f32>, UpdateError> {
    let mut decoder = UpdateDecoder::new(spec(), MAX_HEADER);
    for p in file.chunks(piece.max(1)) {
        decoder.feed(p)?;
    }
    decoder.finish()
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, file)) = data.split_first() else {
        return;
    };
    let whole = decode(file, file.len());
    let pieces = decode(file, usize::from(selector % 32) + 1);
    assert_eq!(whole, pieces);
    if let Ok(update) = pieces {
        assert_eq!(update.len() as u64, spec().numel());
        assert!(
            update
                .iter()
                .all(|v| v.is_finite() && v.abs() <= MAX_ABS_UPDATE_VALUE)
        );
    }
});
