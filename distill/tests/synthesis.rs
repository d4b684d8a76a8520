//! Synthesis rejects scaled (×100) and sign-flipped peers, merges honest ones, and says why.

#![allow(clippy::unwrap_used)]

mod common;

use kindred_distill::{
    MergeRule, Rejection, SynthConfig, SynthError, UpdateRef, Verdict, synthesize,
};

/// Peers with `samples` each.
fn refs<'a>(updates: impl IntoIterator<Item = &'a [f32]>, samples: u64) -> Vec<UpdateRef<'a>> {
    updates
        .into_iter()
        .map(|update| UpdateRef { update, samples })
        .collect()
}

/// The default configuration under each merge rule.
fn both_rules() -> [SynthConfig; 2] {
    [
        MergeRule::WeightedMean,
        MergeRule::TrimmedMean { trim: 0.2 },
    ]
    .map(|rule| SynthConfig {
        rule,
        ..SynthConfig::default()
    })
}

fn honest(n: usize, own: &[f32], seed: u64) -> Vec<f32> {
    common::mix(own, &common::update(n, seed), 0.5)
}

#[test]
fn rejects_scaled_and_sign_flipped_peers_under_both_rules() {
    let n = 5000;
    let own = common::update(n, 1);
    let good: Vec<Vec<f32>> = (0..4).map(|s| honest(n, &own, 10 + s)).collect();
    let scaled: Vec<f32> = good[0].iter().map(|x| x * 100.0).collect();
    let flipped: Vec<f32> = good[1].iter().map(|x| -x).collect();
    for config in both_rules() {
        let rule = config.rule;
        let mut peers: Vec<UpdateRef<'_>> = good
            .iter()
            .map(|g| UpdateRef {
                update: g,
                samples: 100,
            })
            .collect();
        peers.push(UpdateRef {
            update: &scaled,
            samples: 100,
        });
        peers.push(UpdateRef {
            update: &flipped,
            samples: 100,
        });
        let own_ref = UpdateRef {
            update: &own,
            samples: 100,
        };
        let out = synthesize(own_ref, &peers, &config).unwrap();
        assert_eq!(out.accepted, 4, "{rule:?}");
        assert!(out.verdicts[..4].iter().all(Verdict::is_accepted));
        assert!(matches!(
            out.verdicts[4],
            Verdict::Rejected(Rejection::NormTooLarge { ratio }) if ratio > 50.0
        ));
        assert!(matches!(
            out.verdicts[5],
            Verdict::Rejected(Rejection::CosineBelowGate { cosine }) if cosine < 0.0
        ));
        assert_eq!(out.rejects_by_reason(), vec![("norm", 1), ("cosine", 1)]);
        // The merge is close to the honest average, untouched by the attackers.
        let honest_mean: Vec<f32> = (0..n)
            .map(|i| (own[i] + good.iter().map(|g| g[i]).sum::<f32>()) / 5.0)
            .collect();
        let err: f32 = out
            .merged
            .iter()
            .zip(&honest_mean)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f32>()
            .sqrt();
        let norm: f32 = honest_mean.iter().map(|a| a * a).sum::<f32>().sqrt();
        assert!(err / norm < 0.35, "{rule:?}: relative error {}", err / norm);
    }
}

#[test]
fn weights_follow_samples_and_similarity_and_large_peers_are_clipped() {
    let n = 1000;
    let own = common::update(n, 1);
    let close = honest(n, &own, 2);
    let big: Vec<f32> = close.iter().map(|x| x * 4.0).collect();
    // 2:1, within the default cap on claims (`SynthConfig::max_samples_ratio`).
    let peers = [
        UpdateRef {
            update: &close,
            samples: 200,
        },
        UpdateRef {
            update: &close,
            samples: 100,
        },
        UpdateRef {
            update: &big,
            samples: 100,
        },
    ];
    let own_ref = UpdateRef {
        update: &own,
        samples: 100,
    };
    let out = synthesize(own_ref, &peers, &SynthConfig::default()).unwrap();
    let w = |v: &Verdict| match v {
        Verdict::Accepted { weight, .. } => *weight,
        Verdict::Rejected(r) => panic!("{r:?}"),
    };
    assert!((w(&out.verdicts[0]) / w(&out.verdicts[1]) - 2.0).abs() < 1e-3);
    assert!(matches!(
        out.verdicts[2],
        Verdict::Accepted { clipped: true, .. }
    ));
}

#[test]
fn invalid_peers_are_rejected_not_fatal() {
    let own = vec![1.0f32; 8];
    let short = vec![1.0f32; 7];
    let mut nan = vec![1.0f32; 8];
    nan[2] = f32::NAN;
    let zero = vec![0.0f32; 8];
    let ok = vec![1.0f32; 8];
    let peers = [
        UpdateRef {
            update: &short,
            samples: 1,
        },
        UpdateRef {
            update: &nan,
            samples: 1,
        },
        UpdateRef {
            update: &zero,
            samples: 1,
        },
        UpdateRef {
            update: &ok,
            samples: 0,
        },
    ];
    let out = synthesize(
        UpdateRef {
            update: &own,
            samples: 1,
        },
        &peers,
        &SynthConfig::default(),
    )
    .unwrap();
    let reasons: Vec<&str> = out
        .verdicts
        .iter()
        .map(|v| match v {
            Verdict::Rejected(r) => r.reason(),
            Verdict::Accepted { .. } => "accepted",
        })
        .collect();
    assert_eq!(reasons, ["length", "non_finite", "zero_norm", "no_samples"]);
    assert_eq!(out.merged, own, "only the own update remains");
    let mut bad_own = own.clone();
    bad_own[0] = f32::INFINITY;
    assert_eq!(
        synthesize(
            UpdateRef {
                update: &bad_own,
                samples: 1
            },
            &[] as &[UpdateRef<'_>],
            &SynthConfig::default()
        ),
        Err(SynthError::OwnNonFinite { index: 0 })
    );
    let bad_config = SynthConfig {
        rule: MergeRule::TrimmedMean { trim: 0.5 },
        ..SynthConfig::default()
    };
    assert!(matches!(
        synthesize(
            UpdateRef {
                update: &own,
                samples: 1
            },
            &[] as &[UpdateRef<'_>],
            &bad_config
        ),
        Err(SynthError::Config { .. })
    ));
}

#[test]
fn trimmed_mean_drops_coordinate_outliers() {
    let own = vec![1.0f32, 1.0, 1.0];
    let a = vec![1.1f32, 0.9, 1.0];
    let b = vec![0.9f32, 1.1, 1.0];
    // Within norm limits and positively correlated, but one coordinate is off.
    let c = vec![1.0f32, 1.0, 2.2];
    let d = vec![1.0f32, 1.0, 1.05];
    let peers: Vec<UpdateRef<'_>> = [&a, &b, &c, &d]
        .iter()
        .map(|u| UpdateRef {
            update: u,
            samples: 1,
        })
        .collect();
    let config = SynthConfig {
        rule: MergeRule::TrimmedMean { trim: 0.2 },
        ..SynthConfig::default()
    };
    let out = synthesize(
        UpdateRef {
            update: &own,
            samples: 1,
        },
        &peers,
        &config,
    )
    .unwrap();
    assert_eq!(out.accepted, 4);
    // Coordinate 2 over {1, 1, 1, 2.2, 1.05}: drop 1.0 and 2.2, mean of {1, 1, 1.05}.
    assert!(
        (out.merged[2] - 3.05 / 3.0).abs() < 1e-6,
        "{:?}",
        out.merged
    );
}

/// A top-k peer is judged where it spoke: agreeing there, it passes the gate with a high cosine
/// (its plain cosine with the dense own update is only about √density); contradicting there,
/// it is rejected.
#[test]
fn sparse_peers_are_compared_on_their_support() {
    let n = 10_000;
    let own = common::update(n, 3);
    let peer = honest(n, &own, 30);
    // Keep the 1% largest entries, as a top-k packet would.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| peer[b].abs().total_cmp(&peer[a].abs()));
    let mut sparse = vec![0.0f32; n];
    for &i in order.iter().take(n / 100) {
        sparse[i] = peer[i];
    }
    let against: Vec<f32> = sparse.iter().map(|x| -x).collect();
    let config = SynthConfig {
        min_cosine: 0.3,
        ..SynthConfig::default()
    };
    let out = synthesize(
        UpdateRef {
            update: &own,
            samples: 10,
        },
        &[
            UpdateRef {
                update: &sparse,
                samples: 10,
            },
            UpdateRef {
                update: &against,
                samples: 10,
            },
        ],
        &config,
    )
    .unwrap();
    match out.verdicts[0] {
        Verdict::Accepted { cosine, weight, .. } => {
            assert!(cosine > 0.5, "support cosine {cosine}");
            // Default weights are by samples alone: own and peer count equally.
            assert!((weight - 0.5).abs() < 1e-6, "{weight}");
        }
        ref v => panic!("honest sparse peer rejected: {v:?}"),
    }
    assert!(matches!(
        out.verdicts[1],
        Verdict::Rejected(Rejection::CosineBelowGate { .. })
    ));
}

#[test]
fn noise_level_peers_are_merged_but_one_pointing_away_is_not() {
    // Late in training, honest updates of one task are mostly minibatch noise: independent
    // updates, cosine 0 ± 1/√n with the own one. A gate fixed at 0 drops about half of them;
    // the noise-aware gate keeps nearly all, and still drops the own update turned around.
    let n = 4000;
    let own = common::update(n, 1);
    let noise: Vec<Vec<f32>> = (0..12).map(|s| common::update(n, 100 + s)).collect();
    let away: Vec<f32> = own.iter().map(|x| -0.5 * x).collect();
    let peers = refs(noise.iter().map(Vec::as_slice).chain([&away[..]]), 10);
    let own_ref = UpdateRef {
        update: &own,
        samples: 10,
    };
    let fixed = SynthConfig {
        noise_spreads: 0.0,
        ..SynthConfig::default()
    };
    let out = synthesize(own_ref, &peers, &fixed).unwrap();
    assert!(
        (2..=10).contains(&out.accepted),
        "a gate at 0 keeps about half the noise: {}",
        out.accepted
    );
    let at_zero = out.accepted;
    let out = synthesize(own_ref, &peers, &SynthConfig::default()).unwrap();
    // A 3-spread gate may drop the odd tail of the noise, no more (here one at −0.035 with the
    // rest within ±0.02).
    assert!(
        out.accepted >= 11 && out.accepted > at_zero,
        "{} of 12 kept (gate at 0: {at_zero})",
        out.accepted
    );
    assert!(matches!(
        out.verdicts[12],
        Verdict::Rejected(Rejection::CosineBelowGate { cosine }) if cosine < -0.9
    ));
    // With too few peers to read a spread from, the gate stays at `min_cosine`.
    let few = synthesize(
        own_ref,
        &peers[..SynthConfig::SPREAD_PEERS - 1],
        &SynthConfig::default(),
    )
    .unwrap();
    let fixed_few = synthesize(own_ref, &peers[..SynthConfig::SPREAD_PEERS - 1], &fixed).unwrap();
    assert_eq!(few.verdicts, fixed_few.verdicts);
    // A bad setting is an error, not a silent default.
    let bad = SynthConfig {
        noise_spreads: f32::NAN,
        ..SynthConfig::default()
    };
    assert!(matches!(
        synthesize(own_ref, &peers, &bad),
        Err(SynthError::Config {
            field: "noise_spreads",
            ..
        })
    ));
}

#[test]
fn accepted_peers_come_best_agreement_first() {
    let n = 2000;
    let own = common::update(n, 3);
    // The own update plus noise: the more noise, the lower the cosine.
    let noise = [0.2f32, 0.9, 0.5, 0.7];
    let peers_data: Vec<Vec<f32>> = noise
        .iter()
        .enumerate()
        .map(|(k, &eps)| common::mix(&own, &common::update(n, 50 + k as u64), eps))
        .collect();
    let flipped: Vec<f32> = own.iter().map(|x| -x).collect();
    let peers = refs(
        peers_data.iter().map(Vec::as_slice).chain([&flipped[..]]),
        10,
    );
    let out = synthesize(
        UpdateRef {
            update: &own,
            samples: 10,
        },
        &peers,
        &SynthConfig::default(),
    )
    .unwrap();
    assert_eq!(out.accepted_by_agreement(), vec![0, 2, 3, 1]);
    assert!(!out.verdicts[4].is_accepted());
}

#[test]
fn a_merge_distilled_as_it_is_formed_is_the_whole_merge_distilled() {
    use kindred_distill::{
        Distiller, EmbeddingConfig, PeerUpdate, Policy, Update, decode_update, synthesize_with,
    };
    let spec = common::spec();
    let n = spec.numel() as usize;
    for config in both_rules() {
        let rule = config.rule;
        let new = || Distiller::new(spec.clone(), Policy::hub(), EmbeddingConfig::default());
        let (mut whole, mut formed) = (new().unwrap(), new().unwrap());
        let mut sender = new().unwrap();
        for round in 0..4u64 {
            // Members' pushes as a hub holds them: decoded top-k packets (sparse).
            let pushes: Vec<Update> = (0..5)
                .map(|k| {
                    let own = honest(n, &common::update(n, round), round * 10 + k);
                    let body = sender.distill(&own).unwrap().body;
                    decode_update(&body, &spec).unwrap()
                })
                .collect();
            let own = decode_update(
                &sender.distill(&common::update(n, round)).unwrap().body,
                &spec,
            )
            .unwrap();
            let peers: Vec<PeerUpdate<'_>> = pushes
                .iter()
                .map(|update| PeerUpdate {
                    update,
                    samples: 32,
                })
                .collect();
            let own = PeerUpdate {
                update: &own,
                samples: 32,
            };
            let a = synthesize(own, &peers, &config).unwrap();
            let expected = whole.distill(&a.merged).unwrap();
            let b = synthesize_with(own, &peers, &config, |m| {
                assert_eq!(m.to_vec(), a.merged, "{rule:?}");
                formed.distill_from(&mut m.source()).unwrap()
            })
            .unwrap();
            assert_eq!(b.verdicts, a.verdicts, "{rule:?} round {round}");
            assert_eq!(b.merged.body, expected.body, "{rule:?} round {round}");
            assert_eq!(
                b.merged.embedding, expected.embedding,
                "{rule:?} round {round}"
            );
            assert_eq!(
                formed.residual(),
                whole.residual(),
                "{rule:?} round {round}"
            );
        }
    }
}
