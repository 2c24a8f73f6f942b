//! The step cost model the goodput policy plans with: seconds of one
//! target forward as a function of the rows it carries (prompt chunks,
//! last tokens and drafts), and of one draft-model step as a function of
//! the sequences it advances. Both are curves measured on the machine at
//! startup (the engine times real forwards) and kept current from the
//! step timings the engine sees afterwards, so a draft length is chosen
//! from what this CPU costs, never from a constant tuned elsewhere.
//!
//! A curve is piecewise linear between measured row counts; below its
//! first point it is that point's value (a forward has a floor cost: the
//! weights are read once whatever the rows), past its last it extends the
//! last segment's slope (costs grow linearly once a forward is compute
//! bound). Observations move the one or two points around the observed row
//! count by an exponential moving average, weighted by how close each is,
//! and the curve is kept non-decreasing: more rows never cost less.
//!
//! The verify curve's rows are decode rows (every row's logits wanted and
//! sampled). A prompt row skips the vocabulary projection and sampling,
//! so it counts as [`CostModel::prompt_weight`] of one (measured too);
//! the curve's unit is these weighted rows.

/// Seconds of a forward by row count. Invariant: at least one point, row
/// counts strictly increasing and at least 1, seconds finite, positive and
/// non-decreasing.
#[derive(Debug, Clone, PartialEq)]
pub struct CostCurve {
    points: Vec<(usize, f64)>,
}

impl CostCurve {
    /// A curve through `points` (`(rows, seconds)`), sorted by rows.
    ///
    /// Errors: no point, rows 0 or not strictly increasing, or a time
    /// that is not finite and positive. Times that decrease with rows
    /// (measurement noise) are raised to the previous point's.
    pub fn new(mut points: Vec<(usize, f64)>) -> Result<Self, String> {
        if points.is_empty() {
            return Err("a cost curve needs at least one point".into());
        }
        points.sort_by_key(|p| p.0);
        if points[0].0 == 0 || points.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err("cost curve rows must be distinct and at least 1".into());
        }
        if let Some(bad) = points.iter().find(|p| !(p.1.is_finite() && p.1 > 0.0)) {
            return Err(format!("cost curve time {} at {} rows", bad.1, bad.0));
        }
        let mut c = Self { points };
        c.make_monotone();
        Ok(c)
    }

    /// `(rows, seconds)` as the curve holds them now.
    pub fn points(&self) -> &[(usize, f64)] {
        &self.points
    }

    /// The longest forward the curve has a point for: past it, a
    /// prediction is an extrapolation.
    pub fn last_rows(&self) -> usize {
        self.points[self.points.len() - 1].0
    }

    /// Predicted seconds for `rows` rows (0 for none; fractional rows are
    /// interpolated like whole ones).
    pub fn at(&self, rows: f64) -> f64 {
        if rows <= 0.0 {
            return 0.0;
        }
        let p = &self.points;
        let first = p[0];
        if rows <= first.0 as f64 {
            return first.1;
        }
        match p.iter().position(|q| q.0 as f64 >= rows) {
            Some(i) => {
                let (a, b) = (p[i - 1], p[i]);
                let t = (rows - a.0 as f64) / (b.0 - a.0) as f64;
                a.1 + t * (b.1 - a.1)
            }
            None => {
                let last = p[p.len() - 1];
                let slope = match p.len() {
                    1 => last.1 / last.0 as f64,
                    n => {
                        let prev = p[n - 2];
                        (last.1 - prev.1) / (last.0 - prev.0) as f64
                    }
                };
                last.1 + slope * (rows - last.0 as f64)
            }
        }
    }

    /// Folds one measured forward (`rows`, `secs`) into the curve: each of
    /// the two points around `rows` moves toward the value that would have
    /// predicted it, by `alpha` times its interpolation weight (past the
    /// last point, the last point moves by `alpha`, scaled). Non-finite or
    /// non-positive times and rows below 1 are ignored.
    pub fn observe(&mut self, rows: f64, secs: f64, alpha: f64) {
        if !(rows >= 1.0 && secs.is_finite() && secs > 0.0) {
            return;
        }
        let predicted = self.at(rows);
        if predicted <= 0.0 {
            return;
        }
        // Move the neighbours by the same ratio, so the curve's shape
        // between them is kept and the prediction moves toward `secs`.
        let ratio = secs / predicted;
        let n = self.points.len();
        let weights: Vec<(usize, f64)> = match self.points.iter().position(|q| q.0 as f64 >= rows) {
            Some(0) => vec![(0, 1.0)],
            Some(j) if self.points[j].0 as f64 == rows => vec![(j, 1.0)],
            Some(j) => {
                let (a, b) = (self.points[j - 1].0, self.points[j].0);
                let t = (rows - a as f64) / (b - a) as f64;
                vec![(j - 1, 1.0 - t), (j, t)]
            }
            None if n > 1 => vec![(n - 1, 1.0), (n - 2, 0.5)],
            None => vec![(n - 1, 1.0)],
        };
        for (j, w) in weights {
            self.points[j].1 *= 1.0 + alpha * w * (ratio - 1.0);
        }
        self.make_monotone();
    }

    fn make_monotone(&mut self) {
        for i in 1..self.points.len() {
            if self.points[i].1 < self.points[i - 1].1 {
                self.points[i].1 = self.points[i - 1].1;
            }
        }
    }
}

/// What one engine step costs: the target's forward by rows, and a draft
/// model's step by the sequences it advances (`None` when no draft model
/// is loaded: lookups cost nothing measurable next to a forward).
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    pub verify: CostCurve,
    pub draft: Option<CostCurve>,
    /// Weight of the newest observation in [`CostCurve::observe`].
    pub alpha: f64,
    /// What one prompt row costs in `verify` rows, in (0, 1]: a prompt
    /// chunk wants at most its last row's logits, so its rows skip the
    /// vocabulary projection and sampling a decode row pays (measured
    /// 0.82-0.88 at start for the 1.5B target on a Zen 4). Priced as
    /// decode rows, prompt steps would read dearer than they are, and
    /// folding them into the curve would pull its long end down, making
    /// drafts in long steps look cheap.
    pub prompt_weight: f64,
}

impl CostModel {
    /// Weight of a new step timing (about the last 20 steps count).
    pub const DEFAULT_ALPHA: f64 = 0.05;

    /// A model whose prompt rows cost what decode rows do
    /// ([`Self::with_prompt_weight`] sets what was measured).
    pub fn new(verify: CostCurve, draft: Option<CostCurve>) -> Self {
        Self {
            verify,
            draft,
            alpha: Self::DEFAULT_ALPHA,
            prompt_weight: 1.0,
        }
    }

    /// The model with prompt rows weighted `w` (clamped to [0.1, 1]; a
    /// non-finite `w` keeps 1).
    pub fn with_prompt_weight(mut self, w: f64) -> Self {
        self.prompt_weight = if w.is_finite() {
            w.clamp(0.1, 1.0)
        } else {
            1.0
        };
        self
    }

    /// The verify curve's rows of a forward carrying `decode_rows` decode
    /// rows (last tokens and drafts) and `prompt_rows` prompt rows.
    pub fn verify_rows(&self, decode_rows: usize, prompt_rows: usize) -> f64 {
        decode_rows as f64 + self.prompt_weight * prompt_rows as f64
    }

    /// Predicted seconds of a step: the target forward over `verify_rows`
    /// curve rows ([`Self::verify_rows`]) plus the draft-model steps,
    /// `draft_rows[j]` being the rows of draft step j (fractional where a
    /// catch-up is spread over steps).
    pub fn step_secs(&self, verify_rows: f64, draft_rows: &[f64]) -> f64 {
        let d = self
            .draft
            .as_ref()
            .map_or(0.0, |c| draft_rows.iter().map(|&n| c.at(n)).sum());
        self.verify.at(verify_rows) + d
    }

    /// Predicted seconds of one draft-model forward over `rows` rows (0
    /// without a draft model).
    pub fn draft_secs(&self, rows: f64) -> f64 {
        self.draft.as_ref().map_or(0.0, |c| c.at(rows))
    }

    /// Folds a timed target forward of `decode_rows` decode rows and
    /// `prompt_rows` prompt rows into the model.
    pub fn observe_verify(&mut self, decode_rows: usize, prompt_rows: usize, secs: f64) {
        let rows = self.verify_rows(decode_rows, prompt_rows);
        self.verify.observe(rows, secs, self.alpha);
    }

    /// Folds a timed draft-model step of `rows` rows into the model.
    pub fn observe_draft(&mut self, rows: usize, secs: f64) {
        if let Some(c) = self.draft.as_mut() {
            c.observe(rows as f64, secs, self.alpha);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_and_extrapolates() {
        let c = CostCurve::new(vec![(1, 1.0), (4, 2.5), (8, 4.5)]).unwrap();
        assert_eq!(c.at(0.0), 0.0);
        assert_eq!(c.at(1.0), 1.0);
        assert!((c.at(2.0) - 1.5).abs() < 1e-12);
        assert!((c.at(6.0) - 3.5).abs() < 1e-12);
        // Past the last point: the last segment's slope (0.5 per row).
        assert!((c.at(12.0) - 6.5).abs() < 1e-12);
        assert_eq!(c.at(0.5), 1.0);
    }

    #[test]
    fn bad_points_are_refused_and_noise_is_flattened() {
        assert!(CostCurve::new(vec![]).is_err());
        assert!(CostCurve::new(vec![(0, 1.0)]).is_err());
        assert!(CostCurve::new(vec![(1, 1.0), (1, 2.0)]).is_err());
        assert!(CostCurve::new(vec![(1, f64::NAN)]).is_err());
        let c = CostCurve::new(vec![(1, 2.0), (2, 1.5), (4, 3.0)]).unwrap();
        assert_eq!(c.points()[1].1, 2.0);
    }

    #[test]
    fn observations_converge_to_the_new_cost() {
        let mut c = CostCurve::new(vec![(1, 1.0), (4, 2.0), (8, 4.0)]).unwrap();
        for _ in 0..200 {
            c.observe(4.0, 3.0, 0.1);
        }
        assert!((c.at(4.0) - 3.0).abs() < 1e-3, "{:?}", c.points());
        // Between two points both move; the prediction there converges.
        for _ in 0..400 {
            c.observe(6.0, 5.0, 0.1);
        }
        assert!((c.at(6.0) - 5.0).abs() < 0.05, "{:?}", c.points());
        // Past the end the last point moves.
        for _ in 0..400 {
            c.observe(16.0, 20.0, 0.1);
        }
        assert!((c.at(16.0) - 20.0).abs() < 0.5, "{:?}", c.points());
        // Garbage is ignored.
        let before = c.clone();
        c.observe(0.0, 1.0, 0.1);
        c.observe(0.5, 1.0, 0.1);
        c.observe(3.0, f64::INFINITY, 0.1);
        c.observe(3.0, -1.0, 0.1);
        c.observe(f64::NAN, 1.0, 0.1);
        assert_eq!(c, before);
    }

    #[test]
    fn step_cost_adds_the_draft_steps() {
        let v = CostCurve::new(vec![(1, 10.0), (8, 24.0)]).unwrap();
        let d = CostCurve::new(vec![(1, 4.0), (8, 8.0)]).unwrap();
        let m = CostModel::new(v.clone(), Some(d));
        assert_eq!(m.step_secs(1.0, &[]), 10.0);
        assert_eq!(m.step_secs(8.0, &[1.0, 1.0]), 24.0 + 8.0);
        let none = CostModel::new(v, None);
        assert_eq!(none.step_secs(8.0, &[1.0, 1.0]), 24.0);
    }

    #[test]
    fn prompt_rows_count_by_their_weight() {
        let v = CostCurve::new(vec![(1, 1.0), (64, 64.0)]).unwrap();
        assert_eq!(v.last_rows(), 64);
        let m = CostModel::new(v, None).with_prompt_weight(0.5);
        assert_eq!(m.verify_rows(4, 40), 24.0);
        assert_eq!(m.step_secs(m.verify_rows(4, 40), &[]), 24.0);
        // A prompt step measured as its weighted rows predict leaves the
        // curve where it is.
        let mut same = m.clone();
        same.observe_verify(0, 40, 20.0);
        assert_eq!(same, m);
        assert_eq!(m.clone().with_prompt_weight(7.0).prompt_weight, 1.0);
        assert_eq!(m.clone().with_prompt_weight(0.0).prompt_weight, 0.1);
        assert_eq!(m.with_prompt_weight(f64::NAN).prompt_weight, 1.0);
    }
}
