//! Load shapes: a closed loop of N clients each sending its next request as
//! soon as the last one ended, and an open loop of Poisson arrivals at a
//! given rate. Both stop issuing at a request count or a duration,
//! whichever comes first; requests in flight then finish (each bounded by
//! the request timeout), so a run is bounded in count and in time.

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

use crate::client::{stream_request, Failure, RequestOptions, Target, Timing};
use crate::stats::poisson_arrivals;
use crate::workload::Entry;

/// How load is offered.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Shape {
    /// Closed loop: this many requests in flight at all times.
    Concurrency(usize),
    /// Open loop: Poisson arrivals at this many requests per second.
    Rate(f64),
}

impl Shape {
    /// The x value of a chart.
    pub fn value(&self) -> f64 {
        match *self {
            Shape::Concurrency(c) => c as f64,
            Shape::Rate(r) => r,
        }
    }
}

/// When a run stops issuing requests. At least one of the two is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub requests: Option<usize>,
    pub duration: Option<Duration>,
}

/// Hard ceiling on the requests of one run, whatever the bounds say.
pub const MAX_REQUESTS: usize = 1_000_000;

impl Bounds {
    fn count(&self) -> usize {
        self.requests.unwrap_or(MAX_REQUESTS).min(MAX_REQUESTS)
    }
}

/// One request's outcome.
#[derive(Debug, Clone)]
pub struct Record {
    /// Seconds from the run's start to sending.
    pub sent: f64,
    pub result: Result<Timing, Failure>,
}

/// What a run produced: every request, and the wall time from the start to
/// the end of the last request.
pub struct Outcome {
    pub records: Vec<Record>,
    pub elapsed: f64,
}

/// Everything a run needs besides its shape.
#[derive(Clone)]
pub struct Ctx {
    pub target: Arc<Target>,
    pub entries: Arc<Vec<Entry>>,
    pub options: Arc<RequestOptions>,
    pub progress: ProgressBar,
}

impl Ctx {
    async fn one(&self, i: usize, start: Instant) -> Record {
        let entry = &self.entries[i % self.entries.len()];
        let sent = start.elapsed().as_secs_f64();
        let result = stream_request(&self.target, entry, &self.options).await;
        self.progress.inc(1);
        Record { sent, result }
    }
}

/// Runs one load shape until its bounds; `seed` fixes the Poisson schedule.
pub async fn run(ctx: &Ctx, shape: Shape, bounds: Bounds, seed: u64) -> Outcome {
    let start = Instant::now();
    let mut set = JoinSet::new();
    match shape {
        Shape::Concurrency(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..c.max(1) {
                let (ctx, next) = (ctx.clone(), next.clone());
                set.spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        if bounds.duration.is_some_and(|d| start.elapsed() >= d) {
                            break;
                        }
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= bounds.count() {
                            break;
                        }
                        out.push(ctx.one(i, start).await);
                    }
                    out
                });
            }
        }
        Shape::Rate(r) => {
            let horizon = bounds.duration.map_or(f64::INFINITY, |d| d.as_secs_f64());
            let arrivals = poisson_arrivals(r, bounds.count(), horizon, seed);
            for (i, at) in arrivals.into_iter().enumerate() {
                tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
                let ctx = ctx.clone();
                set.spawn(async move { vec![ctx.one(i, start).await] });
            }
        }
    }
    let mut records = Vec::new();
    while let Some(r) = set.join_next().await {
        records.extend(r.expect("request tasks do not panic"));
    }
    records.sort_by(|a, b| a.sent.total_cmp(&b.sent));
    Outcome {
        records,
        elapsed: start.elapsed().as_secs_f64(),
    }
}
