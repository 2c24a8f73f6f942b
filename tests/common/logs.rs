//! Log capture for the tests that check request lines: one global JSON
//! subscriber per test binary (the server logs from its runtime's threads,
//! so a thread-local subscriber would miss lines), and a bounded wait for
//! the line of one request id.

use serde_json::Value;
use specgate::logging::{capture_globally, Captured};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The log of this test binary, captured as JSON lines at `filter` (an
/// `EnvFilter` directive). Installed by the first call; later calls return
/// the same capture whatever their filter.
pub fn captured_log(filter: &str) -> &'static Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| capture_globally(filter).expect("the only subscriber of this binary"))
}

/// Every line of `log` with target `target` (each line must be JSON).
pub fn lines_of_target(log: &Captured, target: &str) -> Vec<Value> {
    log.contents()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .filter(|v| v["target"] == target)
        .collect()
}

/// The one line of `target` for request `id`, waiting for it up to 30 s (a
/// request's line is written when its last holder lets go, just after the
/// client saw its end). Panics when there are two, or none in time.
pub fn line_of(log: &Captured, target: &str, id: &str) -> Value {
    let t = Instant::now();
    loop {
        let found: Vec<Value> = lines_of_target(log, target)
            .into_iter()
            .filter(|v| v["request_id"] == id)
            .collect();
        assert!(found.len() <= 1, "more than one line for {id}: {found:?}");
        if let Some(v) = found.into_iter().next() {
            return v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no {target} line for {id} in:\n{}",
            log.contents()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
