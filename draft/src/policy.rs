//! How many tokens to draft: a fixed k, a table from the current batch size
//! to k (so speculation can turn itself off under load), adaptive from an
//! exponential moving average of each sequence's acceptance, or goodput:
//! every step, the draft lengths of all decoding sequences together that
//! maximise expected tokens per second of step time, from per-position
//! acceptance estimates and the measured cost model ([`crate::cost`]).
//! k = 0 is plain decoding through the same verify path.

use crate::cost::CostModel;

/// The most tokens any policy drafts per sequence and step. It equals the
/// engine's own cap (`specgate::engine::MAX_SPECULATIVE_TOKENS`, checked at
/// compile time there): every drafted token is one more verify row and one
/// more lookahead KV slot per sequence, and past a dozen or so the chance
/// that all of them are accepted is negligible, so a larger k (say a typo of
/// 300) only burns the step's token budget.
pub const MAX_DRAFT_TOKENS: usize = 16;

/// The most rows of a [`DraftPolicy::BatchTable`]: batch sizes strictly
/// increase, so more rows than this is a mistake, not a tuning.
pub const MAX_TABLE_ROWS: usize = 64;

/// The largest adaptive `draft_cost`: a drafted token costing this many
/// one-row verify passes never pays (the policy settles on k = 0 well before
/// it), so a larger value can only be a typo.
pub const MAX_DRAFT_COST: f64 = 10.0;

/// The largest adaptive `probe_every`: a bigger interval would in practice
/// mean never re-probing a sequence that settled on k = 0.
pub const MAX_PROBE_EVERY: u32 = 1024;

/// The draft-length policy.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftPolicy {
    /// Always `k`.
    Fixed { k: usize },
    /// `(max_batch_size, k)` rows sorted by batch size: the first row whose
    /// `max_batch_size >= batch` gives k; past the last row, k = 0.
    BatchTable(Vec<(usize, usize)>),
    /// Per sequence, the k in `min_k..=max_k` that maximizes expected tokens
    /// per unit of work, `E[tokens](k, a) / (1 + draft_cost * k)`, where `a`
    /// is the EMA of the fraction of drafts accepted (weight `alpha` on the
    /// newest round) and `draft_cost` the cost of one more drafted token
    /// (a draft step plus one more verify row) relative to a one-row verify
    /// pass. At k = 0 it probes with k = 1 every `probe_every`
    /// rounds, so a sequence that turns predictable is noticed.
    Adaptive {
        min_k: usize,
        max_k: usize,
        alpha: f64,
        draft_cost: f64,
        initial_acceptance: f64,
        probe_every: u32,
    },
    /// Per step, for all decoding sequences together, the draft lengths
    /// (each in `0..=max_k`) that maximise expected emitted tokens per
    /// second of the step, `(P + sum E_i(k_i)) / T(k)` (`P` the step's
    /// prompt rows, work that drafting slows as well): `E_i` from the
    /// sequence's acceptance per draft position (EMA, weight `alpha`;
    /// positions it has not seen yet come from the engine-wide prior, then
    /// `initial_acceptance`; positions its rounds stop short of drift
    /// toward the deepest one they reach, so a depth judged poor early is
    /// retried), `T` from the [`CostModel`]: the target
    /// forward over every row of the step plus the draft-model steps (a
    /// step per draft depth, over the sequences drafting that deep). See
    /// [`DraftPolicy::plan_step`]. A sequence left at k = 0 for
    /// `probe_every` rounds may be probed with k = 1 (at most one probe
    /// per `probe_every` engine steps), so acceptance that recovers is
    /// noticed without paying a probe every step under load; only where
    /// its drafts would pay at a fresh sequence's acceptance, so a probe
    /// that could not change a plan is not bought.
    Goodput {
        max_k: usize,
        alpha: f64,
        initial_acceptance: f64,
        probe_every: u32,
    },
}

/// How fast, relative to `alpha`, an estimate of a draft position that
/// rounds stop short of drifts toward the deepest position they reach
/// ([`PolicyState::record`]): slow enough that a depth rejected again
/// waits a few rounds of accepted drafts before its next try.
const UNSEEN_DRIFT: f64 = 0.25;

/// Per-sequence memory of the adaptive and goodput policies (also used
/// engine-wide as the prior of new sequences).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyState {
    acceptance: Option<f64>,
    rounds_at_zero: u32,
    /// `positions[p]`: EMA of the chance that draft p is accepted given
    /// that drafts `0..p` were. Positions are observed in order, so the
    /// vector only grows at its end.
    positions: Vec<f64>,
    /// EMA of the extra tokens a tree round emitted beyond its chain's,
    /// per branch node (see [`crate::tree_shape`]); `None` before any.
    branch_gain: Option<f64>,
}

impl PolicyState {
    /// The smoothed extra tokens per branch node, once a tree round has
    /// been observed.
    pub fn branch_gain(&self) -> Option<f64> {
        self.branch_gain
    }

    /// Folds one tree round (`nodes` branch nodes; its accepted path went
    /// `extra` tokens past where its chain alone stopped) into the branch
    /// gain with weight `alpha`. A round without branches is not one.
    pub fn record_branches(&mut self, nodes: usize, extra: usize, alpha: f64) {
        if nodes == 0 {
            return;
        }
        let per_node = extra as f64 / nodes as f64;
        self.branch_gain = Some(match self.branch_gain {
            Some(prev) => prev + alpha * (per_node - prev),
            None => per_node,
        });
    }

    /// The smoothed acceptance fraction, once a round has been observed.
    pub fn acceptance(&self) -> Option<f64> {
        self.acceptance
    }

    /// The smoothed acceptance at each draft position observed so far.
    pub fn positions(&self) -> &[f64] {
        &self.positions
    }

    /// Rounds in a row that drafted nothing.
    pub fn rounds_at_zero(&self) -> u32 {
        self.rounds_at_zero
    }

    /// Folds one round (`proposed` drafts, the first `accepted` kept) into
    /// the estimates with weight `alpha`; a position seen for the first
    /// time starts from `init`.
    pub fn record(&mut self, proposed: usize, accepted: usize, alpha: f64, init: f64) {
        if proposed == 0 {
            self.rounds_at_zero = self.rounds_at_zero.saturating_add(1);
            return;
        }
        self.rounds_at_zero = 0;
        let frac = accepted as f64 / proposed as f64;
        self.acceptance = Some(match self.acceptance {
            Some(prev) => prev + alpha * (frac - prev),
            None => frac,
        });
        // Positions 0..accepted were accepted; `accepted` (if drafted) was
        // the first rejected; later ones were not tried.
        let seen = (accepted + 1).min(proposed);
        for p in 0..seen {
            if p == self.positions.len() {
                let start = self.positions.last().copied().unwrap_or(init);
                self.positions.push(start);
            }
            let hit = if p < accepted { 1.0 } else { 0.0 };
            let v = &mut self.positions[p];
            *v += alpha * (hit - *v);
        }
        // A position is observed only when drafted, and drafted only when
        // its estimate pays: one early rejection at a depth would price it
        // low for good (the goodput plan then stops short of it, so nothing
        // corrects it; seen at concurrency 1 as k = 1 on nearly every
        // step). So positions this round did not reach drift toward the
        // deepest one it did, a step of `alpha * UNSEEN_DRIFT` a round: a
        // depth is retried while the drafts before it keep being accepted,
        // a retry that is rejected again lowers it again, and where the
        // drafts before it fail it follows them down.
        let reach = self.positions[seen - 1];
        for v in &mut self.positions[seen..] {
            *v += alpha * UNSEEN_DRIFT * (reach - *v);
        }
    }

    /// The acceptance estimate at draft position `p`: this state's, else
    /// `prior`'s, else the last position either has seen, else `init`.
    pub fn estimate(&self, prior: &PolicyState, p: usize, init: f64) -> f64 {
        self.positions
            .get(p)
            .or_else(|| prior.positions.get(p))
            .or_else(|| self.positions.last())
            .or_else(|| prior.positions.last())
            .copied()
            .unwrap_or(init)
            .clamp(0.0, 1.0)
    }
}

/// One decoding sequence as [`DraftPolicy::plan_step`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    pub state: &'a PolicyState,
    /// What positions `state` has not seen yet default to: the engine's
    /// estimate over recent sequences drafting the same way.
    pub prior: &'a PolicyState,
    /// The most drafts it may take this step (tokens it may still emit,
    /// room in the pool); 0 when it does not speculate.
    pub max_k: usize,
    /// A draft length the request asked for: taken as is (within `max_k`).
    pub fixed_k: Option<usize>,
    /// `None` when its drafts cost no model step (lookups). `Some(rows)`
    /// for a draft-model sequence: the rows its first draft step feeds
    /// (1, or more while the draft catches up on its context; a caller
    /// may spread a catch-up over the steps it serves).
    pub model_rows: Option<f64>,
}

/// The step [`DraftPolicy::plan_step`] plans within.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepLimits {
    /// Rows one forward may carry (`max_num_batched_tokens`).
    pub budget: usize,
    /// Rows of prompt chunks the step carries besides the decode rows.
    pub prefill_rows: usize,
    /// Whether a sequence left at k = 0 may be probed this step.
    pub probe: bool,
    /// Prompt rows the draft model also runs this step if anyone drafts
    /// with it (the draft's chunked prefill, skipped otherwise).
    pub draft_prefill_rows: usize,
    /// How much better than plain decoding a plan that runs the draft
    /// model must be predicted to be (0.05 = 5%): a margin for the cost
    /// model's error, so that a draft predicted to gain a little does not
    /// lose a little.
    pub model_margin: f64,
    /// The same for a plan that drafts only by lookups (no draft forward):
    /// smaller, since such a plan's only cost is rows the cost curve
    /// prices, but not zero. Where a draft row costs about what it is
    /// expected to yield (many sequences on a CPU whose forward is
    /// compute-bound), the predicted gain is within the curve's error, and
    /// without a margin such drafts lose as often as they win while they
    /// lengthen every sequence's step.
    pub lookup_margin: f64,
    /// What plans that run the draft model really take against what the
    /// cost model predicts for them, relative to other plans (1 = as
    /// predicted; 0 is read as 1): their predicted time is multiplied by
    /// it. The engine measures it, since such a step carries costs no
    /// curve prices whole (the draft's bookkeeping, catch-ups).
    pub model_factor: f64,
    /// Whether the draft model is off this step (the engine measured it
    /// losing at this batch size, [`crate::guard::ModelGuard`]): only
    /// lookups draft, and asked-for lengths are kept.
    pub no_model: bool,
    /// Whether a sequence may not be probed with the draft model this step
    /// (the engine measured the model losing at this batch size, on fewer
    /// steps than a veto needs): a probe buys knowledge of one sequence's
    /// acceptance, of no use where the model loses anyway, and on a
    /// sequence the draft has not followed it pays a whole catch-up.
    pub no_model_probe: bool,
}

/// What [`DraftPolicy::plan_step`] chose.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// k per sequence, in the order given.
    pub ks: Vec<usize>,
    /// The sequence given k = 1 as a probe, if any.
    pub probed: Option<usize>,
    /// Expected emitted tokens (plus the step's prompt rows) and predicted
    /// seconds of the plan (goodput only; 0 otherwise).
    pub expected_tokens: f64,
    pub predicted_secs: f64,
}

/// Expected tokens emitted by one round with k drafts when each draft is
/// accepted with probability a (the accepted run plus one target token).
fn expected_tokens(k: usize, a: f64) -> f64 {
    if a >= 1.0 {
        return (k + 1) as f64;
    }
    (1.0 - a.powi(k as i32 + 1)) / (1.0 - a)
}

impl DraftPolicy {
    /// Checks every parameter against its bounds: no k above
    /// [`MAX_DRAFT_TOKENS`]; a table of 1..=[`MAX_TABLE_ROWS`] rows with
    /// strictly increasing batch sizes of at least 1; adaptive `min_k <=
    /// max_k`, `alpha` in (0, 1], `draft_cost` in [0, [`MAX_DRAFT_COST`]],
    /// `initial_acceptance` in [0, 1], `probe_every` in
    /// 1..=[`MAX_PROBE_EVERY`].
    ///
    /// Errors: a message naming the first bad parameter and its allowed range.
    pub fn validate(&self) -> Result<(), String> {
        let k_ok = |name: &str, k: usize| {
            if k > MAX_DRAFT_TOKENS {
                Err(format!("{name} {k} is out of range 0..={MAX_DRAFT_TOKENS}"))
            } else {
                Ok(())
            }
        };
        match self {
            DraftPolicy::Fixed { k } => k_ok("k", *k),
            DraftPolicy::BatchTable(rows) => {
                if rows.is_empty() || rows.len() > MAX_TABLE_ROWS {
                    return Err(format!(
                        "batch table has {} rows; allowed 1..={MAX_TABLE_ROWS}",
                        rows.len()
                    ));
                }
                for (i, &(batch, k)) in rows.iter().enumerate() {
                    if batch == 0 {
                        return Err(format!(
                            "batch table row {i}: batch size 0; allowed 1 or more"
                        ));
                    }
                    k_ok(&format!("batch table row {i}: k"), k)?;
                }
                if rows.windows(2).any(|w| w[0].0 >= w[1].0) {
                    return Err("batch table rows must have increasing batch sizes".into());
                }
                Ok(())
            }
            DraftPolicy::Goodput {
                max_k,
                alpha,
                initial_acceptance,
                probe_every,
            } => {
                k_ok("max_k", *max_k)?;
                check_smoothing(*alpha, *initial_acceptance, *probe_every)
            }
            DraftPolicy::Adaptive {
                min_k,
                max_k,
                alpha,
                draft_cost,
                initial_acceptance,
                probe_every,
            } => {
                k_ok("max_k", *max_k)?;
                if min_k > max_k {
                    return Err(format!("min_k {min_k} > max_k {max_k}"));
                }
                if !(0.0..=MAX_DRAFT_COST).contains(draft_cost) {
                    return Err(format!(
                        "draft_cost {draft_cost} must be in [0, {MAX_DRAFT_COST}]"
                    ));
                }
                check_smoothing(*alpha, *initial_acceptance, *probe_every)
            }
        }
    }

    /// The k for a sequence now, with `batch` sequences decoding this step.
    /// Goodput plans all sequences of a step together
    /// ([`DraftPolicy::plan_step`]); asked alone it answers its `max_k`.
    pub fn k(&self, batch: usize, state: &PolicyState) -> usize {
        match self {
            DraftPolicy::Fixed { k } => *k,
            DraftPolicy::Goodput { max_k, .. } => *max_k,
            DraftPolicy::BatchTable(rows) => rows
                .iter()
                .find(|(max_batch, _)| batch <= *max_batch)
                .map_or(0, |(_, k)| *k),
            DraftPolicy::Adaptive {
                min_k,
                max_k,
                draft_cost,
                initial_acceptance,
                probe_every,
                ..
            } => {
                let a = state.acceptance.unwrap_or(*initial_acceptance);
                let score = |k: usize| expected_tokens(k, a) / (1.0 + draft_cost * k as f64);
                let best = (*min_k..=*max_k)
                    .max_by(|&x, &y| score(x).total_cmp(&score(y)).then(y.cmp(&x)))
                    .unwrap_or(*min_k);
                if best == 0 && state.rounds_at_zero + 1 >= *probe_every {
                    1.min(*max_k)
                } else {
                    best
                }
            }
        }
    }

    /// Records a round in which `proposed` drafts were offered and
    /// `accepted` kept (the fixed and table policies keep no memory).
    pub fn observe(&self, state: &mut PolicyState, proposed: usize, accepted: usize) {
        match self {
            DraftPolicy::Adaptive {
                alpha,
                initial_acceptance,
                ..
            }
            | DraftPolicy::Goodput {
                alpha,
                initial_acceptance,
                ..
            } => state.record(proposed, accepted, *alpha, *initial_acceptance),
            _ => {}
        }
    }

    /// Folds one tree round into `state`'s branch gain (see
    /// [`PolicyState::record_branches`]), weighted as this policy weighs
    /// acceptance (0.3 for policies without a weight).
    pub fn observe_branches(&self, state: &mut PolicyState, nodes: usize, extra: usize) {
        let alpha = match self {
            DraftPolicy::Adaptive { alpha, .. } | DraftPolicy::Goodput { alpha, .. } => *alpha,
            _ => 0.3,
        };
        state.record_branches(nodes, extra, alpha);
    }

    /// The draft lengths of one step's decoding sequences, each within its
    /// `max_k` (a `fixed_k` is kept as asked) and all within the budget
    /// (`sum (1 + k_i) <= budget` where the decode rows alone fit; for
    /// goodput `sum (1 + k_i) + P <= budget`, P the step's prompt rows,
    /// so drafts never delay a prompt chunk, and never take the step past
    /// the cost curve's last measured row count). The
    /// fixed, table and adaptive policies answer per sequence, as
    /// [`DraftPolicy::k`] with the batch size `seqs.len()`. Goodput
    /// maximises `(P + sum E_i(k_i)) / T(k)` over the plans that draft every
    /// sequence whose next draft is at least as likely to be accepted as
    /// some threshold (one plan per threshold: adding drafts in order of
    /// their chance of acceptance), which is exact when the costs are
    /// linear in the rows and a close bound otherwise. Each threshold is
    /// tried under every depth cap as well, since a draft-model step costs
    /// about the same for one sequence as for all.
    pub fn plan_step(&self, seqs: &[StepSeq], cost: &CostModel, limits: StepLimits) -> StepPlan {
        let n = seqs.len();
        let DraftPolicy::Goodput {
            max_k,
            initial_acceptance,
            probe_every,
            ..
        } = self
        else {
            let mut left = limits.budget.saturating_sub(n);
            let ks = seqs
                .iter()
                .map(|s| {
                    let k = s
                        .fixed_k
                        .unwrap_or_else(|| self.k(n, s.state))
                        .min(s.max_k)
                        .min(left);
                    left -= k;
                    k
                })
                .collect();
            return StepPlan {
                ks,
                ..StepPlan::default()
            };
        };
        // Prompt chunks first: the scheduler gives prompts what the drafts
        // leave of the budget, so drafts that took their rows would delay
        // the prompts (time to first token, and the sequences that join the
        // batch) while the plan counted them as done. A draft displacing a
        // prompt row could not pay anyway: the row costs the same and a
        // prompt row is certain work where a draft is a chance of a token.
        let budget_room = limits.budget.saturating_sub(n + limits.prefill_rows);
        // Nor do the drafts the plan chooses take the step past the longest
        // forward the cost model has a point for: beyond it a step is
        // priced by extrapolation, and a few percent off there decide
        // whether dozens of draft rows win, while such a step (seconds long
        // on a CPU) holds up every token of the batch and every arriving
        // prompt. Lengths requests asked for are kept within the budget.
        let measured = cost.verify.last_rows() as f64;
        let carried = cost.verify_rows(n, limits.prefill_rows);
        let measured_room = (measured - carried).max(0.0).floor() as usize;
        // gains[i][j - 1]: what sequence i's draft j adds to the expected
        // tokens, the chance that its drafts 1..=j are all accepted.
        let gains: Vec<Vec<f64>> = seqs
            .iter()
            .map(|s| {
                let cap = s.fixed_k.unwrap_or(*max_k).min(s.max_k);
                let mut g = 1.0;
                (0..cap)
                    .map(|p| {
                        g *= s.state.estimate(s.prior, p, *initial_acceptance);
                        g
                    })
                    .collect()
            })
            .collect();
        let base = || {
            let mut plan = GoodputSearch::new(seqs, cost, limits, budget_room);
            for (i, s) in seqs.iter().enumerate() {
                if s.fixed_k.is_some() {
                    for &g in &gains[i] {
                        if !plan.add(i, g) {
                            break;
                        }
                    }
                }
            }
            plan.room = plan.room.min(measured_room.max(plan.drafted));
            plan
        };
        // Drafts in order of their chance of acceptance: each prefix of
        // this order is one threshold's plan. A proposal is tried in
        // order, so a sequence's draft j never comes before its draft j-1
        // (its gains do not increase; ties go to the smaller j).
        let mut order: Vec<(f64, usize, usize)> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.fixed_k.is_none() && !(limits.no_model && s.model_rows.is_some()) {
                order.extend(gains[i].iter().enumerate().map(|(j, &g)| (g, i, j + 1)));
            }
        }
        order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let start = base();
        let room = start.room;
        let plain = start.goodput();
        let mut best = (plain, start.ks.clone());
        // A draft-model step costs the same whether one sequence or all of
        // them draft that deep, so the thresholds are tried under every
        // depth cap too: "one draft for everyone" is a plan of its own.
        let deepest = order.iter().map(|o| o.2).max().unwrap_or(0);
        for depth in 1..=deepest {
            let mut plan = base();
            for &(g, i, j) in order.iter().filter(|o| o.2 <= depth) {
                if plan.ks[i] + 1 != j || !plan.add(i, g) {
                    continue;
                }
                let now = plan.goodput();
                let margin = if plan.uses_model() {
                    limits.model_margin
                } else {
                    limits.lookup_margin
                };
                // Strictly better only: an equal plan with fewer drafts wins.
                if now > best.0 * (1.0 + 1e-9) && now >= plain * (1.0 + margin) {
                    best = (now, plan.ks.clone());
                }
            }
        }
        let mut ks = best.1;
        let mut done = GoodputSearch::new(seqs, cost, limits, room);
        for (i, &k) in ks.iter().enumerate() {
            for &g in &gains[i][..k] {
                done.add(i, g);
            }
        }
        // A probe is only for a sequence whose drafts would add to this
        // step's goodput (by the margin a plan needs) if they were accepted
        // as often as the better of the prior and `initial_acceptance` says:
        // where even then they would not pay (a full batch on a
        // compute-bound CPU, a draft catch-up dearer than the step), what a
        // probe learns could not change a plan, and it would only cost its
        // rows. Priced as if the draft had caught up on the sequence (a
        // catch-up is paid once), by the cost model as measured (no
        // `model_factor`), and not by the prior alone: the catch-up grows,
        // and the factor and the prior are learned from drafts, so any of
        // them could otherwise stop probes for good.
        let worth_probing = |i: usize, s: &StepSeq| {
            let fresh = PolicyState::default();
            let mut plan = done.clone();
            plan.limits.model_factor = 0.0;
            let here = plan.goodput();
            let mut g = 1.0;
            for p in 0..gains[i].len() {
                g *= fresh
                    .estimate(s.prior, p, *initial_acceptance)
                    .max(*initial_acceptance);
                if !plan.add_rows(i, g, s.model_rows.map(|_| 1.0)) {
                    break;
                }
                let margin = if plan.uses_model() {
                    limits.model_margin
                } else {
                    limits.lookup_margin
                };
                if plan.goodput() > here * (1.0 + margin.max(1e-9)) {
                    return true;
                }
            }
            false
        };
        let mut probed = None;
        if limits.probe && ks.iter().sum::<usize>() < room {
            probed = seqs
                .iter()
                .enumerate()
                .filter(|(i, s)| {
                    ks[*i] == 0
                        && s.fixed_k.is_none()
                        && !((limits.no_model || limits.no_model_probe) && s.model_rows.is_some())
                        && !gains[*i].is_empty()
                        && s.state.rounds_at_zero + 1 >= *probe_every
                        && worth_probing(*i, s)
                })
                .max_by_key(|(i, s)| (s.state.rounds_at_zero, std::cmp::Reverse(*i)))
                .map(|(i, _)| i);
        }
        if let Some(i) = probed {
            ks[i] = 1;
            done.add(i, gains[i][0]);
        }
        StepPlan {
            ks,
            probed,
            expected_tokens: done.expected,
            predicted_secs: done.secs(),
        }
    }
}

/// The bounds every smoothing policy shares.
fn check_smoothing(alpha: f64, initial_acceptance: f64, probe_every: u32) -> Result<(), String> {
    if !(alpha > 0.0 && alpha <= 1.0) {
        return Err(format!("alpha {alpha} must be in (0, 1]"));
    }
    if !(0.0..=1.0).contains(&initial_acceptance) {
        return Err(format!(
            "initial_acceptance {initial_acceptance} must be in [0, 1]"
        ));
    }
    if !(1..=MAX_PROBE_EVERY).contains(&probe_every) {
        return Err(format!(
            "probe_every {probe_every} must be in 1..={MAX_PROBE_EVERY}"
        ));
    }
    Ok(())
}

/// The goodput search's running plan: draft lengths, expected tokens, and
/// what the step's forwards carry, updated one draft at a time.
#[derive(Clone)]
struct GoodputSearch<'a> {
    seqs: &'a [StepSeq<'a>],
    cost: &'a CostModel,
    limits: StepLimits,
    ks: Vec<usize>,
    expected: f64,
    /// Draft rows the budget still allows.
    room: usize,
    drafted: usize,
    /// Rows of each draft-model step: `[0]` the first (catch-ups), `[j]`
    /// the sequences drafting more than j tokens.
    draft_rows: Vec<f64>,
}

impl<'a> GoodputSearch<'a> {
    fn new(seqs: &'a [StepSeq<'a>], cost: &'a CostModel, limits: StepLimits, room: usize) -> Self {
        let deepest = seqs.iter().map(|s| s.max_k).max().unwrap_or(0);
        Self {
            seqs,
            cost,
            limits,
            ks: vec![0; seqs.len()],
            // Prompt rows are work done too: a draft that slows a step
            // slows its prompt chunks, so it must pay for them as well.
            expected: (seqs.len() + limits.prefill_rows) as f64,
            room,
            drafted: 0,
            draft_rows: vec![0.0; deepest.max(1) + 1],
        }
    }

    /// Drafts one more token for sequence `i`, whose draft adds `gain`
    /// expected tokens; false when the budget is spent.
    fn add(&mut self, i: usize, gain: f64) -> bool {
        self.add_rows(i, gain, self.seqs[i].model_rows)
    }

    /// [`Self::add`] with the sequence's first draft-model step feeding
    /// `model_rows` rows (`None`: a lookup).
    fn add_rows(&mut self, i: usize, gain: f64, model_rows: Option<f64>) -> bool {
        if self.drafted >= self.room {
            return false;
        }
        let k = self.ks[i];
        if let Some(rows) = model_rows {
            self.draft_rows[k] += if k == 0 { rows.max(1.0) } else { 1.0 };
        }
        self.ks[i] = k + 1;
        self.drafted += 1;
        self.expected += gain;
        true
    }

    /// Whether the plan runs the draft model at all.
    fn uses_model(&self) -> bool {
        self.draft_rows[0] > 0.0
    }

    fn secs(&self) -> f64 {
        let rows = self
            .cost
            .verify_rows(self.seqs.len() + self.drafted, self.limits.prefill_rows);
        let prefill = if self.uses_model() {
            self.limits.draft_prefill_rows
        } else {
            0
        };
        let secs =
            self.cost.step_secs(rows, &self.draft_rows) + self.cost.draft_secs(prefill as f64);
        if self.uses_model() && self.limits.model_factor > 0.0 {
            secs * self.limits.model_factor
        } else {
            secs
        }
    }

    fn goodput(&self) -> f64 {
        let t = self.secs();
        if t > 0.0 {
            self.expected / t
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adaptive() -> DraftPolicy {
        DraftPolicy::Adaptive {
            min_k: 0,
            max_k: 8,
            alpha: 0.5,
            draft_cost: 0.1,
            initial_acceptance: 0.6,
            probe_every: 4,
        }
    }

    #[test]
    fn fixed_and_table() {
        let s = PolicyState::default();
        assert_eq!(DraftPolicy::Fixed { k: 3 }.k(99, &s), 3);
        let t = DraftPolicy::BatchTable(vec![(1, 6), (4, 3), (16, 1)]);
        assert!(t.validate().is_ok());
        assert_eq!([1, 2, 4, 5, 16, 17].map(|b| t.k(b, &s)), [6, 3, 3, 1, 1, 0]);
        assert!(DraftPolicy::BatchTable(vec![(4, 1), (2, 1)])
            .validate()
            .is_err());
    }

    #[test]
    fn adaptive_follows_acceptance() {
        let p = adaptive();
        let mut s = PolicyState::default();
        let k0 = p.k(1, &s);
        for _ in 0..10 {
            p.observe(&mut s, 4, 4);
        }
        let high = p.k(1, &s);
        assert!(high > k0 && high == 8, "{k0} -> {high}");
        for _ in 0..10 {
            p.observe(&mut s, high, 0);
        }
        assert_eq!(p.k(1, &s), 0);
        // At k = 0 it probes with 1 every `probe_every` rounds.
        let ks: Vec<usize> = (0..4)
            .map(|_| {
                let k = p.k(1, &s);
                p.observe(&mut s, k, 0);
                k
            })
            .collect();
        assert_eq!(ks, vec![0, 0, 0, 1]);
    }

    #[test]
    fn expected_tokens_matches_geometric_sum() {
        assert_eq!(expected_tokens(3, 1.0), 4.0);
        assert!((expected_tokens(2, 0.5) - 1.75).abs() < 1e-12);
        assert_eq!(expected_tokens(0, 0.3), 1.0);
    }

    #[test]
    fn bad_adaptive_parameters_are_named() {
        let bad = DraftPolicy::Adaptive {
            min_k: 5,
            max_k: 2,
            alpha: 0.5,
            draft_cost: 0.1,
            initial_acceptance: 0.5,
            probe_every: 4,
        };
        assert!(bad.validate().unwrap_err().contains("min_k"));
    }

    #[test]
    fn draft_lengths_are_bounded_by_the_engine_cap() {
        let max = MAX_DRAFT_TOKENS;
        assert!(DraftPolicy::Fixed { k: max }.validate().is_ok());
        let e = DraftPolicy::Fixed { k: max + 1 }.validate().unwrap_err();
        assert!(e.contains("0..=16"), "{e}");
        // A typo of 300 in the table, the example.
        let e = DraftPolicy::BatchTable(vec![(1, 300), (4, 1)])
            .validate()
            .unwrap_err();
        assert!(e.contains("row 0") && e.contains("300"), "{e}");
        assert!(DraftPolicy::BatchTable(vec![(0, 1)]).validate().is_err());
        assert!(DraftPolicy::BatchTable(vec![]).validate().is_err());
        let long: Vec<(usize, usize)> = (1..=MAX_TABLE_ROWS + 1).map(|b| (b, 1)).collect();
        assert!(DraftPolicy::BatchTable(long).validate().is_err());
        let with = |f: &dyn Fn(&mut DraftPolicy)| {
            let mut p = adaptive();
            f(&mut p);
            p.validate()
        };
        let set = |p: &mut DraftPolicy, which: usize| {
            if let DraftPolicy::Adaptive {
                max_k,
                draft_cost,
                probe_every,
                ..
            } = p
            {
                match which {
                    0 => *max_k = max + 1,
                    1 => *draft_cost = f64::INFINITY,
                    2 => *draft_cost = MAX_DRAFT_COST * 2.0,
                    _ => *probe_every = MAX_PROBE_EVERY + 1,
                }
            }
        };
        for (which, name) in ["max_k", "draft_cost", "draft_cost", "probe_every"]
            .into_iter()
            .enumerate()
        {
            let e = with(&|p| set(p, which)).unwrap_err();
            assert!(e.contains(name), "{which}: {e}");
        }
    }

    fn goodput(max_k: usize) -> DraftPolicy {
        DraftPolicy::Goodput {
            max_k,
            alpha: 0.3,
            initial_acceptance: 0.6,
            probe_every: 4,
        }
    }

    /// A state whose every position has acceptance `a`.
    fn accepting(a: f64) -> PolicyState {
        PolicyState {
            acceptance: Some(a),
            rounds_at_zero: 0,
            positions: vec![a; MAX_DRAFT_TOKENS],
            branch_gain: None,
        }
    }

    fn curve(points: &[(usize, f64)]) -> CostCurve {
        CostCurve::new(points.to_vec()).unwrap()
    }

    /// Verify costs `base + per_row * rows`; a draft step `draft`
    /// (constant per step plus a little per row) or none.
    fn costs(base: f64, per_row: f64, draft: Option<f64>) -> CostModel {
        let v = curve(&[(1, base + per_row), (64, base + 64.0 * per_row)]);
        let d = draft.map(|d| curve(&[(1, d), (64, d * 2.0)]));
        CostModel::new(v, d)
    }

    const NO_PRIOR: &PolicyState = &PolicyState {
        acceptance: None,
        rounds_at_zero: 0,
        positions: Vec::new(),
        branch_gain: None,
    };

    fn seq(state: &PolicyState, model: bool) -> StepSeq<'_> {
        StepSeq {
            state,
            prior: NO_PRIOR,
            max_k: MAX_DRAFT_TOKENS,
            fixed_k: None,
            model_rows: model.then_some(1.0),
        }
    }

    fn limits(budget: usize) -> StepLimits {
        StepLimits {
            budget,
            ..StepLimits::default()
        }
    }

    use crate::cost::{CostCurve, CostModel};

    #[test]
    fn goodput_drafts_nothing_when_nothing_is_accepted() {
        let p = goodput(8);
        let none = accepting(0.0);
        // Even when verification and drafting are nearly free.
        let cheap = costs(1.0, 1e-6, Some(1e-6));
        for n in [1, 4, 32] {
            let seqs = vec![seq(&none, true); n];
            let plan = p.plan_step(&seqs, &cheap, limits(512));
            assert_eq!(plan.ks, vec![0; n], "n = {n}");
        }
    }

    #[test]
    fn goodput_drafts_long_when_verification_is_cheap_and_acceptance_high() {
        let p = goodput(8);
        let high = accepting(0.9);
        // Extra rows almost free (a GPU-like forward), lookups for drafts.
        let cheap = costs(1.0, 0.001, None);
        let seqs = vec![seq(&high, false); 4];
        let plan = p.plan_step(&seqs, &cheap, limits(512));
        assert_eq!(plan.ks, vec![8; 4]);
        // The same acceptance on a CPU whose rows cost as much as the
        // forward's floor, with a draft model of 40% a forward: less or
        // no drafting.
        let dear = costs(1.0, 1.0, Some(0.4));
        let seqs = vec![seq(&high, true); 4];
        let plan = p.plan_step(&seqs, &dear, limits(512));
        assert!(plan.ks.iter().all(|&k| k < 8), "{:?}", plan.ks);
    }

    #[test]
    fn goodput_respects_the_token_budget_and_each_cap() {
        let p = goodput(8);
        let high = accepting(0.95);
        // Measured up to the largest budget, so only the budget binds.
        let cheap = CostModel::new(curve(&[(1, 1.0001), (512, 1.0512)]), None);
        let mut seqs = vec![seq(&high, false); 4];
        seqs[1].max_k = 2;
        for budget in [4, 5, 9, 13, 100] {
            let plan = p.plan_step(&seqs, &cheap, limits(budget));
            let rows: usize = plan.ks.iter().map(|k| k + 1).sum();
            assert!(rows <= budget.max(4), "budget {budget}: {:?}", plan.ks);
            assert!(plan.ks[1] <= 2, "{:?}", plan.ks);
            if budget == 100 {
                assert_eq!(plan.ks, vec![8, 2, 8, 8]);
            }
        }
        // Prompt rows of the step come first: drafts get what they leave.
        let mut l = limits(100);
        for prefill in [0, 80, 90, 96, 200] {
            l.prefill_rows = prefill;
            let plan = p.plan_step(&seqs, &cheap, l);
            let drafts: usize = plan.ks.iter().sum();
            assert_eq!(
                drafts,
                26.min(96usize.saturating_sub(prefill)),
                "{prefill}: {:?}",
                plan.ks
            );
        }
        // Nor past the longest forward the cost model measured (20 rows
        // here): the 4 decode rows and the prompt rows, at their measured
        // weight (0.5), leave the drafts what remains.
        let short = CostModel::new(curve(&[(1, 1.0), (20, 1.002)]), None).with_prompt_weight(0.5);
        for (prefill, drafts) in [(0, 16), (8, 12), (31, 0), (40, 0)] {
            l.prefill_rows = prefill;
            let plan = p.plan_step(&seqs, &short, l);
            assert_eq!(
                plan.ks.iter().sum::<usize>(),
                drafts,
                "{prefill}: {:?}",
                plan.ks
            );
        }
        // Lengths requests asked for are kept past it (within the budget);
        // the plan adds none of its own there.
        let mut asked = seqs.clone();
        for s in asked.iter_mut() {
            s.fixed_k = Some(8);
        }
        l.prefill_rows = 0;
        let plan = p.plan_step(&asked, &short, l);
        assert_eq!(plan.ks, vec![8, 2, 8, 8]);
        asked[3].fixed_k = None;
        let plan = p.plan_step(&asked, &short, l);
        assert_eq!(plan.ks, vec![8, 2, 8, 0]);
        // A length the request asked for is kept, whatever it costs.
        seqs[0].fixed_k = Some(3);
        let none = accepting(0.0);
        seqs[2].state = &none;
        let plan = p.plan_step(&seqs, &costs(1.0, 5.0, Some(5.0)), limits(100));
        assert_eq!(plan.ks[0], 3);
        assert_eq!(plan.ks[2], 0);
    }

    #[test]
    fn goodput_follows_the_cost_model_when_it_changes() {
        let p = goodput(6);
        let st = accepting(0.7);
        let seqs = vec![seq(&st, true); 8];
        let mut model = costs(1.0, 0.002, Some(0.05));
        let before = p.plan_step(&seqs, &model, limits(512));
        assert!(before.ks.iter().all(|&k| k >= 2), "{:?}", before.ks);
        // The machine turns out slower per row and the draft dearer
        // (another tenant, an AVX2 CPU): step timings move the curves.
        for _ in 0..300 {
            for rows in [8, 16, 32, 56] {
                model.observe_verify(rows, 0, 1.0 + rows as f64);
            }
            model.observe_draft(8, 0.8);
            model.observe_draft(1, 0.7);
        }
        let after = p.plan_step(&seqs, &model, limits(512));
        assert_eq!(after.ks, vec![0; 8], "{:?}", model);
    }

    /// Issue 56's case: the verify curve of the real 1.5B measured on an
    /// AVX-512 Xeon (1 row 35 ms ... 128 rows 833 ms), and the curve AMX
    /// tiles aim at (16 rows within 1.5x of one, 128 rows 4x cheaper).
    /// The policy follows the start-up calibration with nothing retuned:
    /// with prompt lookups (drafts that cost nothing) the cheaper rows make
    /// it draft more at concurrency 4 (4 -> 12 tokens a step) and 16 (0 ->
    /// 16). With a draft model whose step costs 9 ms for one row and 14
    /// for sixteen, they do not (4 -> 4, 0 -> 0 at acceptance 0.7): there
    /// the draft's own steps, not verification, price speculation out, and
    /// the plan must never draft less for cheaper rows.
    #[test]
    fn goodput_drafts_more_once_rows_are_cheap() {
        let p = goodput(8);
        let st = accepting(0.7);
        let draft = || Some(curve(&[(1, 9.0), (16, 14.0), (64, 30.0)]));
        let avx512 = CostModel::new(
            curve(&[
                (1, 35.0),
                (4, 45.0),
                (8, 58.0),
                (16, 103.0),
                (32, 201.0),
                (64, 394.0),
                (128, 833.0),
            ]),
            draft(),
        );
        let amx = CostModel::new(
            curve(&[
                (1, 35.0),
                (4, 37.0),
                (8, 41.0),
                (16, 52.0),
                (32, 75.0),
                (64, 120.0),
                (128, 208.0),
            ]),
            draft(),
        );
        for n in [4, 16] {
            let seqs = vec![seq(&st, true); n];
            let slow: usize = p.plan_step(&seqs, &avx512, limits(512)).ks.iter().sum();
            let fast: usize = p.plan_step(&seqs, &amx, limits(512)).ks.iter().sum();
            let nseqs = vec![seq(&st, false); n];
            let nslow: usize = p.plan_step(&nseqs, &avx512, limits(512)).ks.iter().sum();
            let nfast: usize = p.plan_step(&nseqs, &amx, limits(512)).ks.iter().sum();
            assert!(fast >= slow && nfast > nslow, "concurrency {n}");
        }
    }

    #[test]
    fn goodput_prefers_sequences_whose_draft_has_caught_up() {
        let p = goodput(4);
        let st = accepting(0.8);
        let model = costs(1.0, 0.01, None);
        let mut seqs = vec![seq(&st, true); 2];
        // The second's draft would first run 400 tokens of its context.
        seqs[1].model_rows = Some(400.0);
        let model = CostModel::new(model.verify, Some(curve(&[(1, 0.1), (512, 40.0)])));
        let plan = p.plan_step(&seqs, &model, limits(512));
        assert!(plan.ks[0] > 0 && plan.ks[1] == 0, "{:?}", plan.ks);
    }

    #[test]
    fn goodput_probes_one_sequence_left_at_zero() {
        let p = goodput(4);
        let mut zero = accepting(0.0);
        zero.rounds_at_zero = 10;
        let model = costs(1.0, 0.01, None);
        let seqs = vec![seq(&zero, false); 3];
        let mut l = limits(512);
        assert_eq!(p.plan_step(&seqs, &model, l).ks, vec![0, 0, 0]);
        l.probe = true;
        let plan = p.plan_step(&seqs, &model, l);
        assert_eq!((plan.ks, plan.probed), (vec![1, 0, 0], Some(0)));
    }

    #[test]
    fn goodput_probes_no_model_sequence_where_the_model_measured_losing() {
        let p = goodput(4);
        let mut zero = accepting(0.0);
        zero.rounds_at_zero = 10;
        let cheap = costs(1.0, 0.01, Some(0.05));
        let mut l = limits(512);
        l.probe = true;
        let seqs = vec![seq(&zero, true), seq(&zero, false)];
        assert_eq!(p.plan_step(&seqs, &cheap, l).probed, Some(0));
        // The model measured losing: its sequence is not probed, the
        // lookup's still is.
        l.no_model_probe = true;
        let plan = p.plan_step(&seqs, &cheap, l);
        assert_eq!((plan.ks, plan.probed), (vec![0, 1], Some(1)));
        let seqs = vec![seq(&zero, true); 3];
        assert_eq!(p.plan_step(&seqs, &cheap, l).probed, None);
    }

    #[test]
    fn goodput_probes_only_where_a_fresh_acceptance_would_pay() {
        let p = goodput(4);
        let mut zero = accepting(0.0);
        zero.rounds_at_zero = 10;
        let mut l = limits(512);
        l.probe = true;
        // Compute-bound: 32 rows cost 36, each more row 1, so a draft
        // accepted 60% of the time (the fresh estimate) does not pay its
        // row, where 32 tokens take 36.
        let bound = costs(4.0, 1.0, None);
        let seqs = vec![seq(&zero, false); 32];
        let plan = p.plan_step(&seqs, &bound, l);
        assert_eq!((plan.probed, plan.ks.iter().sum::<usize>()), (None, 0));
        // A draft-model step ten times dearer than the verify pass: even
        // accepted as a fresh sequence's, its drafts would not pay.
        let dear = costs(1.0, 0.01, Some(10.0));
        let seqs = vec![seq(&zero, true); 3];
        assert_eq!(p.plan_step(&seqs, &dear, l).probed, None);
        // With a cheap draft model the same sequences are probed, even
        // where the prior says drafts are rarely accepted (else a proposer
        // everyone gave up on would never be tried again).
        let cheap = costs(1.0, 0.01, Some(0.05));
        assert_eq!(p.plan_step(&seqs, &cheap, l).probed, Some(0));
        let rare = accepting(0.01);
        let seqs: Vec<StepSeq> = seqs
            .into_iter()
            .map(|s| StepSeq { prior: &rare, ..s })
            .collect();
        assert_eq!(p.plan_step(&seqs, &cheap, l).probed, Some(0));
        // A prior better than `initial_acceptance` counts: drafts accepted
        // 99% of the time pay a compute-bound row where 60% do not.
        let sure = accepting(0.99);
        let seqs: Vec<StepSeq> = vec![
            StepSeq {
                prior: &sure,
                ..seq(&zero, false)
            };
            32
        ];
        assert!(p.plan_step(&seqs, &bound, l).probed.is_some());
    }

    #[test]
    fn goodput_estimates_positions_and_falls_back_to_the_prior() {
        let mut s = PolicyState::default();
        // Accepted 2 of 4: positions 0 and 1 hit, 2 missed, 3 unseen.
        s.record(4, 2, 1.0, 0.5);
        assert_eq!(s.positions(), &[1.0, 1.0, 0.0]);
        let mut prior = PolicyState::default();
        prior.record(6, 6, 1.0, 0.5);
        assert_eq!(s.estimate(&prior, 2, 0.5), 0.0);
        assert_eq!(s.estimate(&prior, 4, 0.5), 1.0);
        let fresh = PolicyState::default();
        assert_eq!(fresh.estimate(&PolicyState::default(), 3, 0.25), 0.25);
        assert_eq!(fresh.estimate(&prior, 9, 0.25), 1.0);
        // Rounds without drafts are counted for probing.
        s.record(0, 0, 1.0, 0.5);
        s.record(0, 0, 1.0, 0.5);
        assert_eq!(s.rounds_at_zero(), 2);
    }

    #[test]
    fn goodput_retries_a_depth_judged_poor_early() {
        let p = goodput(8);
        // About the 1.5B/0.5B pair on a CPU: a 40 ms verify pass, 0.5 ms a
        // row more, an 11 ms draft step.
        let cost = costs(40e-3, 0.5e-3, Some(11e-3));
        let k = |s: &PolicyState| p.plan_step(&[seq(s, true)], &cost, limits(512)).ks[0];
        // The second draft was rejected early on, the first is accepted.
        let mut s = PolicyState {
            acceptance: Some(0.8),
            rounds_at_zero: 0,
            positions: vec![0.9, 0.2],
            branch_gain: None,
        };
        assert_eq!(k(&s), 1);
        let mut rounds = 0;
        while k(&s) == 1 {
            s.record(1, 1, 0.3, 0.6);
            rounds += 1;
            assert!(rounds < 40, "depth 2 never retried: {:?}", s.positions());
        }
        // Never above what the positions before it show.
        assert!(s.positions()[1] <= s.positions()[0], "{:?}", s.positions());
        // Retried and rejected again: it drops back.
        s.record(2, 1, 0.3, 0.6);
        assert_eq!(k(&s), 1, "{:?}", s.positions());
        // Where the first draft is rejected too, the depth behind it
        // follows it down, and drafting stops.
        let mut bad = PolicyState {
            acceptance: Some(0.1),
            rounds_at_zero: 0,
            positions: vec![0.1, 0.5],
            branch_gain: None,
        };
        for _ in 0..80 {
            bad.record(1, 0, 0.3, 0.6);
        }
        assert_eq!(k(&bad), 0, "{:?}", bad.positions());
        assert!(bad.positions()[1] < 0.01, "{:?}", bad.positions());
    }

    #[test]
    fn goodput_prices_the_draft_prefill_and_keeps_a_margin() {
        let p = goodput(4);
        let st = accepting(0.6);
        let seqs = vec![seq(&st, true); 4];
        // Drafting one token each: 4 x 1.6 tokens for V(8) + D(4) against
        // 4 tokens for V(4): about 7% better.
        let model = CostModel::new(
            curve(&[(1, 1.0), (4, 1.0), (8, 1.4), (64, 5.0)]),
            Some(curve(&[(1, 0.06), (4, 0.07), (256, 4.0)])),
        );
        let none = p.plan_step(&seqs, &model, limits(512));
        assert!(none.ks.iter().all(|&k| k >= 1), "{:?}", none.ks);
        // A 10% margin refuses that gain; a 5% one takes it.
        let mut l = limits(512);
        l.model_margin = 0.10;
        assert_eq!(p.plan_step(&seqs, &model, l).ks, vec![0; 4]);
        l.model_margin = 0.05;
        assert!(p.plan_step(&seqs, &model, l).ks.iter().all(|&k| k >= 1));
        // The draft would also have to run 200 prompt rows this step.
        l.model_margin = 0.0;
        l.draft_prefill_rows = 200;
        assert_eq!(p.plan_step(&seqs, &model, l).ks, vec![0; 4]);
        // Lookups pay neither.
        let free = vec![seq(&st, false); 4];
        assert!(p.plan_step(&free, &model, l).ks.iter().all(|&k| k >= 1));
    }

    #[test]
    fn goodput_keeps_lookups_off_where_their_gain_is_within_the_margin() {
        let p = goodput(4);
        let sure = accepting(0.95);
        let unsure = accepting(0.0);
        // 32 sequences, one with a one-token lookup likely accepted; past
        // 32 rows each costs 0.16 s (a compute-bound forward): 32.95 tokens
        // in 9.16 s against 32 in 9 s, about 1.2% better than plain.
        let mut seqs = vec![seq(&unsure, false); 31];
        let mut one = seq(&sure, false);
        one.max_k = 1;
        seqs.push(one);
        let model = CostModel::new(curve(&[(1, 1.0), (32, 9.0), (64, 14.12)]), None);
        let mut l = limits(512);
        let plan = p.plan_step(&seqs, &model, l);
        assert_eq!(plan.ks[31], 1, "{:?}", plan.ks);
        assert_eq!(plan.ks[..31], [0; 31]);
        // A 2% margin refuses that gain.
        l.lookup_margin = 0.02;
        assert_eq!(p.plan_step(&seqs, &model, l).ks, vec![0; 32]);
        // It takes a clear one: four sequences on a cheap curve.
        let four = vec![seq(&sure, false); 4];
        let cheap = CostModel::new(curve(&[(1, 1.0), (8, 1.2), (64, 5.0)]), None);
        assert!(p.plan_step(&four, &cheap, l).ks.iter().all(|&k| k >= 1));
    }

    #[test]
    fn goodput_corrects_draft_model_plans_by_their_measured_error() {
        let p = goodput(4);
        let st = accepting(0.8);
        let seqs = vec![seq(&st, true); 4];
        let model = costs(1.0, 0.05, Some(0.2));
        let mut l = limits(512);
        assert!(p.plan_step(&seqs, &model, l).ks.iter().all(|&k| k >= 1));
        // Such steps were measured taking twice the prediction.
        l.model_factor = 2.0;
        assert_eq!(p.plan_step(&seqs, &model, l).ks, vec![0; 4]);
        // Lookups are not draft-model plans.
        let free = vec![seq(&st, false); 4];
        assert!(p.plan_step(&free, &model, l).ks.iter().all(|&k| k >= 1));
    }

    #[test]
    fn goodput_counts_prompt_rows_as_work_drafting_slows() {
        let p = goodput(4);
        let st = accepting(0.7);
        let seqs = vec![seq(&st, false); 8];
        // Rows cost 0.02 each over a floor of 1: 8 rows with one draft
        // each gain 8 x 0.7 tokens for 0.16 s more.
        let model = costs(1.0, 0.02, None);
        let mut l = limits(1024);
        assert!(p.plan_step(&seqs, &model, l).ks.iter().all(|&k| k >= 1));
        // Beside 400 prompt rows the step's time is mostly the prompt's:
        // slowing 408 rows of work by 0.16 s for 5.6 tokens does not pay
        // (priced as tokens over time alone, it would look the same as
        // above, the prompt's time only diluting the drafts' cost).
        l.prefill_rows = 400;
        assert_eq!(p.plan_step(&seqs, &model, l).ks, vec![0; 8]);
    }

    #[test]
    fn goodput_drafts_without_the_model_when_it_is_vetoed() {
        let p = goodput(4);
        let st = accepting(0.9);
        let mut zero = accepting(0.0);
        zero.rounds_at_zero = 99;
        let model = costs(1.0, 0.01, Some(0.05));
        let mut seqs = vec![seq(&st, true), seq(&st, false), seq(&zero, true)];
        let mut l = limits(512);
        l.probe = true;
        let free = p.plan_step(&seqs, &model, l);
        assert!(free.ks[0] > 0 && free.ks[1] > 0, "{:?}", free.ks);
        assert_eq!(free.probed, Some(2));
        l.no_model = true;
        let plan = p.plan_step(&seqs, &model, l);
        // The lookup still drafts; model sequences neither draft nor probe.
        assert_eq!((plan.ks[0], plan.ks[2], plan.probed), (0, 0, None));
        assert!(plan.ks[1] > 0);
        // A length the request asked for is kept.
        seqs[0].fixed_k = Some(2);
        assert_eq!(p.plan_step(&seqs, &model, l).ks[0], 2);
    }

    /// On small random cases, the threshold search finds the exhaustive
    /// optimum or comes within 2% of it.
    #[test]
    fn goodput_is_near_the_exhaustive_optimum() {
        let p = goodput(4);
        let mut x: u64 = 0x9e3779b97f4a7c15;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        for case in 0..300 {
            let states: Vec<PolicyState> = (0..3)
                .map(|_| PolicyState {
                    positions: (0..4).map(|_| rnd()).collect(),
                    ..Default::default()
                })
                .collect();
            let model = costs(1.0, rnd() * 0.5, (case % 2 == 0).then(|| rnd() * 0.6));
            let seqs: Vec<StepSeq> = states.iter().map(|s| seq(s, case % 2 == 0)).collect();
            let plan = p.plan_step(&seqs, &model, limits(512));
            let got = plan.expected_tokens / plan.predicted_secs;
            let mut best = 0.0f64;
            for code in 0..125 {
                let ks = [code % 5, code / 5 % 5, code / 25];
                let mut search = GoodputSearch::new(&seqs, &model, limits(512), 512);
                for (i, &k) in ks.iter().enumerate() {
                    let mut g = 1.0;
                    for pos in 0..k {
                        g *= states[i].positions[pos];
                        search.add(i, g);
                    }
                }
                best = best.max(search.goodput());
            }
            assert!(
                got >= best * 0.98,
                "case {case}: {got} vs {best}, {:?}",
                plan.ks
            );
        }
    }
}
