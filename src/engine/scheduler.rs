//! Pure planning of one engine step: which waiting sequences to admit, how
//! many decode rows each running sequence gets (k_i + 1), which prompt
//! chunks fill the rest of the token budget, and whom to preempt when
//! blocks run out. Only block bookkeeping is touched ([`BlockManager`]);
//! no model, so it is unit-tested on its own.

use crate::kv::{BlockManager, SeqId};
use std::collections::{HashMap, VecDeque};

/// What the scheduler needs to know of a sequence.
pub trait Schedulable {
    fn id(&self) -> SeqId;
    /// Prompt + accepted output.
    fn tokens(&self) -> &[u32];
    /// Tokens whose K/V the target's cache holds (a prefix of `tokens`).
    fn computed(&self) -> usize;
    fn set_computed(&mut self, n: usize);
    /// How many leading tokens may come from the prefix cache on admission
    /// (all but the last by default; 0 when every position must be run,
    /// e.g. for prompt logprobs).
    fn cacheable(&self) -> usize {
        self.tokens().len() - 1
    }
    /// The prefix-cache scope it looks up and registers blocks in (see
    /// [`BlockManager::allocate_scoped`]); 0, the shared one, by default.
    fn cache_scope(&self) -> u64 {
        0
    }
}

/// The draft lengths of the sequences ready to decode, planned together:
/// `(ready, budget, prefill_rows)` to one k per ready sequence (see
/// [`Scheduler::plan`]).
pub type DraftLengths<'a, T> = dyn Fn(&[&T], usize, usize) -> Vec<usize> + 'a;

/// Limits of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Rows (tokens) in one verifier forward.
    pub max_num_batched_tokens: usize,
}

/// One step's work.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// `(sequence, start, len)`: prompt tokens `start..start + len` to prefill.
    pub prefill: Vec<(SeqId, usize, usize)>,
    /// `(sequence, k)`: verify the last token plus k drafts.
    pub decode: Vec<(SeqId, usize)>,
    /// Sequences whose blocks were freed this step, now at the head of the
    /// waiting queue to be recomputed.
    pub preempted: Vec<SeqId>,
    /// Prompt tokens found in the prefix cache on admission.
    pub cached_tokens: usize,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.prefill.is_empty() && self.decode.is_empty()
    }
}

/// First-come-first-served scheduler with chunked prefill and preemption by
/// recompute of the most recently admitted sequence.
pub struct Scheduler {
    cfg: SchedulerConfig,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.max_num_seqs > 0 && cfg.max_num_batched_tokens > 0);
        Self { cfg }
    }

    /// The limits it plans within.
    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// Plans a step. `running` is in admission order (oldest first) and
    /// stays so; `k_of(ready, budget, prefill_rows)` gives the draft length
    /// of each sequence ready to decode (in `running` order), planned
    /// together: `budget` rows fit in the step, and `prefill_rows` of them
    /// go to prompt chunks if the decodes leave room (what the forward
    /// will carry besides the decode rows). A length past the budget is
    /// cut to fit.
    ///
    /// Invariants kept: every running sequence holds blocks for all its
    /// tokens; every decode entry's table covers `tokens + k` slots; the
    /// rows planned never exceed `max_num_batched_tokens`.
    pub fn plan<T: Schedulable>(
        &self,
        waiting: &mut VecDeque<T>,
        running: &mut Vec<T>,
        bm: &mut BlockManager,
        k_of: &DraftLengths<T>,
    ) -> Plan {
        let mut plan = Plan::default();
        self.admit(waiting, running, bm, &mut plan);
        let mut budget = self.cfg.max_num_batched_tokens;
        let ready = |s: &T| s.computed() + 1 == s.tokens().len();
        let decoding: Vec<&T> = running.iter().filter(|s| ready(s)).collect();
        let pending: usize = running
            .iter()
            .filter(|s| !ready(s))
            .map(|s| s.tokens().len() - 1 - s.computed())
            .sum();
        let prefill_rows = pending.min(budget.saturating_sub(decoding.len()));
        let ks: HashMap<SeqId, usize> = decoding
            .iter()
            .map(|s| s.id())
            .zip(k_of(&decoding, budget, prefill_rows))
            .collect();

        let mut i = 0;
        while i < running.len() {
            if !ready(&running[i]) || budget == 0 {
                i += 1;
                continue;
            }
            let k = ks
                .get(&running[i].id())
                .copied()
                .unwrap_or(0)
                .min(budget - 1);
            let (id, len) = (running[i].id(), running[i].tokens().len());
            // Make room for the lookahead slots, preempting the youngest.
            let mut ok = true;
            while bm.reserve(id, len + k).is_err() {
                let victim = running.pop().expect("running holds this sequence");
                let is_self = victim.id() == id;
                Self::preempt(victim, waiting, bm, &mut plan);
                if is_self {
                    ok = false;
                    break;
                }
            }
            if ok {
                budget -= k + 1;
                plan.decode.push((id, k));
                i += 1;
            }
        }
        for s in running.iter() {
            let pending = s.tokens().len() - 1 - s.computed();
            if pending == 0 || ready(s) {
                continue;
            }
            if budget == 0 {
                break;
            }
            let mut n = pending.min(budget);
            // A hybrid target saves a state checkpoint where a chunk ends
            // on a save point: cut the chunk there.
            if let Some(stop) = bm.next_stop(s.id(), s.computed()) {
                n = n.min(stop - s.computed());
            }
            plan.prefill.push((s.id(), s.computed(), n));
            budget -= n;
        }
        plan
    }

    /// Admits from the head of the queue while sequences and blocks allow,
    /// keeping one free block per running sequence so decoding can grow.
    fn admit<T: Schedulable>(
        &self,
        waiting: &mut VecDeque<T>,
        running: &mut Vec<T>,
        bm: &mut BlockManager,
        plan: &mut Plan,
    ) {
        while let Some(next) = waiting.front_mut() {
            if running.len() >= self.cfg.max_num_seqs {
                break;
            }
            let len = next.tokens().len();
            let headroom = running.len() + 1;
            if bm.num_free() < bm.blocks_for(len) + headroom && !running.is_empty() {
                break;
            }
            let scope = next.cache_scope();
            match bm.allocate_scoped(next.id(), next.tokens(), next.cacheable(), scope) {
                Ok(hit) => {
                    next.set_computed(hit);
                    plan.cached_tokens += hit;
                    running.push(waiting.pop_front().expect("front exists"));
                }
                Err(_) => break,
            }
        }
    }

    fn preempt<T: Schedulable>(
        mut victim: T,
        waiting: &mut VecDeque<T>,
        bm: &mut BlockManager,
        plan: &mut Plan,
    ) {
        bm.free(victim.id());
        victim.set_computed(0);
        plan.decode.retain(|(id, _)| *id != victim.id());
        plan.preempted.push(victim.id());
        waiting.push_front(victim);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct S {
        id: SeqId,
        tokens: Vec<u32>,
        computed: usize,
    }

    impl Schedulable for S {
        fn id(&self) -> SeqId {
            self.id
        }
        fn tokens(&self) -> &[u32] {
            &self.tokens
        }
        fn computed(&self) -> usize {
            self.computed
        }
        fn set_computed(&mut self, n: usize) {
            self.computed = n;
        }
    }

    fn seq(id: SeqId, len: usize) -> S {
        S {
            id,
            tokens: (0..len as u32).map(|t| t + 1000 * id as u32).collect(),
            computed: 0,
        }
    }

    /// Every ready sequence drafts `k`.
    fn each(k: usize) -> impl Fn(&[&S], usize, usize) -> Vec<usize> {
        move |ready: &[&S], _, _| vec![k; ready.len()]
    }

    fn sched(seqs: usize, tokens: usize) -> Scheduler {
        Scheduler::new(SchedulerConfig {
            max_num_seqs: seqs,
            max_num_batched_tokens: tokens,
        })
    }

    #[test]
    fn long_prompt_is_chunked_and_decodes_go_first() {
        let s = sched(8, 16);
        let mut bm = BlockManager::new(64, 4);
        let mut waiting: VecDeque<S> = [seq(1, 3), seq(2, 40)].into();
        let mut running = Vec::new();
        let k = each(3);
        let p = s.plan(&mut waiting, &mut running, &mut bm, &k);
        assert_eq!(p.prefill, vec![(1, 0, 2), (2, 0, 14)]);
        assert!(p.decode.is_empty());
        running[0].computed = 2;
        running[1].computed = 14;
        let p = s.plan(&mut waiting, &mut running, &mut bm, &k);
        // Seq 1 decodes with k + 1 = 4 rows; the other 12 rows go to seq 2.
        assert_eq!(p.decode, vec![(1, 3)]);
        assert_eq!(p.prefill, vec![(2, 14, 12)]);
        assert!(bm.capacity(1) >= 3 + 3);
    }

    #[test]
    fn admission_is_fcfs_and_bounded_by_max_num_seqs() {
        let s = sched(2, 100);
        let mut bm = BlockManager::new(64, 4);
        let mut waiting: VecDeque<S> = (1..=4).map(|i| seq(i, 5)).collect();
        let mut running = Vec::new();
        s.plan(&mut waiting, &mut running, &mut bm, &each(0));
        assert_eq!(running.iter().map(|s| s.id).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(waiting.front().unwrap().id, 3);
    }

    #[test]
    fn running_out_of_blocks_preempts_the_youngest() {
        let s = sched(8, 64);
        // 3 sequences of 8 tokens in blocks of 4: 6 of 7 blocks.
        let mut bm = BlockManager::new(7, 4);
        let mut waiting: VecDeque<S> = VecDeque::new();
        let mut running = Vec::new();
        for i in 1..=3 {
            bm.allocate(i, 8).unwrap();
            let mut x = seq(i, 8);
            x.computed = 7;
            running.push(x);
        }
        // Each wants k = 4: 12 slots = 3 blocks each. Seq 1 takes the free
        // block; seq 2 gets the youngest's (3) blocks.
        let p = s.plan(&mut waiting, &mut running, &mut bm, &each(4));
        assert_eq!(p.preempted, vec![3]);
        assert_eq!(p.decode, vec![(1, 4), (2, 4)]);
        assert_eq!(waiting.iter().map(|s| s.id).collect::<Vec<_>>(), vec![3]);
        assert!(waiting.iter().all(|s| s.computed == 0));
        bm.check_invariants().unwrap();
    }

    #[test]
    fn budget_caps_k() {
        let s = sched(8, 3);
        let mut bm = BlockManager::new(16, 4);
        let mut waiting = VecDeque::new();
        bm.allocate(1, 5).unwrap();
        let mut x = seq(1, 5);
        x.computed = 4;
        let mut running = vec![x];
        let p = s.plan(&mut waiting, &mut running, &mut bm, &each(8));
        assert_eq!(p.decode, vec![(1, 2)]);
    }

    #[test]
    fn draft_lengths_are_planned_together_with_the_prefill_rows() {
        let s = sched(8, 32);
        let mut bm = BlockManager::new(64, 4);
        let mut waiting = VecDeque::new();
        let mut running = Vec::new();
        for (id, computed) in [(1, 4), (2, 1), (3, 4)] {
            bm.allocate(id, 5).unwrap();
            let mut x = seq(id, 5);
            x.computed = computed;
            running.push(x);
        }
        let seen = std::cell::RefCell::new(Vec::new());
        let k = |ready: &[&S], budget: usize, prefill: usize| {
            seen.borrow_mut().push((
                ready.iter().map(|s| s.id).collect::<Vec<_>>(),
                budget,
                prefill,
            ));
            vec![2, 5]
        };
        let p = s.plan(&mut waiting, &mut running, &mut bm, &k);
        // Seqs 1 and 3 decode; seq 2 has 3 prompt tokens left to prefill.
        assert_eq!(seen.into_inner(), vec![(vec![1, 3], 32, 3)]);
        assert_eq!(p.decode, vec![(1, 2), (3, 5)]);
        assert_eq!(p.prefill, vec![(2, 1, 3)]);
    }
}
