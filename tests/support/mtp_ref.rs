//! An independent, straightforward reference of the MTP draft layer (around-backbone §5.1) for
//! the tests — k3-model's `tests/mtp.rs` and k3-engine's `tests/mtp.rs` include it with
//! `#[path]`. f64 throughout, plain loops, weights read by name from the checkpoint (float
//! experts only), no cache object: each row keeps its own latent and `k_pe`.
//!
//! Row `j`: `x = eh_proj · [RMSNorm_enorm(emb(t_{j+1})) ; RMSNorm_hnorm(h_j)]` (the embedding
//! zeroed at position 0), `x += o_proj((Σ_s p_s v_s) ⊙ σ(g_proj x_in))` with `x_in =
//! RMSNorm_in(x)` over rows `0..=j` (NoPE MLA, latent norms eps 1e-6), `x += FFN(RMSNorm_post(x))`
//! (sigmoid router, top-k by score + bias, renormalised, latent experts, routed scaling,
//! latent norm, up-projection, plus shared experts; or the dense SiTU-GLU MLP), logits =
//! `head · RMSNorm_shared(x)`. A chained draft feeds `x` back as the next row's `h`.
#![allow(dead_code)]

use k3_model::{Checkpoint, Config};

fn w(ck: &Checkpoint, name: &str) -> Vec<f64> {
    ck.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")).to_f32().unwrap().iter().map(|&x| x as f64).collect()
}

fn rms(x: &[f64], wt: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(wt).map(|(v, g)| v * s * g).collect()
}

/// `W x` for `W` `[rows, x.len()]` row-major.
fn mv(wt: &[f64], x: &[f64]) -> Vec<f64> {
    wt.chunks_exact(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn situ(g: f64, u: f64, b: f64, lb: f64) -> f64 {
    b * (g / b).tanh() * sigmoid(g) * (lb * (u / lb).tanh())
}

/// `down · SiTU-GLU(gate x, up x)`.
fn glu(p: &Mlp, x: &[f64], b: f64, lb: f64) -> Vec<f64> {
    let (g, u) = (mv(&p.0, x), mv(&p.1, x));
    let a: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| situ(g, u, b, lb)).collect();
    mv(&p.2, &a)
}

/// (gate, up, down) of a SiTU-GLU MLP.
struct Mlp(Vec<f64>, Vec<f64>, Vec<f64>);

fn mlp(ck: &Checkpoint, p: &str) -> Mlp {
    Mlp(w(ck, &format!("{p}gate_proj.weight")), w(ck, &format!("{p}up_proj.weight")), w(ck, &format!("{p}down_proj.weight")))
}

enum Ffn {
    Dense(Mlp),
    Moe { gate: Vec<f64>, bias: Vec<f64>, down: Vec<f64>, norm: Option<Vec<f64>>, up: Vec<f64>, shared: Option<Mlp>, experts: Vec<Mlp> },
}

/// One MTP layer's weights as f64, and the target's embedding.
pub struct MtpRef {
    cfg: Config,
    embed: Vec<f64>,
    enorm: Vec<f64>,
    hnorm: Vec<f64>,
    eh: Vec<f64>,
    in_norm: Vec<f64>,
    post_norm: Vec<f64>,
    qa: Vec<f64>,
    qa_norm: Vec<f64>,
    qb: Vec<f64>,
    kva: Vec<f64>,
    kva_norm: Vec<f64>,
    kvb: Vec<f64>,
    g: Vec<f64>,
    o: Vec<f64>,
    ffn: Ffn,
    head_norm: Vec<f64>,
    head: Vec<f64>,
}

/// One row's attention keys: `k_pe` `[dr]` and `kv_b_proj · latent` `[nh·(dn+dv)]` (the
/// normed latent expanded).
pub type Key = (Vec<f64>, Vec<f64>);

impl MtpRef {
    /// MTP layer 0 of `ck` (`layers.{num_hidden_layers}.*`).
    pub fn load(ck: &Checkpoint) -> MtpRef {
        let cfg = ck.config.clone();
        let t = &cfg.text;
        let p = format!("language_model.model.layers.{}.", t.num_hidden_layers);
        let a = format!("{p}self_attn.");
        let m = format!("{p}block_sparse_moe.");
        let moe = ck.entry(&format!("{m}gate.weight")).is_some();
        let ffn = if moe {
            Ffn::Moe {
                gate: w(ck, &format!("{m}gate.weight")),
                bias: w(ck, &format!("{m}gate.e_score_correction_bias")),
                down: w(ck, &format!("{m}routed_expert_down_proj.weight")),
                norm: t.latent_moe_use_norm.then(|| w(ck, &format!("{m}routed_expert_norm.weight"))),
                up: w(ck, &format!("{m}routed_expert_up_proj.weight")),
                shared: (t.num_shared_experts > 0).then(|| mlp(ck, &format!("{m}shared_experts."))),
                experts: (0..t.num_experts)
                    .map(|e| {
                        let q = format!("{m}experts.{e}.");
                        Mlp(w(ck, &format!("{q}w1.weight")), w(ck, &format!("{q}w3.weight")), w(ck, &format!("{q}w2.weight")))
                    })
                    .collect(),
            }
        } else {
            Ffn::Dense(mlp(ck, &format!("{p}mlp.")))
        };
        MtpRef {
            embed: w(ck, "language_model.model.embed_tokens.weight"),
            enorm: w(ck, &format!("{p}enorm.weight")),
            hnorm: w(ck, &format!("{p}hnorm.weight")),
            eh: w(ck, &format!("{p}eh_proj.weight")),
            in_norm: w(ck, &format!("{p}input_layernorm.weight")),
            post_norm: w(ck, &format!("{p}post_attention_layernorm.weight")),
            qa: w(ck, &format!("{a}q_a_proj.weight")),
            qa_norm: w(ck, &format!("{a}q_a_layernorm.weight")),
            qb: w(ck, &format!("{a}q_b_proj.weight")),
            kva: w(ck, &format!("{a}kv_a_proj_with_mqa.weight")),
            kva_norm: w(ck, &format!("{a}kv_a_layernorm.weight")),
            kvb: w(ck, &format!("{a}kv_b_proj.weight")),
            g: w(ck, &format!("{a}g_proj.weight")),
            o: w(ck, &format!("{a}o_proj.weight")),
            ffn,
            head_norm: w(ck, &format!("{p}shared_head.norm.weight")),
            head: w(ck, &format!("{p}shared_head.head.weight")),
            cfg,
        }
    }

    fn ffn(&self, x: &[f64]) -> Vec<f64> {
        let t = &self.cfg.text;
        let (b, lb, eps) = (t.activation_situ_beta as f64, t.activation_situ_linear_beta as f64, t.rms_norm_eps as f64);
        match &self.ffn {
            Ffn::Dense(m) => glu(m, x, b, lb),
            Ffn::Moe { gate, bias, down, norm, up, shared, experts } => {
                let s: Vec<f64> = mv(gate, x).into_iter().map(sigmoid).collect();
                let mut idx: Vec<usize> = (0..s.len()).collect();
                idx.sort_by(|&i, &j| (s[j] + bias[j]).partial_cmp(&(s[i] + bias[i])).unwrap().then(i.cmp(&j)));
                idx.truncate(t.num_experts_per_token);
                let sum: f64 = idx.iter().map(|&i| s[i]).sum();
                let z = mv(down, x);
                let mut r = vec![0f64; z.len()];
                for &e in &idx {
                    let wgt = if t.moe_renormalize { s[e] / sum } else { s[e] };
                    let y = glu(&experts[e], &z, b, lb);
                    r.iter_mut().zip(&y).for_each(|(a, y)| *a += wgt * y);
                }
                r.iter_mut().for_each(|v| *v *= t.routed_scaling_factor as f64);
                if let Some(nw) = norm {
                    r = rms(&r, nw, eps);
                }
                let mut out = mv(up, &r);
                if let Some(sh) = shared {
                    out.iter_mut().zip(glu(sh, x, b, lb)).for_each(|(a, s)| *a += s);
                }
                out
            }
        }
    }

    /// One row at position `pos` (its keys appended to `keys`, which hold rows `0..pos`): token
    /// `tok`'s embedding (zeroed at position 0) with hidden row `hid`. Returns the pre-norm `x`
    /// and the logits.
    pub fn row(&self, keys: &mut Vec<Key>, pos: usize, tok: u32, hid: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let t = &self.cfg.text;
        let (h, eps) = (t.hidden_size, t.rms_norm_eps as f64);
        let (nh, dn, dr, dv, r) = (t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank);
        assert_eq!(keys.len(), pos, "rows come in position order");
        let emb: Vec<f64> = if pos == 0 { vec![0.0; h] } else { self.embed[tok as usize * h..(tok as usize + 1) * h].to_vec() };
        let mut cat = rms(&emb, &self.enorm, eps); // embedding first
        cat.extend(rms(hid, &self.hnorm, eps));
        let mut x = mv(&self.eh, &cat);
        // MLA over rows 0..=pos.
        let xin = rms(&x, &self.in_norm, eps);
        let q = mv(&self.qb, &rms(&mv(&self.qa, &xin), &self.qa_norm, 1e-6));
        let ckv = mv(&self.kva, &xin);
        keys.push((ckv[r..].to_vec(), mv(&self.kvb, &rms(&ckv[..r], &self.kva_norm, 1e-6))));
        let gate = mv(&self.g, &xin);
        let mut o = vec![0f64; nh * dv];
        for hd in 0..nh {
            let qh = &q[hd * (dn + dr)..(hd + 1) * (dn + dr)];
            let sc: Vec<f64> = (0..=pos)
                .map(|s| {
                    let kn = &keys[s].1[hd * (dn + dv)..hd * (dn + dv) + dn];
                    let nope: f64 = qh[..dn].iter().zip(kn).map(|(a, b)| a * b).sum();
                    let pe: f64 = qh[dn..].iter().zip(&keys[s].0).map(|(a, b)| a * b).sum();
                    (nope + pe) / ((dn + dr) as f64).sqrt()
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for (s, es) in e.iter().enumerate() {
                let vv = &keys[s].1[hd * (dn + dv) + dn..(hd + 1) * (dn + dv)];
                for j in 0..dv {
                    o[hd * dv + j] += es / z * vv[j];
                }
            }
        }
        o.iter_mut().zip(&gate).for_each(|(a, &g)| *a *= sigmoid(g));
        x.iter_mut().zip(mv(&self.o, &o)).for_each(|(a, b)| *a += b);
        let f = self.ffn(&rms(&x, &self.post_norm, eps));
        x.iter_mut().zip(f).for_each(|(a, b)| *a += b);
        let logits = mv(&self.head, &rms(&x, &self.head_norm, eps));
        (x, logits)
    }

    /// The draft logits for `ctx` (prompt and output; the target consumed all but its last
    /// token, whose hidden rows `hidden[0..ctx.len() − 1]` are given) chained through `drafts`:
    /// entry i is the logits draft i was chosen from (rows `0..n − 1` from the target's rows,
    /// then each draft fed back with the previous row's `x`).
    pub fn draft_logits(&self, ctx: &[u32], hidden: &[Vec<f64>], drafts: &[u32]) -> Vec<Vec<f64>> {
        let n = ctx.len() - 1;
        assert_eq!(hidden.len(), n);
        let mut keys = Vec::new();
        let mut last = (Vec::new(), Vec::new());
        for j in 0..n {
            last = self.row(&mut keys, j, ctx[j + 1], &hidden[j]);
        }
        let mut out = vec![last.1.clone()];
        for (i, &d) in drafts.iter().enumerate().take(drafts.len().saturating_sub(1)) {
            last = self.row(&mut keys, n + i, d, &last.0);
            out.push(last.1.clone());
        }
        out
    }
}
