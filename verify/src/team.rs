//! The team of helper threads that runs a forward's parallel loops (the
//! matmuls and attention, some 140 per batch-1 step of a 28-layer model):
//! [`for_each`] and [`for_each_chunk`].
//!
//! Why not rayon's pool for these: between two loops a step runs short
//! serial work (norms, RoPE, residual adds) of a few microseconds, and
//! rayon's idle workers soon go to sleep; waking one is a futex call and,
//! on a virtual machine, an inter-processor interrupt. Measured on a
//! 2-vCPU Zen 4 (`perf`, batch-1 decode of the 1.5B model), the CPUs were
//! busy only about three quarters of the step's wall time. The helpers here
//! spin between loops instead, as llama.cpp's do, and sleep only after
//! [`spin`] without work, which is between steps, not within one.
//!
//! One caller at a time owns the team; a second caller (tensor-parallel
//! ranks on threads, tests running side by side, a loop inside a loop)
//! runs its loop on rayon's pool instead, as before. Which thread runs an
//! index never changes a result: every index's work is the same
//! instructions on the same data.

use rayon::prelude::*;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins before it sleeps, unless
/// `SPECGATE_SPIN_US` says otherwise: longer than the serial gaps inside a
/// step (microseconds), shorter than what a spinning core would take from
/// the server's other threads between steps.
pub const SPIN: Duration = Duration::from_micros(300);

/// The spin time in force: `SPECGATE_SPIN_US` microseconds if set (0 turns
/// the team off: every loop runs on rayon's pool, as before the team, for
/// hosts where no core may spin, and for side-by-side measurements), else
/// [`SPIN`]. Read once per process.
pub fn spin() -> Duration {
    static SPIN_TIME: OnceLock<Duration> = OnceLock::new();
    *SPIN_TIME.get_or_init(|| {
        std::env::var("SPECGATE_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}

/// The loop body of the call in progress, its lifetime erased. Written
/// only while the team is closed with no helper inside (see [`Team`]).
type Job = *const (dyn Fn(usize) + Sync);

/// Shared state of the team. Protocol: the owner writes `job`, `n` and
/// `next`, then opens `state` (epoch * 2 + 1). A helper that sees an open
/// state registers in `active`, checks that the state is still the one it
/// saw, and only then reads `job` and takes indices from `next`. The owner
/// closes `state` (epoch * 2) once every index is taken, and waits for
/// `active` to reach zero before it returns: so no helper ever touches a
/// job that has returned, and `job` is never written while one is read.
struct Team {
    owner: Mutex<()>,
    state: AtomicU64,
    job: UnsafeCell<Job>,
    n: AtomicUsize,
    next: AtomicUsize,
    active: AtomicUsize,
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    panicked: AtomicBool,
    /// Helpers started (a spawn that failed leaves its indices to the
    /// others).
    helpers: AtomicUsize,
}

// SAFETY: `job` is accessed only under the protocol above; everything
// else is atomics and locks.
unsafe impl Sync for Team {}

/// The team: `rayon::current_num_threads() - 1` helpers (the caller is
/// the last member), started on first use; `None` when [`spin`] is zero.
fn team() -> Option<&'static Team> {
    static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();
    *TEAM.get_or_init(|| {
        if spin().is_zero() {
            return None;
        }
        let helpers = rayon::current_num_threads().saturating_sub(1);
        let noop: &(dyn Fn(usize) + Sync) = &|_| {};
        let team: &'static Team = Box::leak(Box::new(Team {
            owner: Mutex::new(()),
            state: AtomicU64::new(0),
            job: UnsafeCell::new(noop as Job),
            n: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            panicked: AtomicBool::new(false),
            helpers: AtomicUsize::new(0),
        }));
        for i in 0..helpers {
            let spawned = std::thread::Builder::new()
                .name(format!("specgate-team-{i}"))
                .spawn(move || helper(team));
            if spawned.is_ok() {
                team.helpers.fetch_add(1, SeqCst);
            }
        }
        Some(team)
    })
}

/// Threads a loop of [`for_each`] may run on: the helpers and the caller.
/// Callers split their work into a few times this many indices.
pub fn threads() -> usize {
    match team() {
        Some(team) => team.helpers.load(SeqCst) + 1,
        None => rayon::current_num_threads().max(1),
    }
}

/// Runs `f(i)` for every `i` in `0..n`, each exactly once, on the team
/// with the calling thread taking part; returns when all have finished.
/// When another caller owns the team (or it is off), runs on rayon's pool
/// instead.
///
/// Panics if `f` panicked (after every index has finished).
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    if n <= 1 {
        (0..n).for_each(f);
        return;
    }
    let owned = team()
        .filter(|t| t.helpers.load(SeqCst) > 0)
        .and_then(|t| Some((t, t.owner.try_lock().ok()?)));
    let Some((team, _owner)) = owned else {
        (0..n).into_par_iter().for_each(&f);
        return;
    };
    let job: &(dyn Fn(usize) + Sync) = &f;
    // SAFETY: the team is closed and no helper is inside (the previous
    // owner waited for that), so nothing reads `job` now; the erased
    // lifetime ends only after `Close` has waited for every helper.
    unsafe { *team.job.get() = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
    team.n.store(n, SeqCst);
    team.panicked.store(false, SeqCst);
    team.next.store(0, SeqCst);
    let epoch = (team.state.load(SeqCst) >> 1) + 1;
    team.state.store(epoch << 1 | 1, SeqCst);
    if team.sleepers.load(SeqCst) > 0 {
        let _g = team.sleep.lock().unwrap_or_else(|e| e.into_inner());
        team.wake.notify_all();
    }
    // Closes the team and waits for the helpers even if `f` panics here.
    struct Close<'a>(&'a Team, u64);
    impl Drop for Close<'_> {
        fn drop(&mut self) {
            self.0.state.store(self.1 << 1, SeqCst);
            while self.0.active.load(SeqCst) != 0 {
                std::hint::spin_loop();
            }
        }
    }
    let close = Close(team, epoch);
    run(team, job);
    drop(close);
    if team.panicked.swap(false, SeqCst) {
        panic!("a task of the forward's thread team panicked");
    }
}

/// [`for_each`] over the chunks of `len` elements of `data` (the last may
/// be shorter): `f(i, chunk i)`, each chunk given to one call only.
pub fn for_each_chunk<T: Send>(data: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let len = len.max(1);
    let total = data.len();
    let base = SharedMut::new(data);
    for_each(total.div_ceil(len), |i| {
        let start = i * len;
        let end = (start + len).min(total);
        // SAFETY: chunk i is `start..end` of `data`, disjoint from every
        // other index's, and `for_each` runs each index once while `data`
        // stays borrowed.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
        f(i, chunk)
    });
}

/// A pointer into a slice that the tasks of one loop share, each writing
/// only elements no other task touches (the writer's `unsafe` block says
/// why its elements are its own).
pub(crate) struct SharedMut<T>(*mut T);
// SAFETY: sharing the pointer is sound as long as the tasks write disjoint
// elements, which every user promises at its write.
unsafe impl<T: Send> Sync for SharedMut<T> {}
impl<T> SharedMut<T> {
    pub(crate) fn new(data: &mut [T]) -> Self {
        SharedMut(data.as_mut_ptr())
    }

    /// The address of element `i` (no bounds check; computing it is safe,
    /// writing through it is the caller's promise).
    pub(crate) fn at(&self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

/// Takes indices until none are left.
fn run(team: &Team, job: &(dyn Fn(usize) + Sync)) {
    let n = team.n.load(SeqCst);
    loop {
        let i = team.next.fetch_add(1, SeqCst);
        if i >= n {
            return;
        }
        job(i);
    }
}

/// A helper's life: wait for an open epoch it has not served, join it,
/// take indices, leave.
fn helper(team: &'static Team) {
    let mut served = 0u64;
    loop {
        let s = wait_open(team, served);
        team.active.fetch_add(1, SeqCst);
        if team.state.load(SeqCst) == s {
            served = s >> 1;
            // SAFETY: registered in `active` while the state is still the
            // open one seen: the owner cannot return, or write `job`,
            // before this helper leaves.
            let job = unsafe { &**team.job.get() };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(team, job)));
            if r.is_err() {
                team.panicked.store(true, SeqCst);
            }
        }
        team.active.fetch_sub(1, SeqCst);
    }
}

/// Waits for an open state of an epoch after `served`: spins for
/// [`SPIN`], then sleeps until an owner wakes it.
fn wait_open(team: &Team, served: u64) -> u64 {
    let fresh = |s: u64| s & 1 == 1 && s >> 1 != served;
    let start = Instant::now();
    loop {
        for _ in 0..256 {
            let s = team.state.load(SeqCst);
            if fresh(s) {
                return s;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= spin() {
            break;
        }
    }
    let mut g = team.sleep.lock().unwrap_or_else(|e| e.into_inner());
    team.sleepers.fetch_add(1, SeqCst);
    let s = loop {
        let s = team.state.load(SeqCst);
        if fresh(s) {
            break s;
        }
        g = team.wake.wait(g).unwrap_or_else(|e| e.into_inner());
    };
    team.sleepers.fetch_sub(1, SeqCst);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_index_runs_exactly_once() {
        for n in [0, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            for_each(n, |i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n = {n}");
        }
    }

    #[test]
    fn chunks_cover_the_slice_and_callers_side_by_side_all_finish() {
        std::thread::scope(|s| {
            for t in 0..4u32 {
                s.spawn(move || {
                    for round in 0..200u32 {
                        let mut v = vec![0u32; 1037];
                        for_each_chunk(&mut v, 64, |i, c| {
                            for (j, x) in c.iter_mut().enumerate() {
                                *x = (i * 64 + j) as u32 + t + round;
                            }
                        });
                        assert!(v
                            .iter()
                            .enumerate()
                            .all(|(i, &x)| x == i as u32 + t + round));
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_team_goes_on() {
        let r = std::panic::catch_unwind(|| {
            for_each(64, |i| {
                if i == 37 {
                    panic!("task 37");
                }
            })
        });
        assert!(r.is_err());
        let count = AtomicU32::new(0);
        for_each(64, |_| {
            count.fetch_add(1, SeqCst);
        });
        assert_eq!(count.load(SeqCst), 64);
    }

    #[test]
    fn a_team_that_slept_wakes_for_the_next_loop() {
        for_each(8, |_| {});
        std::thread::sleep(spin() * 4);
        let count = AtomicU32::new(0);
        for_each(8, |_| {
            count.fetch_add(1, SeqCst);
        });
        assert_eq!(count.load(SeqCst), 8);
    }
}
