#!/usr/bin/env python3
"""One KDA (Kimi Delta Attention) recurrence, computed by fla-core 0.6.0's reference path.

Writes tests/fixtures/kimi_k3/kda-fla.json. Needs torch, einops and fla-core==0.6.0
(`pip install --no-deps fla-core==0.6.0 einops`; the naive path is pure torch, no GPU/triton).

The recurrence (fla/ops/kda/naive.py `naive_recurrent_kda`), per head h, with state
S_t in R^{K x V} (K = key dim rows, V = value dim columns), S_0 = initial_state or 0:

    q_t <- q_t * scale                       scale = K ** -0.5 (applied to q only, AFTER l2norm)
    S   <- diag(exp(g_t)) @ S                1) decay FIRST: row i of S times exp(g_t[i]);
                                                g_t is a per-KEY-channel log-decay (K values
                                                per head and token), g_t <= 0
    u_t  = v_t - S^T k_t                     2) delta rule on the DECAYED state:
    S   <- S + beta_t * k_t u_t^T               S += beta_t * k_t (v_t - S^T k_t)^T
    o_t  = S^T q_t                           3) read out with the UPDATED state (scaled q)

  i.e. S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T (q_t/sqrt(K)).

naive_recurrent_kda does NOT normalize q or k: it takes them as given. In the model path
(fla.ops.kda.chunk_kda(..., use_qk_l2norm_in_kernel=True), which Kimi-Linear/K3 use) q and k
are l2-normalized first, per head over the K channels:  x / sqrt(sum(x^2) + 1e-6).
This fixture stores RAW q/k and the normalized ones ("q", "k" = what the recurrence saw);
normalization is done here with that exact formula (fla's l2norm_fwd is a Triton kernel).
llama.cpp normalizes with eps = rms_norm_eps (1e-5):  x / sqrt(sum(x^2) + 1e-5)
(build_gdn_l2_norm = rms_norm(x, eps/n) / sqrt(n)).

beta_t is a per-head scalar (sigmoid of b_proj in the model). In K3 g_t comes from the
lower-bound gate (fla naive_kda_lowerbound_gate): g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)),
lower_bound = -5.0, so g in (-5, 0); the fixture draws g that way from random pre-activations.

Layout: every tensor is [B=1, T, H, D] like fla (state [B, H, K, V]), row-major nested lists.
Two cases: "zero_state" (initial_state=None) and "with_state" (random initial state).
Each case stores fla's f32 output (`o`, `final_state`), plus an independent float64 numpy
evaluation of the same recurrence (`o_f64`, `final_state_f64`), and fla's naive_chunk_kda
(chunk_size=4) as a cross-check; max abs differences are recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "kimi_k3" / "kda-fla.json"

SEED = 1234
B, T, H, K, V = 1, 12, 2, 8, 8
LOWER_BOUND = -5.0
L2_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrence_f64(q, k, v, g, beta, s0):
    """Independent float64 evaluation. q,k already normalized. Shapes [T,H,D], s0 [H,K,V]."""
    q = q.astype(np.float64) * (K ** -0.5)
    k = k.astype(np.float64)
    v = v.astype(np.float64)
    g = g.astype(np.float64)
    beta = beta.astype(np.float64)
    S = s0.astype(np.float64).copy()
    o = np.zeros((T, H, V))
    for t in range(T):
        for h in range(H):
            S[h] = S[h] * np.exp(g[t, h])[:, None]
            u = v[t, h] - S[h].T @ k[t, h]
            S[h] = S[h] + beta[t, h] * np.outer(k[t, h], u)
            o[t, h] = S[h].T @ q[t, h]
    return o, S


def r(x, nd=9):
    """float32 tensor/array -> nested lists with ~9 significant digits."""
    a = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    return json.loads(json.dumps(np.vectorize(lambda z: float(f"{z:.{nd}g}"))(a).tolist()))


def main():
    import fla
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    gen = torch.Generator().manual_seed(SEED)
    q_raw = torch.randn(B, T, H, K, generator=gen)
    k_raw = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    # centred at -2.5 so exp(g) is mostly 0.5..0.95: the initial state still matters at T=12
    g_pre = torch.randn(B, T, H, K, generator=gen) * 1.5 - 2.5
    g = LOWER_BOUND * torch.sigmoid(g_pre)               # log-decay in (-5, 0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s_init = torch.randn(B, H, K, V, generator=gen) * 0.5
    q = l2norm(q_raw)
    k = l2norm(k_raw)

    cases = {}
    for name, s0 in (("zero_state", None), ("with_state", s_init)):
        o, S = naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=s0, output_final_state=True)
        oc, Sc = naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=s0, output_final_state=True, chunk_size=4)
        s0_np = np.zeros((H, K, V)) if s0 is None else s0[0].numpy()
        o64, S64 = recurrence_f64(q[0].numpy(), k[0].numpy(), v[0].numpy(), g[0].numpy(), beta[0].numpy(), s0_np)
        d_rec_f64 = max(np.abs(o[0].numpy() - o64).max(), np.abs(S[0].numpy() - S64).max())
        d_chunk = max((o - oc).abs().max().item(), (S - Sc).abs().max().item())
        print(f"{name}: max|fla_recurrent - f64| = {d_rec_f64:.3g}, max|fla_recurrent - fla_chunk| = {d_chunk:.3g}")
        assert d_rec_f64 < 1e-5 and d_chunk < 1e-4
        cases[name] = {
            "initial_state": None if s0 is None else r(s0),
            "o": r(o),
            "final_state": r(S),
            "o_f64": r(o64[None], 15),
            "final_state_f64": r(S64[None], 15),
            "max_abs_diff_fla_vs_f64": float(d_rec_f64),
            "max_abs_diff_recurrent_vs_chunk": float(d_chunk),
        }

    doc = {
        "source": f"fla-core {fla.__version__}: fla.ops.kda.naive.naive_recurrent_kda (f32), "
                  "cross-checked with naive_chunk_kda(chunk_size=4) and a float64 numpy loop",
        "recurrence": "S <- diag(exp(g_t)) S; S <- S + beta_t k_t (v_t - S^T k_t)^T; o_t = S^T (q_t * K^-0.5); "
                      "q,k l2-normalized beforehand: x / sqrt(sum(x^2) + 1e-6)",
        "shapes": {"B": B, "T": T, "H": H, "K": K, "V": V,
                   "q/k/g": "[B,T,H,K]", "v/o": "[B,T,H,V]", "beta": "[B,T,H]", "state": "[B,H,K,V]"},
        "scale": K ** -0.5,
        "seed": SEED,
        "lower_bound": LOWER_BOUND,
        "inputs": {
            "q_raw": r(q_raw), "k_raw": r(k_raw),
            "q": r(q), "k": r(k), "v": r(v),
            "g_pre": r(g_pre), "g": r(g), "beta": r(beta),
        },
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
