//! Where grammars are compiled: each on a thread of its own with a known
//! stack ([`STACK_BYTES`]), at most [`MAX_AT_ONCE`] at a time, behind a
//! queue of their own ([`Queue`]) that holds at most [`MAX_QUEUED`]
//! waiting requests ([`MAX_QUEUED_PER_TENANT`] of one tenant), each
//! waiting at most [`MAX_WAIT`] for its slot and then compiling for at
//! most [`BUDGET`] (the budget measures the grammar, never the queue).
//!
//! The queue is awaited, not blocked on: a request waiting for a compile
//! slot holds no thread, so none of the HTTP layer's blocking places
//! (templating, tokenizing, `/tokenize`) is taken by grammar work. A full
//! queue answers at once ([`GrammarError::Busy`], a 503 with
//! `Retry-After`), as does a wait that reaches [`MAX_WAIT`].
//!
//! The caller's thread may be anything (a runtime's blocking thread has a
//! 2 MiB stack, a test's thread less), and a grammar that still
//! overflowed the compile thread's stack would abort the process: so the
//! stack is chosen here, far above what a spec within
//! [`super::limits`] needs.
//!
//! llguidance cannot be interrupted while it builds one grammar (its
//! cancellation covers decoding only); its own fuel limits and
//! [`super::limits`] bound that work to well under a second. The compile
//! gets the deadline and starts no further work past it (a failed
//! tool-call grammar is blamed on one tool by recompiling each, and that
//! stops at the deadline), so a slot is back about when the budget ends.
//! A compile that outlives the budget is abandoned (the request gets its
//! answer) and finishes its one grammar holding its slot, so abandoned
//! compiles cannot pile up: at most [`MAX_AT_ONCE`] threads compile,
//! whatever the clients send.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::GrammarError;

/// The compile thread's stack. Virtual memory: pages are touched only as
/// deep as the compile goes.
pub const STACK_BYTES: usize = 256 * 1024 * 1024;
/// Compiles running at once (each may hold up to llguidance's limits in
/// memory).
pub const MAX_AT_ONCE: usize = 2;
/// Requests waiting for a compile slot at once; one more is refused at
/// once. A compile within the bounds takes up to about half a second, so
/// a deeper queue would only hold requests until their budget ends.
pub const MAX_QUEUED: usize = 32;
/// Of [`MAX_QUEUED`], how many one tenant (one API key) may hold, so one
/// tenant's schemas cannot keep another's out. Requests without a key
/// (a server without keys) are one tenant that may fill the queue.
pub const MAX_QUEUED_PER_TENANT: usize = MAX_QUEUED / 2;
/// How long a request waits in the queue for a compile slot.
pub const MAX_WAIT: Duration = Duration::from_secs(10);
/// How long one compile may take once it has its slot (longer: the
/// grammar is refused as too complex).
pub const BUDGET: Duration = Duration::from_secs(10);
/// What a refusal for a busy compiler tells the client to wait before it
/// retries (`Retry-After`, seconds): about what the queue takes to move.
pub const RETRY_AFTER_SECS: u64 = 2;

/// The compile queue and its slots, shared by every clone of one
/// `Grammars`.
#[derive(Debug)]
pub struct Queue {
    slots: Arc<Semaphore>,
    /// Waiting requests per tenant (0: the requests without a key).
    waiting: Mutex<HashMap<u64, usize>>,
}

impl Default for Queue {
    fn default() -> Self {
        Self {
            slots: Arc::new(Semaphore::new(MAX_AT_ONCE)),
            waiting: Mutex::new(HashMap::new()),
        }
    }
}

/// One request's place in the queue, given back on drop (when it gets
/// its slot, or gives up, or its caller goes away).
struct Place<'a> {
    queue: &'a Queue,
    tenant: u64,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut waiting = self.queue.lock();
        if let Some(n) = waiting.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                waiting.remove(&self.tenant);
            }
        }
    }
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, usize>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for `tenant`; `None` when the queue, or the tenant's share
    /// of it, is full.
    fn enter(&self, tenant: u64) -> Option<Place<'_>> {
        let mut waiting = self.lock();
        let total: usize = waiting.values().sum();
        let mine = waiting.get(&tenant).copied().unwrap_or(0);
        let share = if tenant == 0 {
            MAX_QUEUED
        } else {
            MAX_QUEUED_PER_TENANT
        };
        if total >= MAX_QUEUED || mine >= share {
            return None;
        }
        *waiting.entry(tenant).or_insert(0) += 1;
        Some(Place {
            queue: self,
            tenant,
        })
    }

    /// Requests waiting now.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.lock().values().sum()
    }

    /// Slots compiling now.
    #[cfg(test)]
    fn running(&self) -> usize {
        MAX_AT_ONCE - self.slots.available_permits()
    }
}

/// Runs `compile` on a compile thread once `queue` has a slot for it
/// (waiting at most `wait`) and waits for it for at most `budget` from
/// the moment it starts. `compile` gets that deadline (it should start no
/// new work past it). `label` names the spec in errors; `tenant` is whose
/// request it is (0: no API key).
///
/// Cancel-safe: dropping the future gives back the request's place (and
/// its slot, unless the compile has started; then the slot comes back
/// when the compile ends).
///
/// Errors: [`GrammarError::Busy`] when the queue or the tenant's share of
/// it is full, no slot frees up within `wait`, or no thread can be
/// started; [`GrammarError::Invalid`] naming `label` when the compile
/// takes longer than the budget or panics (the panic is logged by the
/// process's panic hook); otherwise `compile`'s own.
pub(super) async fn run<T: Send + 'static>(
    queue: &Queue,
    label: &str,
    (wait, budget): (Duration, Duration),
    tenant: u64,
    compile: impl FnOnce(Instant) -> Result<T, GrammarError> + Send + 'static,
) -> Result<T, GrammarError> {
    let busy = |why: &str| GrammarError::Busy(format!("{label}: {why}"));
    let place = queue.enter(tenant).ok_or_else(|| {
        busy(&format!(
            "the grammar compiler's queue is full ({} waiting); retry later",
            if tenant == 0 {
                MAX_QUEUED
            } else {
                MAX_QUEUED_PER_TENANT
            }
        ))
    })?;
    let slot: OwnedSemaphorePermit =
        match tokio::time::timeout(wait, queue.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => slot,
            // Timed out (or the semaphore closed, which it never is).
            _ => {
                return Err(busy(&format!(
                    "the grammar compiler stayed busy for {} s; retry later",
                    wait.as_secs_f64()
                )))
            }
        };
    drop(place);
    let deadline = Instant::now() + budget;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("grammar-compile".into())
        .stack_size(STACK_BYTES)
        .spawn(move || {
            let out = std::panic::catch_unwind(AssertUnwindSafe(|| compile(deadline)));
            // Free before answering: whoever gets the answer finds the
            // slot back.
            drop(slot);
            // The waiter may have given up; then nobody needs the result.
            let _ = tx.send(out);
        });
    if spawned.is_err() {
        return Err(busy("no compile thread could be started; retry later"));
    }
    match tokio::time::timeout_at(deadline.into(), rx).await {
        Ok(Ok(Ok(result))) => result,
        Ok(Ok(Err(_))) | Ok(Err(_)) => Err(GrammarError::Invalid(format!(
            "{label}: the grammar could not be compiled (the compiler failed on it)"
        ))),
        Err(_) => Err(GrammarError::Invalid(format!(
            "{label}: compiling the grammar took longer than {} s; simplify it",
            budget.as_secs_f64()
        ))),
    }
}

/// [`run`] from a thread outside any async runtime (tools, tests,
/// benches), on a runtime of its own for this call.
///
/// Panics when called from inside an async runtime's task (block there
/// on [`run`] instead). Errors: as [`run`].
pub(super) fn run_blocking<T: Send + 'static>(
    queue: &Queue,
    label: &str,
    limits: (Duration, Duration),
    compile: impl FnOnce(Instant) -> Result<T, GrammarError> + Send + 'static,
) -> Result<T, GrammarError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| GrammarError::Busy(format!("{label}: no runtime to wait on: {e}")))?
        .block_on(run(queue, label, limits, 0, compile))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    const LIMITS: (Duration, Duration) = (MAX_WAIT, BUDGET);

    #[test]
    fn the_compile_gets_the_large_stack_whatever_the_callers() {
        let queue = Arc::new(Queue::default());
        // A caller with a tiny stack; the work needs ~8 MiB of it.
        let t = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || {
                run_blocking(&queue, "x", LIMITS, |_| {
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
        let queue = Arc::new(Queue::default());
        let panicked = run_blocking(&queue, "tools", LIMITS, |_| -> Result<(), _> {
            panic!("boom")
        });
        assert!(
            matches!(&panicked, Err(GrammarError::Invalid(m)) if m.starts_with("tools: ")),
            "{panicked:?}"
        );
        let slow = run_blocking(&queue, "s", (MAX_WAIT, Duration::from_millis(50)), |_| {
            std::thread::sleep(Duration::from_millis(400));
            Ok(())
        });
        assert!(
            matches!(&slow, Err(GrammarError::Invalid(m)) if m.contains("longer")),
            "{slow:?}"
        );
        // The abandoned compile still holds its slot; the other is free.
        assert!(run_blocking(&queue, "s", LIMITS, |_| Ok(1)).is_ok());
        // Both held: a third waits, and is told the compiler is busy.
        let hold = |ms| {
            let q = queue.clone();
            std::thread::spawn(move || {
                run_blocking(&q, "h", LIMITS, move |_| {
                    std::thread::sleep(Duration::from_millis(ms));
                    Ok(())
                })
            })
        };
        let (a, b) = (hold(600), hold(600));
        std::thread::sleep(Duration::from_millis(100));
        let waited = run_blocking(&queue, "w", (Duration::from_millis(50), BUDGET), |_| Ok(()));
        assert!(matches!(waited, Err(GrammarError::Busy(_))), "{waited:?}");
        assert!(a.join().unwrap().is_ok() && b.join().unwrap().is_ok());
        assert_eq!((queue.running(), queue.queued()), (0, 0));
    }

    /// Both slots held by compiles that wait for a signal: returns the
    /// signal's senders and the compiles' threads.
    fn hold_both(queue: &Arc<Queue>) -> (Vec<mpsc::Sender<()>>, Vec<std::thread::JoinHandle<()>>) {
        let mut senders = Vec::new();
        let mut threads = Vec::new();
        for _ in 0..MAX_AT_ONCE {
            let (tx, rx) = mpsc::channel::<()>();
            let q = queue.clone();
            senders.push(tx);
            threads.push(std::thread::spawn(move || {
                run_blocking(&q, "hold", LIMITS, move |_| {
                    let _ = rx.recv();
                    Ok(())
                })
                .unwrap();
            }));
        }
        while queue.running() < MAX_AT_ONCE {
            std::thread::sleep(Duration::from_millis(5));
        }
        (senders, threads)
    }

    /// Waiting requests are futures, not threads: a full queue refuses
    /// the next at once; one tenant gets at most its share; a waiter
    /// whose caller goes away frees its place.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_queue_is_bounded_in_all_and_per_tenant() {
        let queue = Arc::new(Queue::default());
        let q = queue.clone();
        let (go, held) = tokio::task::spawn_blocking(move || hold_both(&q))
            .await
            .unwrap();
        let wait = |tenant: u64| {
            let q = queue.clone();
            tokio::spawn(async move { run(&q, "w", LIMITS, tenant, |_| Ok(())).await })
        };
        // One tenant fills its share; the next of it is refused at once.
        let mut waiters: Vec<_> = (0..MAX_QUEUED_PER_TENANT).map(|_| wait(7)).collect();
        while queue.queued() < MAX_QUEUED_PER_TENANT {
            tokio::task::yield_now().await;
        }
        let t = Instant::now();
        let refused = run(&queue, "w", LIMITS, 7, |_| Ok(())).await;
        assert!(matches!(&refused, Err(GrammarError::Busy(m)) if m.contains("full")));
        assert!(
            t.elapsed() < MAX_WAIT / 2,
            "refused only after {:?}",
            t.elapsed()
        );
        // Another tenant still gets in, up to the whole queue.
        waiters.extend((MAX_QUEUED_PER_TENANT..MAX_QUEUED).map(|_| wait(0)));
        while queue.queued() < MAX_QUEUED {
            tokio::task::yield_now().await;
        }
        let refused = run(&queue, "w", LIMITS, 9, |_| Ok(())).await;
        assert!(
            matches!(&refused, Err(GrammarError::Busy(_))),
            "{refused:?}"
        );
        // A waiter that goes away frees its place.
        let gone = waiters.pop().unwrap();
        gone.abort();
        let _ = gone.await;
        assert_eq!(queue.queued(), MAX_QUEUED - 1);
        // The held compiles end: every waiter compiles in turn.
        go.iter().for_each(|tx| tx.send(()).unwrap());
        for w in waiters {
            w.await.unwrap().unwrap();
        }
        for t in held {
            t.join().unwrap();
        }
        assert_eq!((queue.running(), queue.queued()), (0, 0));
    }

    /// The compile is handed the deadline the budget sets from its start.
    #[test]
    fn the_compile_knows_its_deadline() {
        let queue = Queue::default();
        let before = Instant::now();
        let deadline = run_blocking(&queue, "d", LIMITS, Ok).unwrap();
        assert!(deadline >= before + BUDGET && deadline <= Instant::now() + BUDGET);
    }
}
