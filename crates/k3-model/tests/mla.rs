//! MLA invariances on the golden K3 weights: the absorbed form equals the explicit form, for
//! a prefill and for decode steps over a cache; and DSA with `index_topk ≥ length` equals the
//! dense K3 MLA on the same weights.

mod common;
use common::*;
use k3_model::layers::mla::{MlaCache, MlaForm};
use k3_model::model::Mixer;
use k3_model::{Checkpoint, ForwardOpts, Model};
use rand::{Rng, SeedableRng};

#[test]
fn absorbed_equals_explicit() {
    let ck = Checkpoint::open(&fixture("k3_small_mxfp4")).unwrap();
    let model = Model::load(&ck).unwrap();
    let h = model.config.text.hidden_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for layer in &model.layers {
        let Mixer::Mla(m) = &layer.mixer else { continue };
        let t = 37;
        let x: Vec<f32> = (0..t * h).map(|_| rng.random_range(-2.0..2.0)).collect();
        let (mut c1, mut c2) = (MlaCache::default(), MlaCache::default());
        let a = m.forward(&x, t, &mut c1, MlaForm::Explicit).unwrap();
        let b = m.forward(&x, t, &mut c2, MlaForm::Absorbed).unwrap();
        let c = compare(&b, &a, h);
        assert!(c.max_rel_l2 < 1e-5, "prefill: {c:?}");
        // One more token over the filled cache.
        let x1: Vec<f32> = (0..h).map(|_| rng.random_range(-2.0..2.0)).collect();
        let a1 = m.forward(&x1, 1, &mut c1, MlaForm::Explicit).unwrap();
        let b1 = m.forward(&x1, 1, &mut c2, MlaForm::Absorbed).unwrap();
        assert!(compare(&b1, &a1, h).max_rel_l2 < 1e-5);
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn dsa_with_large_topk_equals_dense_mla() {
    let ck = Checkpoint::open(&fixture("k31_small_dsa_f32")).unwrap();
    let r = reference("k31_small_dsa_f32");
    let toks = tokens(&r, 160);
    let mut sparse_big = Model::load(&ck).unwrap();
    let mut dense = Model::load(&ck).unwrap();
    for (a, b) in sparse_big.layers.iter_mut().zip(dense.layers.iter_mut()) {
        if let (Mixer::Mla(ma), Mixer::Mla(mb)) = (&mut a.mixer, &mut b.mixer) {
            ma.indexer.as_mut().expect("DSA layer has an indexer").topk = 4096;
            mb.indexer = None;
        }
    }
    let v = dense.config.text.vocab_size;
    let x = sparse_big.forward(&toks, &mut sparse_big.new_state(), ForwardOpts::default(), None).unwrap();
    let y = dense.forward(&toks, &mut dense.new_state(), ForwardOpts::default(), None).unwrap();
    assert_eq!(x, y, "top-k ≥ length must be exactly dense");
    // And the real top-12 selection does change the result at L160 (DSA is in use).
    let z = Model::load(&ck).unwrap();
    let s = z.forward(&toks, &mut z.new_state(), ForwardOpts::default(), None).unwrap();
    assert!(compare(&s, &y, v).max_rel_l2 > 1e-2);
}
