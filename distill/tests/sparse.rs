//! Updates kept as their nonzero entries decode to the same values as dense ones and merge to
//! the same result: a hub that keeps its members' pushes sparse merges exactly what it did.

#![allow(clippy::unwrap_used)]

mod common;

use kindred_distill::{
    Distiller, EmbeddingConfig, MergeRule, PeerUpdate, Policy, SynthConfig, Update, UpdateRef,
    decode, decode_update, synthesize,
};
use proptest::prelude::*;

#[test]
fn distilled_bodies_decode_to_the_same_values_in_either_form() {
    let spec = common::spec();
    let n = spec.numel() as usize;
    for (density, sparse) in [(0.01, true), (0.05, true), (0.6, false)] {
        let policy = Policy {
            density,
            warmup: Vec::new(),
            ..Policy::default()
        };
        let mut d = Distiller::new(spec.clone(), policy, EmbeddingConfig::default()).unwrap();
        for seed in 0..3 {
            let distilled = d.distill(&common::update(n, seed)).unwrap();
            let dense = decode(&distilled.body, &spec).unwrap();
            let kept = decode_update(&distilled.body, &spec).unwrap();
            assert_eq!(kept.is_sparse(), sparse, "density {density}");
            assert_eq!(kept.to_dense(), dense, "density {density}, seed {seed}");
        }
    }
}

/// Vectors of `n` elements with about `share` of them nonzero (heavy-tailed values).
fn sparse_vec(n: usize, share: f64) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec((0.0f64..1.0, -3.0f32..3.0), n).prop_map(move |v| {
        v.into_iter()
            .map(|(p, x)| if p < share { x * x * x } else { 0.0 })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The same verdicts and the same merge, element for element, whether the peers are read
    /// dense or as their nonzero entries, under both merge rules.
    #[test]
    fn sparse_peers_merge_as_dense_ones(
        own in sparse_vec(300, 0.9),
        peers in proptest::collection::vec((sparse_vec(300, 0.15), 1u64..500), 0..6),
        trimmed in any::<bool>(),
    ) {
        let config = SynthConfig {
            rule: if trimmed { MergeRule::TrimmedMean { trim: 0.2 } } else { MergeRule::WeightedMean },
            ..SynthConfig::default()
        };
        let own = UpdateRef { update: &own, samples: 100 };
        let dense: Vec<UpdateRef<'_>> =
            peers.iter().map(|(u, s)| UpdateRef { update: u, samples: *s }).collect();
        let kept: Vec<Update> = peers.iter().map(|(u, _)| Update::from_dense(u.clone())).collect();
        let sparse: Vec<PeerUpdate<'_>> = kept
            .iter()
            .zip(&peers)
            .map(|(u, (_, s))| PeerUpdate { update: u, samples: *s })
            .collect();
        let a = synthesize(own, &dense, &config).unwrap();
        let b = synthesize(own, &sparse, &config).unwrap();
        prop_assert_eq!(&a.verdicts, &b.verdicts);
        prop_assert_eq!(a.accepted, b.accepted);
        prop_assert_eq!(a.merged, b.merged);
    }
}
