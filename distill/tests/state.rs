//! Persisted state restores exactly; corrupt, truncated, foreign or oversized bytes are typed
//! errors, never panics.

#![allow(clippy::unwrap_used)]

mod common;

use kindred_distill::{Distiller, DistillerState, EmbeddingConfig, Policy, RestoreError};
use kindred_proto::{DType, LayerSpec, ModelSpec};
use proptest::prelude::*;

fn trained() -> (ModelSpec, Distiller) {
    let spec = common::spec();
    let n = spec.numel() as usize;
    let mut d =
        Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default()).unwrap();
    d.accept_peer(&common::update(n, 77)).unwrap();
    for r in 0..3 {
        let _ = d.distill(&common::update(n, r)).unwrap();
    }
    (spec, d)
}

#[test]
fn restart_continues_exactly_where_it_stopped() {
    let (spec, mut a) = trained();
    let n = spec.numel() as usize;
    let bytes = a.state().to_bytes();
    let mut b =
        Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default()).unwrap();
    b.restore(DistillerState::from_bytes(&bytes, &spec).unwrap())
        .unwrap();
    assert_eq!(b.state(), a.state());
    let u = common::update(n, 9);
    assert_eq!(a.distill(&u).unwrap(), b.distill(&u).unwrap());
}

#[test]
fn fresh_state_round_trips_without_a_mean() {
    let spec = common::spec();
    let d = Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default()).unwrap();
    let state = d.state();
    assert!(state.mean.is_empty());
    assert_eq!(
        DistillerState::from_bytes(&state.to_bytes(), &spec).unwrap(),
        state
    );
}

#[test]
fn corruption_is_detected() {
    let (spec, d) = trained();
    let bytes = d.state().to_bytes();
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x10;
    assert_eq!(
        DistillerState::from_bytes(&flipped, &spec),
        Err(RestoreError::Checksum)
    );
    for cut in [0, 1, 31, 32, 100, bytes.len() - 1] {
        assert!(DistillerState::from_bytes(&bytes[..cut], &spec).is_err());
    }
    let mut long = bytes.clone();
    long.resize(bytes.len() * 3, 0);
    assert!(matches!(
        DistillerState::from_bytes(&long, &spec),
        Err(RestoreError::Oversize { .. })
    ));
}

#[test]
fn foreign_or_inconsistent_states_are_rejected() {
    let (spec, d) = trained();
    let other = ModelSpec::new(vec![LayerSpec::new("w", [10], DType::F32)]).unwrap();
    let small = Distiller::new(other.clone(), Policy::default(), EmbeddingConfig::default())
        .unwrap()
        .state()
        .to_bytes();
    assert_eq!(
        DistillerState::from_bytes(&small, &spec),
        Err(RestoreError::ModelMismatch)
    );
    let mut fresh =
        Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default()).unwrap();
    let mut state = d.state();
    state.residual.pop();
    assert!(matches!(
        fresh.restore(state),
        Err(RestoreError::Length {
            what: "residual",
            ..
        })
    ));
    let mut state = d.state();
    state.mean[3] = f32::NAN;
    assert!(matches!(
        fresh.restore(state.clone()),
        Err(RestoreError::NonFinite {
            what: "mean",
            index: 3
        })
    ));
    // A NaN written to disk is caught when reading too.
    assert!(matches!(
        DistillerState::from_bytes(&state.to_bytes(), &spec),
        Err(RestoreError::NonFinite {
            what: "mean",
            index: 3
        })
    ));
    let mut state = d.state();
    state.model = other.id();
    assert_eq!(fresh.restore(state), Err(RestoreError::ModelMismatch));
    assert_eq!(fresh.round(), 0, "failed restores change nothing");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let spec = ModelSpec::new(vec![LayerSpec::new("w", [20], DType::F32)]).unwrap();
        let _ = DistillerState::from_bytes(&bytes, &spec);
    }

    #[test]
    fn any_single_bit_flip_is_rejected(bit in 0usize..(8 * 220)) {
        let spec = ModelSpec::new(vec![LayerSpec::new("w", [20], DType::F32)]).unwrap();
        let d = Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default()).unwrap();
        let mut bytes = d.state().to_bytes();
        let bit = bit % (bytes.len() * 8);
        bytes[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(DistillerState::from_bytes(&bytes, &spec).is_err());
    }
}
