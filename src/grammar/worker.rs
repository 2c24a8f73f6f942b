//! Where grammars are compiled: each on a thread of its own with a known
//! stack ([`STACK_BYTES`]), at most [`MAX_AT_ONCE`] at a time, awaited for
//! at most [`BUDGET`]. The caller's thread may be anything (a runtime's
//! blocking thread has a 2 MiB stack, a test's thread less), and a grammar
//! that still overflowed the compile thread's stack would abort the
//! process: so the stack is chosen here, far above what a spec within
//! [`super::limits`] needs.
//!
//! llguidance cannot be interrupted while it builds a grammar; its own fuel
//! limits end that work. A compile that outlives the budget is abandoned
//! (the request gets its answer) and runs on to its end while holding its
//! slot, so abandoned compiles cannot pile up: at most [`MAX_AT_ONCE`]
//! threads compile, whatever the clients send.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::GrammarError;

/// The compile thread's stack. Virtual memory: pages are touched only as
/// deep as the compile goes.
pub const STACK_BYTES: usize = 256 * 1024 * 1024;
/// Compiles running at once (each may hold up to llguidance's limits in
/// memory).
pub const MAX_AT_ONCE: usize = 2;
/// How long a request waits for its grammar: for a free slot, then for the
/// compile itself.
pub const BUDGET: Duration = Duration::from_secs(10);

/// Counts the compile threads running (shared by every clone of one
/// `Grammars`).
#[derive(Debug, Default)]
pub(super) struct Slots {
    busy: Mutex<usize>,
    freed: Condvar,
}

/// A taken slot, given back when the compile thread ends (however it ends).
struct Slot(Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        let mut busy = self.0.busy.lock().unwrap_or_else(|e| e.into_inner());
        *busy -= 1;
        self.0.freed.notify_one();
    }
}

impl Slots {
    /// A slot, waiting until `deadline` for one.
    fn take(self: &Arc<Self>, deadline: Instant) -> Option<Slot> {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        while *busy >= MAX_AT_ONCE {
            let left = deadline.checked_duration_since(Instant::now())?;
            busy = self
                .freed
                .wait_timeout(busy, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *busy += 1;
        Some(Slot(self.clone()))
    }
}

/// Runs `compile` on a compile thread and waits for it within `budget`.
/// `label` names the spec in errors.
///
/// Errors: [`GrammarError::Busy`] when no slot frees up or no thread can
/// be started within the budget; [`GrammarError::Invalid`] naming `label`
/// when the compile takes longer than the budget or panics (the panic is
/// logged by the process's panic hook); otherwise `compile`'s own.
pub(super) fn run<T: Send + 'static>(
    slots: &Arc<Slots>,
    label: &str,
    budget: Duration,
    compile: impl FnOnce() -> Result<T, GrammarError> + Send + 'static,
) -> Result<T, GrammarError> {
    let deadline = Instant::now() + budget;
    let busy = || {
        GrammarError::Busy(format!(
            "{label}: the grammar compiler is busy; retry later"
        ))
    };
    let slot = slots.take(deadline).ok_or_else(busy)?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("grammar-compile".into())
        .stack_size(STACK_BYTES)
        .spawn(move || {
            let out = std::panic::catch_unwind(AssertUnwindSafe(compile));
            // Free before answering: whoever gets the answer finds the
            // slot back.
            drop(slot);
            // The waiter may have given up; then nobody needs the result.
            let _ = tx.send(out);
        });
    if spawned.is_err() {
        return Err(busy());
    }
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left) {
        Ok(Ok(result)) => result,
        Ok(Err(_panic)) => Err(GrammarError::Invalid(format!(
            "{label}: the grammar could not be compiled (the compiler failed on it)"
        ))),
        Err(_) => Err(GrammarError::Invalid(format!(
            "{label}: compiling the grammar took longer than {} s; simplify it",
            budget.as_secs_f64()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compile_gets_the_large_stack_whatever_the_callers() {
        let slots = Arc::new(Slots::default());
        // A caller with a tiny stack; the work needs ~8 MiB of it.
        let t = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || {
                run(&slots, "x", BUDGET, || {
                    fn deep(n: u32) -> u32 {
                        let pad = std::hint::black_box([n as u8; 1024]);
                        if n == 0 {
                            0
                        } else {
                            deep(n - 1) + pad[7] as u32 % 2
                        }
                    }
                    Ok(deep(8 * 1024))
                })
            });
        assert!(t.unwrap().join().unwrap().is_ok());
    }

    #[test]
    fn a_panic_and_a_slow_compile_are_invalid_and_slots_come_back() {
        let slots = Arc::new(Slots::default());
        let panicked = run(&slots, "tools", BUDGET, || -> Result<(), _> {
            panic!("boom")
        });
        assert!(
            matches!(&panicked, Err(GrammarError::Invalid(m)) if m.starts_with("tools: ")),
            "{panicked:?}"
        );
        let slow = run(&slots, "s", Duration::from_millis(50), || {
            std::thread::sleep(Duration::from_millis(400));
            Ok(())
        });
        assert!(
            matches!(&slow, Err(GrammarError::Invalid(m)) if m.contains("longer")),
            "{slow:?}"
        );
        // The abandoned compile still holds its slot; the other is free.
        assert!(run(&slots, "s", BUDGET, || Ok(1)).is_ok());
        // Both held: a third waits, and is told the compiler is busy.
        let hold = |ms| {
            let s = slots.clone();
            std::thread::spawn(move || {
                run(&s, "h", BUDGET, move || {
                    std::thread::sleep(Duration::from_millis(ms));
                    Ok(())
                })
            })
        };
        let (a, b) = (hold(600), hold(600));
        std::thread::sleep(Duration::from_millis(100));
        let waited = run(&slots, "w", Duration::from_millis(50), || Ok(()));
        assert!(matches!(waited, Err(GrammarError::Busy(_))), "{waited:?}");
        assert!(a.join().unwrap().is_ok() && b.join().unwrap().is_ok());
        assert_eq!(*slots.busy.lock().unwrap(), 0);
    }
}
