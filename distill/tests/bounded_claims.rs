//! A peer's claimed sample count buys at most `max_samples_ratio` median peers of weight
//! ("bounded claims"): a header claiming `u64::MAX` or `MAX_SAMPLES` cannot drown
//! the own update and the honest peers, and honest equal claims merge exactly as before.

#![allow(clippy::unwrap_used)]

mod common;

use kindred_distill::{
    MergeRule, SynthConfig, SynthError, Synthesis, UpdateRef, Verdict, cap_samples, synthesize,
};
use kindred_proto::MAX_SAMPLES;
use proptest::prelude::*;

const N: usize = 3000;

fn honest(own: &[f32], seed: u64) -> Vec<f32> {
    common::mix(own, &common::update(N, seed), 0.5)
}

fn weight(v: &Verdict) -> f64 {
    match v {
        Verdict::Accepted { weight, .. } => f64::from(*weight),
        Verdict::Rejected(r) => panic!("rejected: {r:?}"),
    }
}

fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn with_ratio(ratio: f32) -> SynthConfig {
    SynthConfig {
        max_samples_ratio: ratio,
        ..SynthConfig::default()
    }
}

/// The own update, six honest peers of 100 samples and one honest-looking liar (last) that
/// claims `claim`, merged under `config`.
fn merge_with_liar(claim: u64, config: &SynthConfig) -> (Synthesis, Vec<f32>, Vec<f32>) {
    let own = common::update(N, 1);
    let peers: Vec<Vec<f32>> = (0..6).map(|s| honest(&own, 10 + s)).collect();
    let liar = honest(&own, 99);
    let mut refs: Vec<UpdateRef<'_>> = peers
        .iter()
        .map(|p| UpdateRef {
            update: p,
            samples: 100,
        })
        .collect();
    refs.push(UpdateRef {
        update: &liar,
        samples: claim,
    });
    let out = synthesize(
        UpdateRef {
            update: &own,
            samples: 100,
        },
        &refs,
        config,
    )
    .unwrap();
    // The mean of the honest updates (own included), equal weights.
    let honest_mean: Vec<f32> = (0..N)
        .map(|j| (own[j] + peers.iter().map(|p| p[j]).sum::<f32>()) / 7.0)
        .collect();
    (out, liar, honest_mean)
}

#[test]
fn an_inflated_claim_weighs_at_most_the_cap() {
    for claim in [u64::MAX, MAX_SAMPLES, MAX_SAMPLES - 1, 1_000_000] {
        for ratio in [2.0f32, 4.0] {
            let (out, liar, honest_mean) = merge_with_liar(claim, &with_ratio(ratio));
            assert_eq!(
                out.accepted, 7,
                "claim {claim}: every peer is honest-looking"
            );
            // Claims [100; 7] and the liar's: the median is 100, the liar counts as `ratio`
            // peers of 100 out of 7 + ratio.
            let share = f64::from(ratio) / (7.0 + f64::from(ratio));
            let w = weight(&out.verdicts[6]);
            assert!(
                (w - share).abs() < 1e-5,
                "claim {claim}, ratio {ratio}: weight {w}, cap {share}"
            );
            // Every honest peer keeps its share of the rest.
            for v in &out.verdicts[..6] {
                assert!((weight(v) - 1.0 / (7.0 + f64::from(ratio))).abs() < 1e-5);
            }
            // The merge sits where the capped weights put it: (1 − share) of the way from the
            // liar's update to the honest mean, not on the liar's update.
            let d = distance(&out.merged, &liar);
            let full = distance(&honest_mean, &liar);
            assert!(
                (d / full - (1.0 - share)).abs() < 1e-3,
                "claim {claim}, ratio {ratio}: {d} of {full}"
            );
        }
    }
    // Without the cap the same liar takes the merge (what the cap is for).
    let (out, liar, honest_mean) = merge_with_liar(MAX_SAMPLES, &with_ratio(f32::INFINITY));
    assert!(weight(&out.verdicts[6]) > 0.999_99);
    assert!(distance(&out.merged, &liar) < 1e-4 * distance(&honest_mean, &liar));
}

#[test]
fn the_default_cap_bounds_an_inflated_claim() {
    let config = SynthConfig::default();
    let ratio = f64::from(config.max_samples_ratio);
    assert!((1.0..=4.0).contains(&ratio));
    let (out, _, _) = merge_with_liar(u64::MAX, &config);
    assert!(weight(&out.verdicts[6]) <= ratio / (7.0 + ratio) + 1e-6);
}

#[test]
fn several_liars_each_weigh_at_most_the_cap() {
    // Three liars among nine merged updates: the median claim is still an honest one.
    let own = common::update(N, 2);
    let updates: Vec<Vec<f32>> = (0..8).map(|s| honest(&own, 20 + s)).collect();
    let refs: Vec<UpdateRef<'_>> = updates
        .iter()
        .enumerate()
        .map(|(k, u)| UpdateRef {
            update: u,
            samples: if k < 3 { u64::MAX - k as u64 } else { 64 },
        })
        .collect();
    let own_ref = UpdateRef {
        update: &own,
        samples: 64,
    };
    let out = synthesize(own_ref, &refs, &with_ratio(2.0)).unwrap();
    assert_eq!(out.accepted, 8);
    // Six honest claims of 64 and three capped at 128: each liar 2/12 of the merge.
    for v in &out.verdicts[..3] {
        assert!((weight(v) - 2.0 / 12.0).abs() < 1e-5, "{v:?}");
    }
    for v in &out.verdicts[3..] {
        assert!((weight(v) - 1.0 / 12.0).abs() < 1e-5, "{v:?}");
    }
}

#[test]
fn honest_claims_within_the_ratio_merge_unchanged() {
    let own = common::update(N, 3);
    let updates: Vec<Vec<f32>> = (0..5).map(|s| honest(&own, 30 + s)).collect();
    // Equal claims, and claims within twice the median (100).
    for claims in [[100u64; 5], [100, 200, 50, 120, 80]] {
        let refs: Vec<UpdateRef<'_>> = updates
            .iter()
            .zip(claims)
            .map(|(u, samples)| UpdateRef { update: u, samples })
            .collect();
        let own_ref = UpdateRef {
            update: &own,
            samples: 100,
        };
        let capped = synthesize(own_ref, &refs, &SynthConfig::default()).unwrap();
        let uncapped = synthesize(own_ref, &refs, &with_ratio(f32::INFINITY)).unwrap();
        assert_eq!(capped, uncapped, "{claims:?}");
    }
}

#[test]
fn a_trimmed_mean_ignores_claims() {
    let config = SynthConfig {
        rule: MergeRule::TrimmedMean { trim: 0.2 },
        ..SynthConfig::default()
    };
    let (liar, _, _) = merge_with_liar(u64::MAX, &config);
    let (fair, _, _) = merge_with_liar(100, &config);
    assert_eq!(liar.merged, fair.merged);
}

#[test]
fn the_ratio_is_validated() {
    let own = [1.0f32, 0.0];
    for ratio in [0.5f32, 0.0, -1.0, f32::NAN] {
        let out = synthesize(
            UpdateRef {
                update: &own,
                samples: 1,
            },
            &[] as &[UpdateRef<'_>],
            &with_ratio(ratio),
        );
        assert!(
            matches!(
                out,
                Err(SynthError::Config {
                    field: "max_samples_ratio",
                    ..
                })
            ),
            "{ratio}"
        );
    }
    assert!(with_ratio(1.0).validate().is_ok());
    assert!(with_ratio(f32::INFINITY).validate().is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the claims, no peer weighs more than `ratio` times the lower median claim, in
    /// units of the own update's weight per sample.
    #[test]
    fn no_peer_outweighs_the_cap(
        own_claim in 1u64..1000,
        claims in prop::collection::vec(
            prop_oneof![1u64..1000, Just(MAX_SAMPLES), Just(u64::MAX), any::<u64>()],
            1..9,
        ),
        ratio in prop_oneof![Just(1.0f32), Just(2.0f32), Just(4.0f32), 1.0f32..8.0],
    ) {
        let own = common::update(64, 7);
        let updates: Vec<Vec<f32>> = claims
            .iter()
            .enumerate()
            .map(|(k, _)| common::mix(&own, &common::update(64, 70 + k as u64), 0.3))
            .collect();
        let refs: Vec<UpdateRef<'_>> = updates
            .iter()
            .zip(&claims)
            .map(|(u, &samples)| UpdateRef { update: u, samples })
            .collect();
        let own_ref = UpdateRef { update: &own, samples: own_claim };
        let out = synthesize(own_ref, &refs, &with_ratio(ratio)).unwrap();
        let merged_claims: Vec<u64> = claims
            .iter()
            .zip(&out.verdicts)
            .filter(|(_, v)| v.is_accepted())
            .map(|(&c, _)| c.min(MAX_SAMPLES))
            .collect();
        let mut all: Vec<u64> = std::iter::once(own_claim).chain(merged_claims.iter().copied()).collect();
        all.sort_unstable();
        let median = all[(all.len() - 1) / 2] as f64;
        let cap = f64::from(ratio) * median;
        // The most a merge may give one peer: the cap, out of the own claim and every merged
        // claim at most the cap.
        let total = own_claim as f64 + merged_claims.iter().map(|&c| (c as f64).min(cap)).sum::<f64>();
        for v in out.verdicts.iter().filter(|v| v.is_accepted()) {
            prop_assert!(
                weight(v) <= cap / total * (1.0 + 1e-4),
                "weight {} above the cap's {}", weight(v), cap / total
            );
        }
        prop_assert!(out.merged.iter().all(|x| x.is_finite()));
    }

    /// `cap_samples` never exceeds the cap or `MAX_SAMPLES`, never raises a claim, and leaves
    /// equal claims alone.
    #[test]
    fn cap_samples_bounds_every_claim(
        claims in prop::collection::vec(any::<u64>(), 0..12),
        same in 1u64..=MAX_SAMPLES,
        len in 1usize..12,
        ratio in 1.0f32..8.0,
    ) {
        let capped = cap_samples(&claims, ratio);
        prop_assert_eq!(capped.len(), claims.len());
        let mut sorted: Vec<u64> = claims.iter().map(|&c| c.min(MAX_SAMPLES)).collect();
        sorted.sort_unstable();
        let median = sorted.get(sorted.len().saturating_sub(1) / 2).copied().unwrap_or(1).max(1);
        for (&w, &c) in capped.iter().zip(&claims) {
            prop_assert!(w <= c as f64);
            prop_assert!(w <= MAX_SAMPLES as f64);
            prop_assert!(w <= f64::from(ratio) * median as f64);
        }
        let equal = cap_samples(&vec![same; len], ratio);
        prop_assert!(equal.iter().all(|&w| w == same as f64));
    }
}
