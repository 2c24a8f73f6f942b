//! Which recurrent-state slot of a hybrid target's pool each running
//! sequence holds (bookkeeping only: the states are the pool's). Slots
//! `0..n` are the sequences'; checkpoint slots follow them
//! ([`super::checkpoints`]).

use super::SeqId;
use std::collections::HashMap;

/// Recurrent-state slots of the target's pool, one per running sequence:
/// assigned when a sequence first runs, returned when it ends or is
/// preempted (its recompute starts over: from position 0 with a zero
/// state, or from a restored checkpoint).
pub struct StateSlots {
    /// `false` for a model without recurrent layers: inputs ignore slots.
    pub enabled: bool,
    free: Vec<u32>,
    of: HashMap<SeqId, u32>,
}

impl StateSlots {
    /// `n` slots, `0..n` (none: a target without recurrent layers).
    pub fn new(n: usize) -> Self {
        Self {
            enabled: n > 0,
            free: (0..n as u32).rev().collect(),
            of: HashMap::new(),
        }
    }

    /// The sequence's slot, taking a free one if it has none (any value
    /// when slots are not in use); `None` when none is free.
    pub fn assign(&mut self, id: SeqId) -> Option<u32> {
        if !self.enabled {
            return Some(0);
        }
        if let Some(&s) = self.of.get(&id) {
            return Some(s);
        }
        let s = self.free.pop()?;
        self.of.insert(id, s);
        Some(s)
    }

    /// The sequence's slot, if it holds one.
    pub fn of(&self, id: SeqId) -> Option<u32> {
        self.of.get(&id).copied()
    }

    /// Returns the sequence's slot to the free list; which one it was.
    pub fn release(&mut self, id: SeqId) -> Option<u32> {
        let s = self.of.remove(&id)?;
        self.free.push(s);
        Some(s)
    }

    /// Slots held by sequences now.
    pub fn used(&self) -> usize {
        self.of.len()
    }
}
