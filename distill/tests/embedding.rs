//! Embeddings: similar updates get similar embeddings; centring and per-layer normalisation work;
//! bad updates are rejected before any state changes.

#![allow(clippy::unwrap_used)]

mod common;

use kindred_distill::{DistillError, Distiller, EmbedError, Embedder, EmbeddingConfig, Policy};
use kindred_proto::MAX_SKETCH_LEN;

#[test]
fn similar_updates_embed_close_and_different_ones_far() {
    let spec = common::spec();
    let n = spec.numel() as usize;
    let d = Distiller::new(spec, Policy::default(), EmbeddingConfig::default()).unwrap();
    let base = common::update(n, 1);
    let near = common::mix(&base, &common::update(n, 2), 0.3);
    let far = common::update(n, 3);
    let e = |u: &[f32]| d.embed(u).unwrap();
    let (a, b, c) = (e(&base), e(&near), e(&far));
    assert!(a.embedding.sketch.len() <= MAX_SKETCH_LEN);
    assert_eq!(a.margins.len(), 256);
    let cos_near = a.embedding.cosine(&b.embedding);
    let cos_far = a.embedding.cosine(&c.embedding);
    assert!(cos_near > 0.8, "near {cos_near}");
    assert!(cos_far.abs() < 0.3, "far {cos_far}");
    let h_near = a.embedding.simhash.hamming(&b.embedding.simhash);
    let h_far = a.embedding.simhash.hamming(&c.embedding.simhash);
    assert!(
        h_near < 70 && h_far > 90,
        "hamming near {h_near} far {h_far}"
    );
}

#[test]
fn layers_are_normalised_and_updates_centred() {
    let spec = common::spec();
    let n = spec.numel() as usize;
    let embedder = Embedder::new(EmbeddingConfig::default()).unwrap();
    let layout = kindred_distill::Layout::new(&spec);
    let base = common::update(n, 1);
    // Scaling one layer by 1000 changes nothing after per-layer normalisation.
    let mut loud = base.clone();
    for v in &mut loud[layout.range(0).unwrap()] {
        *v *= 1000.0;
    }
    let a = embedder.embed(&layout, &base, None).unwrap();
    let b = embedder.embed(&layout, &loud, None).unwrap();
    assert!(a.embedding.cosine(&b.embedding) > 0.999);
    // Two updates sharing a big common component look alike, until it is centred away.
    let common_part = common::update(n, 50);
    let x = common::mix(&common_part, &common::update(n, 51), 0.5);
    let y = common::mix(&common_part, &common::update(n, 52), 0.5);
    let raw = embedder
        .embed(&layout, &x, None)
        .unwrap()
        .embedding
        .cosine(&embedder.embed(&layout, &y, None).unwrap().embedding);
    let centred = embedder
        .embed(&layout, &x, Some(&common_part))
        .unwrap()
        .embedding
        .cosine(
            &embedder
                .embed(&layout, &y, Some(&common_part))
                .unwrap()
                .embedding,
        );
    assert!(
        raw > 0.6 && centred.abs() < 0.3,
        "raw {raw}, centred {centred}"
    );
}

#[test]
fn accept_peer_moves_the_running_mean() {
    let spec = common::spec();
    let n = spec.numel() as usize;
    let mut d = Distiller::new(spec, Policy::default(), EmbeddingConfig::default()).unwrap();
    assert!(d.running_mean().is_none());
    let p1 = common::update(n, 1);
    let p2 = common::update(n, 2);
    d.accept_peer(&p1).unwrap();
    assert_eq!(d.running_mean().unwrap(), &p1[..]);
    d.accept_peer(&p2).unwrap();
    let m = d.running_mean().unwrap();
    assert!((m[5] - (p1[5] + p2[5]) / 2.0).abs() < 1e-6);
    assert_eq!(d.accepted_peers(), 2);
    let mut bad = p1.clone();
    bad[9] = f32::NAN;
    assert!(matches!(
        d.accept_peer(&bad),
        Err(EmbedError::NonFinite {
            layer: 0,
            index: 9,
            ..
        })
    ));
    assert!(matches!(
        d.accept_peer(&p1[1..]),
        Err(EmbedError::Length { .. })
    ));
    assert_eq!(d.accepted_peers(), 2);
}

#[test]
fn bad_updates_leave_state_untouched() {
    let spec = common::spec();
    let n = spec.numel() as usize;
    let mut d = Distiller::new(spec, Policy::default(), EmbeddingConfig::default()).unwrap();
    let _ = d.distill(&common::update(n, 1)).unwrap();
    let before = (d.round(), d.residual().to_vec());
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut u = common::update(n, 2);
        u[n - 3] = bad;
        assert!(matches!(
            d.distill(&u),
            Err(DistillError::Update(EmbedError::NonFinite { layer: 4, .. }))
        ));
        assert_eq!((d.round(), d.residual().to_vec()), before);
    }
    assert!(matches!(
        d.distill(&[0.0; 3]),
        Err(DistillError::Update(EmbedError::Length { found: 3, .. }))
    ));
    assert_eq!((d.round(), d.residual().to_vec()), before);
}

#[test]
fn config_is_validated() {
    for cfg in [
        EmbeddingConfig {
            sketch_dim: 0,
            ..EmbeddingConfig::default()
        },
        EmbeddingConfig {
            sketch_dim: MAX_SKETCH_LEN + 1,
            ..EmbeddingConfig::default()
        },
        EmbeddingConfig {
            mean_decay: 1.0,
            ..EmbeddingConfig::default()
        },
    ] {
        assert!(Embedder::new(cfg).is_err());
    }
}

#[test]
fn distill_embeds_exactly_like_embed() {
    let spec = common::spec();
    let n = spec.numel() as usize;
    let mut d = Distiller::new(spec, Policy::default(), EmbeddingConfig::default()).unwrap();
    for round in 0..3 {
        if round == 2 {
            d.accept_peer(&common::update(n, 40)).unwrap();
        }
        let u = common::update(n, round);
        let standalone = d.embed(&u).unwrap();
        let out = d.distill(&u).unwrap();
        assert_eq!(out.embedding, standalone.embedding, "round {round}");
        assert_eq!(out.margins, standalone.margins);
    }
}

#[test]
fn the_largest_finite_values_embed_like_their_direction() {
    // A layer's bucket sums of values near f32::MAX overflow f32; the embedding must still be
    // the update's direction (a hostile update, or a model a plain mean broke, is finite).
    let spec = common::spec();
    let n = spec.numel() as usize;
    let mut d = Distiller::new(spec, Policy::default(), EmbeddingConfig::default()).unwrap();
    let base = common::update(n, 5);
    let unit: Vec<f32> = base.iter().map(|x| 1.0f32.copysign(*x)).collect();
    let huge: Vec<f32> = base.iter().map(|x| f32::MAX.copysign(*x)).collect();
    let (a, b) = (d.embed(&unit).unwrap(), d.embed(&huge).unwrap());
    let cos = a.embedding.cosine(&b.embedding);
    assert!(cos > 0.999, "{cos}");
    assert!(a.embedding.simhash.hamming(&b.embedding.simhash) <= 2);
    // And a distiller takes such an update without an error.
    let out = d.distill(&huge).unwrap();
    assert_eq!(out.body.layers.len(), 5);
}

/// A node keys on `model − origin + update` summed a layer at a time: the embedding is exactly
/// that of the summed vector, and terms of the wrong length are refused.
#[test]
fn a_sum_embeds_exactly_like_the_summed_vector() {
    let spec = common::spec();
    let n = spec.numel() as usize;
    let d = Distiller::new(spec, Policy::default(), EmbeddingConfig::default()).unwrap();
    for seed in 0..4 {
        let (base, origin, update) = (
            common::update(n, 3 * seed),
            common::update(n, 3 * seed + 1),
            common::update(n, 3 * seed + 2),
        );
        let summed: Vec<f32> = base
            .iter()
            .zip(&origin)
            .zip(&update)
            .map(|((b, o), u)| b - o + u)
            .collect();
        let terms = [(&base[..], 1.0), (&origin[..], -1.0), (&update[..], 1.0)];
        assert_eq!(d.embed_sum(&terms).unwrap(), d.embed(&summed).unwrap());
        assert_eq!(
            d.embed_sum(&[(&update[..], 1.0)]).unwrap(),
            d.embed(&update).unwrap()
        );
    }
    let short = vec![0.5f32; n - 1];
    let full = common::update(n, 1);
    assert!(matches!(
        d.embed_sum(&[(&full[..], 1.0), (&short[..], 1.0)]),
        Err(EmbedError::Length { found, .. }) if found == n - 1
    ));
    // A sum that overflows is a non-finite value, as the materialised sum would be.
    let big = vec![f32::MAX; n];
    assert!(matches!(
        d.embed_sum(&[(&big[..], 1.0), (&big[..], 1.0)]),
        Err(EmbedError::NonFinite { .. })
    ));
}
