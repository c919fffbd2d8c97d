"""CPU unit tests: chunked KDA == naive recurrence; full model chunked == recurrent; MoE
dense-training path == sparse path; release names. Run: python3 -m pytest -q test_model.py"""
import torch
import model as M
from model import NanoConfig, K3Nano, kda_chunked, kda_recurrent


def rand_kda(B=2, h=3, T=37, dk=8, dv=6, strong=False, dtype=torch.float64):
    g0 = torch.Generator().manual_seed(0)
    q = torch.randn(B, h, T, dk, generator=g0, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, h, T, dk, generator=g0, dtype=dtype), dim=-1)
    v = torch.randn(B, h, T, dv, generator=g0, dtype=dtype)
    g = -5 * torch.sigmoid(torch.randn(B, h, T, dk, generator=g0, dtype=dtype) * (4 if strong else 1))
    beta = torch.sigmoid(torch.randn(B, h, T, generator=g0, dtype=dtype))
    return q, k, v, g, beta


def test_chunked_equals_recurrence():
    for T in (1, 5, 16, 37, 64):
        for chunk in (4, 16, 64):
            for strong in (False, True):
                q, k, v, g, beta = rand_kda(T=T, strong=strong)
                S0 = torch.randn(2, 3, 8, 6, dtype=torch.float64)
                o1, S1 = kda_recurrent(q, k, v, g, beta, S0.clone())
                o2, S2 = kda_chunked(q, k, v, g, beta, S0.clone(), chunk=chunk)
                assert torch.allclose(o1, o2, atol=1e-10, rtol=1e-9), (T, chunk, (o1 - o2).abs().max())
                assert torch.allclose(S1, S2, atol=1e-10, rtol=1e-9)


def test_chunked_fp32_no_overflow_and_grad():
    q, k, v, g, beta = rand_kda(T=64, strong=True, dtype=torch.float32)
    g = torch.full_like(g, -4.99)  # G reaches -320 within a 64 chunk
    for x in (q, k, v, g, beta):
        x.requires_grad_(True)
    o, _ = kda_chunked(q, k, v, g, beta, chunk=64)
    o.sum().backward()
    assert torch.isfinite(o).all() and all(torch.isfinite(x.grad).all() for x in (q, k, v, g, beta))
    o1, _ = kda_recurrent(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach())
    assert (o.detach() - o1).abs().max() < 1e-4


def small_cfg():
    return NanoConfig(vocab_size=64, hidden_size=32, num_hidden_layers=5, kda_layers=[1, 2, 4], full_attn_layers=[3, 5],
                      kda_num_heads=2, kda_head_dim=8, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=8,
                      qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=6, intermediate_size=40, num_experts=4,
                      moe_intermediate_size=12, routed_expert_hidden_size=10, attn_res_block_size=2,
                      routed_scaling_factor=1.5)


def test_model_chunked_vs_recurrent_and_moe_paths():
    torch.manual_seed(0)
    M.ACC = torch.float64
    m = K3Nano(small_cfg()).double()
    for p in m.parameters():  # make the res-mix and router non-trivial
        p.data += 0.05 * torch.randn_like(p)
    for moe in m.moe_layers():
        moe.gate.e_score_correction_bias.normal_()
    ids = torch.randint(0, 64, (2, 40))
    m.eval()
    a = m(ids)
    b = m(ids, recurrent=True)
    assert torch.allclose(a, b, atol=1e-9), (a - b).abs().max()
    m.train()  # dense expert path (dropout is 0)
    c = m(ids)
    assert torch.allclose(a, c, atol=1e-9), (a - c).abs().max()
    # causality: prefix logits do not depend on the future
    d = m.eval()(ids[:, :17])
    assert torch.allclose(a[:, :17], d, atol=1e-9)
    M.ACC = torch.float32


def test_release_names():
    m = K3Nano(small_cfg())
    sd = m.release_state_dict()
    assert "language_model.lm_head.weight" in sd
    assert "language_model.model.layers.0.self_attn.A_log" in sd and sd["language_model.model.layers.0.self_attn.A_log"].shape == (2,)
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight" in sd
    assert "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in sd
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in sd
    assert "language_model.model.output_attn_res_proj.weight" in sd
    assert not any(k.endswith(".load") for k in sd)
