//! The cost model, measured on this machine: at startup (and on demand,
//! [`super::EngineHandle::recalibrate`]) the engine times target forwards
//! over the row counts a step can carry and draft-model steps over the
//! sequence counts one can advance, and a prompt chunk to weigh a prompt
//! row against a decode row, on blocks it takes from the block
//! manager for the purpose, so no running sequence's cache is touched.
//! Afterwards the step timings keep the model current (the engine's
//! `observe_costs`). The model is logged and exported in /metrics.

use super::EngineError;
use crate::kv::{BlockManager, SeqId};
use specgate_draft::{CostCurve, CostModel, ModelDraft};
use specgate_verify::{KvPool, LogitsWanted, Model, SeqInput};
use std::time::{Duration, Instant};

/// Row counts of a target forward measured: the shapes of decode steps
/// (a few sequences, each its last token plus drafts, up to a full batch
/// of 32 with up to three drafts each). Where a forward is compute-bound,
/// a draft row at 32 sequences costs about what it yields, so that region
/// is measured rather than extrapolated: an extrapolation off by a few
/// percent there decides whether drafting wins or loses. Longer forwards
/// (prompt chunks) are extrapolated from the last two points, and the
/// goodput policy drafts no further than the last point
/// ([`specgate_draft::CostCurve::last_rows`]).
pub(crate) const VERIFY_ROWS: [usize; 14] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128];

/// Forwards of up to this many rows are timed twice (the faster counts);
/// longer ones once, since they take longest and noise is a smaller part
/// of them.
const TIMED_TWICE: usize = 32;

/// Sequence counts of a draft step measured.
pub(crate) const DRAFT_ROWS: [usize; 6] = [1, 2, 4, 8, 16, 32];

/// Context the timed forwards attend to, when the pool has room: a
/// forward at position 0 would leave attention out of the cost.
const CONTEXT: usize = 128;

/// Measuring stops taking longer forwards after this long; the curve is
/// extrapolated from what was measured (about 8 s on a 2-core CPU for a
/// 1.5B target and a 0.5B draft).
const TIME_LIMIT: Duration = Duration::from_secs(12);

/// Below this many rows a forward is bound by reading the weights, not by
/// its rows, so what a prompt row saves cannot be told from noise there:
/// prompt rows then count as decode rows.
const PROMPT_WEIGHT_MIN_ROWS: usize = 16;

/// The id the calibration's blocks are held under while it runs.
const CALIBRATION_SEQ: SeqId = SeqId::MAX;

/// What [`measure`] needs of the engine.
pub(crate) struct Calibration<'a> {
    pub target: &'a Model,
    pub pool: &'a mut KvPool,
    pub draft: Option<&'a mut ModelDraft>,
    pub bm: &'a mut BlockManager,
    /// A state slot of the target's pool no sequence holds (ignored by
    /// models without recurrent layers).
    pub state_slot: u32,
    /// Rows one forward may carry, and sequences one step may draft for.
    pub max_rows: usize,
    pub max_seqs: usize,
    /// Rows whose recurrent states one forward may keep (`[kv]
    /// row_state_mib`; `None`: unbounded). Longer forwards are timed
    /// scoring every row without keeping states, so measuring never holds
    /// more than serving may.
    pub state_rows: Option<usize>,
}

/// Times the target (and the draft) on this machine and returns the cost
/// model, or `None` when not even one row fits in the free blocks (the
/// caller keeps its model).
///
/// Errors: a forward failed.
pub(crate) fn measure(c: Calibration) -> Result<Option<CostModel>, EngineError> {
    let started = Instant::now();
    let bs = c.bm.block_size();
    // Positions both models can address, and the free blocks hold.
    let positions = c
        .draft
        .as_ref()
        .map_or(usize::MAX, |d| d.max_position())
        .min(c.target.config().max_position);
    let free_tokens = (c.bm.num_free() * bs).min(positions);
    let longest = VERIFY_ROWS[VERIFY_ROWS.len() - 1].min(c.max_rows);
    let context = CONTEXT.min(free_tokens.saturating_sub(longest));
    let rows_fit = free_tokens.saturating_sub(context).min(c.max_rows);
    if rows_fit == 0 || c.bm.allocate(CALIBRATION_SEQ, context + rows_fit).is_err() {
        return Ok(None);
    }
    let table = c.bm.table(CALIBRATION_SEQ).unwrap_or(&[]).to_vec();
    let result = run(
        c.target,
        c.pool,
        c.draft,
        &table,
        c.state_slot,
        context,
        rows_fit,
        c.max_seqs,
        c.state_rows,
    );
    c.bm.free(CALIBRATION_SEQ);
    // The timed verifications are never committed: their per-row states
    // would stay recorded against the slot until a sequence used it.
    c.pool.release_state(c.state_slot);
    // What serving needs is what the peak reports (the timed forwards
    // kept at most `state_rows` too).
    c.pool.reset_row_state_peak();
    let model = result?;
    log(&model, started.elapsed());
    Ok(Some(model))
}

#[allow(clippy::too_many_arguments)]
fn run(
    target: &Model,
    pool: &mut KvPool,
    draft: Option<&mut ModelDraft>,
    table: &[u32],
    slot: u32,
    context: usize,
    rows_fit: usize,
    max_seqs: usize,
    state_rows: Option<usize>,
) -> Result<CostModel, EngineError> {
    let failed = |e: String| EngineError::Invalid(format!("measuring the cost model: {e}"));
    let vocab = target.config().vocab_size.max(1) as u32;
    let tokens: Vec<u32> = (0..rows_fit as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let time_forward = |pool: &mut KvPool, rows: usize, logits| -> Result<f64, EngineError> {
        let input = SeqInput {
            tokens: &tokens[..rows],
            start_pos: context,
            block_table: table,
            logits,
            state_slot: slot,
        };
        let t = Instant::now();
        target
            .forward_rows(pool, &[input])
            .map_err(|e| failed(e.to_string()))?;
        Ok(t.elapsed().as_secs_f64())
    };
    let time_target = |pool: &mut KvPool, rows| {
        let keeps_states = state_rows.is_none_or(|n| rows <= n + 1);
        let logits = if keeps_states {
            LogitsWanted::All
        } else {
            LogitsWanted::Scored
        };
        time_forward(pool, rows, logits)
    };
    let deadline = Instant::now() + TIME_LIMIT;
    // Warm-up: the first forward pays for page faults and thread start.
    time_target(pool, 1)?;
    let mut verify = Vec::new();
    for rows in VERIFY_ROWS.into_iter().filter(|&r| r <= rows_fit) {
        if !verify.is_empty() && Instant::now() > deadline {
            break;
        }
        let mut secs = time_target(pool, rows)?;
        if rows <= TIMED_TWICE {
            secs = secs.min(time_target(pool, rows)?);
        }
        verify.push((rows, secs));
    }
    let prompt_weight =
        prompt_weight(&verify, |rows| time_forward(pool, rows, LogitsWanted::Last))?;
    let verify = CostCurve::new(verify).map_err(failed)?;
    let draft = match draft {
        None => None,
        Some(d) => {
            let mut time = |rows| d.time_forward(rows, context, table);
            time(1).map_err(|e| failed(e.to_string()))?;
            let deadline = Instant::now() + TIME_LIMIT / 2;
            let mut points = Vec::new();
            for rows in DRAFT_ROWS
                .into_iter()
                .filter(|&r| r <= rows_fit.min(max_seqs.max(1)))
            {
                if !points.is_empty() && Instant::now() > deadline {
                    break;
                }
                let a = time(rows).map_err(|e| failed(e.to_string()))?;
                let b = time(rows).map_err(|e| failed(e.to_string()))?;
                points.push((rows, a.min(b)));
            }
            Some(CostCurve::new(points).map_err(failed)?)
        }
    };
    Ok(CostModel::new(verify, draft).with_prompt_weight(prompt_weight))
}

/// What a prompt row costs in decode rows: a prompt chunk as long as the
/// longest decode forward measured (`verify`, by rows), timed by
/// `time_chunk`, less the one-row forward's floor, over the same for the
/// decode forward. 1 where the longest forward is too short to tell.
///
/// Errors: the chunk's forward failed.
fn prompt_weight(
    verify: &[(usize, f64)],
    time_chunk: impl FnOnce(usize) -> Result<f64, EngineError>,
) -> Result<f64, EngineError> {
    let (Some(&(_, floor)), Some(&(rows, decode))) = (verify.first(), verify.last()) else {
        return Ok(1.0);
    };
    if rows < PROMPT_WEIGHT_MIN_ROWS || decode <= floor {
        return Ok(1.0);
    }
    let chunk = time_chunk(rows)?;
    Ok((chunk - floor) / (decode - floor))
}

/// `rows: milliseconds` pairs of a curve, for the log.
fn describe(curve: &CostCurve) -> String {
    curve
        .points()
        .iter()
        .map(|(r, s)| format!("{r}: {:.2}", s * 1e3))
        .collect::<Vec<_>>()
        .join(", ")
}

fn log(model: &CostModel, took: Duration) {
    tracing::info!(
        verify_ms_by_rows = %describe(&model.verify),
        draft_step_ms_by_rows = %model.draft.as_ref().map(describe).unwrap_or_default(),
        prompt_row_weight = model.prompt_weight,
        took_ms = took.as_millis() as u64,
        "cost model measured"
    );
}
