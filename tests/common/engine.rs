//! Driving the engine directly in tests: reading one request's stream to
//! its end, and waiting until the engine has given everything back.

use specgate::engine::{EngineHandle, EngineStats, Event};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

/// The token ids of a stream read to its `Finished`; panics on an error
/// event or a stream that ends without one.
pub fn collect_tokens(mut rx: UnboundedReceiver<Event>) -> Vec<u32> {
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("stream ended without Finished") {
            Event::Tokens { ids, .. } => out.extend(ids),
            Event::PromptLogprobs(_) => {}
            Event::Finished { .. } => return out,
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

/// Waits until nothing runs or waits and every block and state slot is
/// back; panics after 30 s.
pub fn wait_idle(h: &EngineHandle) -> EngineStats {
    let t = Instant::now();
    loop {
        let s = h.stats();
        if s.running == 0
            && s.waiting == 0
            && s.free_blocks == s.num_blocks
            && s.state_slots_used == 0
        {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "engine never went idle: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}
