//! Expert routing shared by the mixture-of-experts families (DeepSeek-V3 /
//! Kimi K2 and Kimi K3): sigmoid scores, a selection-only bias, group-limited
//! top-k, renormalized and scaled weights.

use super::config::MoeConfig;

/// Group-limited top-k over sigmoid scores, as transformers'
/// DeepseekV3TopkRouter: returns (expert, weight) pairs.
pub(crate) fn route(logits: &[f32], bias: &[f32], e: &MoeConfig) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let per = e.n_routed_experts / e.n_group;
    // Descending by value, ties to the lower index.
    let top = |v: &mut Vec<(usize, f32)>, k: usize| {
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(k);
    };
    let mut groups: Vec<(usize, f32)> = choice
        .chunks_exact(per)
        .enumerate()
        .map(|(g, c)| {
            let mut v: Vec<(usize, f32)> = c.iter().copied().enumerate().collect();
            top(&mut v, 2);
            (g, v[0].1 + v[1].1)
        })
        .collect();
    top(&mut groups, e.topk_group);
    let mut cand: Vec<(usize, f32)> = groups
        .iter()
        .flat_map(|&(g, _)| (g * per..(g + 1) * per).map(|x| (x, choice[x])))
        .collect();
    top(&mut cand, e.num_experts_per_tok);
    let mut w: Vec<(usize, f32)> = cand.iter().map(|&(x, _)| (x, scores[x])).collect();
    if e.norm_topk_prob {
        let sum: f32 = w.iter().map(|p| p.1).sum::<f32>() + 1e-20;
        w.iter_mut().for_each(|p| p.1 /= sum);
    }
    w.iter_mut().for_each(|p| p.1 *= e.routed_scaling_factor);
    w
}
