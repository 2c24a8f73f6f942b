//! Replica choice, pure (no I/O, no clock): least load with prefix
//! affinity. A request's prompt text is cut into fixed-size chunks whose
//! hashes are chained (chunk i's hash covers chunks 0..=i), so equal hashes
//! mean equal prefixes; a bounded LRU remembers which replica last served
//! each prefix. A request goes to the replica that served its longest known
//! prefix (its KV blocks are likely still cached there) unless that replica
//! carries more than `slack` sequences above the least-loaded one; otherwise
//! to the least-loaded replica, ties broken in rotation.

use lru::LruCache;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::num::NonZeroUsize;
use std::sync::Arc;

/// One replica as the balancer sees it at the moment of choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Identifies the replica across calls (its base URL).
    pub id: Arc<str>,
    /// Sequences running + waiting on it, as best known (polled gauges plus
    /// what this router sent since the poll).
    pub load: f64,
}

/// Why a replica was chosen (for metrics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It served this request's longest remembered prefix.
    Affinity,
    /// It was the least loaded (no usable affinity).
    LeastLoaded,
}

/// The chained hashes of `text`'s full `chunk`-byte chunks, shortest prefix
/// first. A text shorter than one chunk has none (too short to be worth
/// steering for). `chunk` must be positive.
pub fn prefix_hashes(text: &[u8], chunk: usize) -> Vec<u64> {
    assert!(chunk > 0, "chunk size must be positive");
    let mut h = 0u64;
    text.chunks_exact(chunk)
        .map(|c| {
            let mut s = DefaultHasher::new();
            h.hash(&mut s);
            c.hash(&mut s);
            h = s.finish();
            h
        })
        .collect()
}

/// The balancer's memory: prefix hash -> replica id, bounded.
pub struct Balancer {
    affinity: LruCache<u64, Arc<str>>,
    slack: f64,
    turn: usize,
}

impl Balancer {
    /// `capacity` prefix entries at most (oldest forgotten first); a
    /// remembered replica keeps its requests while its load is at most
    /// `slack` above the least-loaded candidate's.
    pub fn new(capacity: NonZeroUsize, slack: f64) -> Self {
        Self {
            affinity: LruCache::new(capacity),
            slack,
            turn: 0,
        }
    }

    /// Picks one of `candidates` (all healthy and eligible) for a request
    /// whose prompt has `hashes` (from [`prefix_hashes`]). `None` when there
    /// is no candidate. Nothing is remembered until the replica accepts
    /// the request ([`Balancer::remember`]): a refused request's prefix is
    /// not in that replica's cache.
    pub fn pick(&mut self, hashes: &[u64], candidates: &[Candidate]) -> Option<(usize, Reason)> {
        let min = candidates
            .iter()
            .map(|c| c.load)
            .min_by(|a, b| a.total_cmp(b))?;
        let affine = hashes.iter().rev().find_map(|h| {
            let id = self.affinity.get(h)?;
            candidates
                .iter()
                .position(|c| &c.id == id && c.load <= min + self.slack)
        });
        let (i, reason) = match affine {
            Some(i) => (i, Reason::Affinity),
            None => {
                let tied: Vec<usize> = (0..candidates.len())
                    .filter(|&i| candidates[i].load <= min)
                    .collect();
                self.turn = self.turn.wrapping_add(1);
                (tied[self.turn % tied.len()], Reason::LeastLoaded)
            }
        };
        Some((i, reason))
    }

    /// Remembers replica `id` for every prefix of a prompt with `hashes`
    /// (it accepted the request, so its cache will hold them).
    pub fn remember(&mut self, hashes: &[u64], id: &Arc<str>) {
        for &h in hashes {
            self.affinity.put(h, id.clone());
        }
    }

    /// Prefixes remembered now.
    pub fn remembered(&self) -> usize {
        self.affinity.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(loads: &[f64]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Candidate {
                id: format!("r{i}").into(),
                load,
            })
            .collect()
    }

    /// Picks and remembers, as for a request the replica accepted.
    fn keep(b: &mut Balancer, h: &[u64], c: &[Candidate]) -> Option<(usize, Reason)> {
        let r = b.pick(h, c);
        if let Some((i, _)) = r {
            b.remember(h, &c[i].id);
        }
        r
    }

    /// A refused request leaves no affinity behind.
    #[test]
    fn only_accepted_requests_are_remembered() {
        let mut b = bal();
        let h = prefix_hashes(b"0123456789abcdef", 4);
        assert_eq!(b.pick(&h, &cands(&[1.0, 0.0])).unwrap().0, 1);
        assert_eq!(b.remembered(), 0);
        let c = cands(&[0.0, 1.0]);
        assert_eq!(keep(&mut b, &h, &c).unwrap(), (0, Reason::LeastLoaded));
        assert_eq!(
            b.pick(&h, &cands(&[0.5, 0.0])).unwrap(),
            (0, Reason::Affinity)
        );
    }

    fn bal() -> Balancer {
        Balancer::new(NonZeroUsize::new(64).unwrap(), 2.0)
    }

    #[test]
    fn hashes_chain_over_full_chunks_only() {
        assert!(prefix_hashes(b"abc", 4).is_empty());
        let a = prefix_hashes(b"abcdefgh-tail", 4);
        let b = prefix_hashes(b"abcdefghXYZ", 4);
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2], "a shared prefix shares hashes");
        let c = prefix_hashes(b"zbcdefgh", 4);
        assert_ne!(a[1], c[1], "chunk 1 is equal but its prefix differs");
        assert_ne!(a[0], a[1]);
    }

    #[test]
    fn least_loaded_wins_and_ties_rotate() {
        let mut b = bal();
        assert_eq!(keep(&mut b, &[], &cands(&[3.0, 1.0, 2.0])).unwrap().0, 1);
        let c = cands(&[0.0, 0.0, 0.0]);
        let mut seen: Vec<usize> = (0..3).map(|_| keep(&mut b, &[], &c).unwrap().0).collect();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2]);
        assert!(keep(&mut b, &[], &[]).is_none());
        assert_eq!(b.remembered(), 0, "no prefix, nothing remembered");
    }

    #[test]
    fn a_shared_prefix_sticks_unless_clearly_more_loaded() {
        let mut b = bal();
        let long = prefix_hashes(b"system prompt, long and shared by all", 8);
        let first = keep(&mut b, &long, &cands(&[5.0, 0.0, 1.0])).unwrap();
        assert_eq!(first, (1, Reason::LeastLoaded));
        // A little busier than the others: affinity holds.
        assert_eq!(
            keep(&mut b, &long, &cands(&[0.0, 2.0, 0.0])).unwrap(),
            (1, Reason::Affinity)
        );
        // A request extending the prefix follows its longest known part.
        let longer = prefix_hashes(b"system prompt, long and shared by all + question", 8);
        assert_eq!(
            keep(&mut b, &longer, &cands(&[0.0, 1.0, 0.0])).unwrap(),
            (1, Reason::Affinity)
        );
        // Clearly more loaded: the least-loaded replica takes it over and
        // becomes the remembered one.
        assert_eq!(
            keep(&mut b, &long, &cands(&[0.0, 2.5, 1.0])).unwrap(),
            (0, Reason::LeastLoaded)
        );
        assert_eq!(
            keep(&mut b, &long, &cands(&[0.0, 0.0, 0.0])).unwrap(),
            (0, Reason::Affinity)
        );
    }

    #[test]
    fn a_replica_that_left_loses_its_prefixes() {
        let mut b = bal();
        let h = prefix_hashes(b"0123456789abcdef", 4);
        assert_eq!(keep(&mut b, &h, &cands(&[1.0, 0.0])).unwrap().0, 1);
        // r1 is gone (unhealthy or undiscovered): only r0 remains.
        let only = vec![cands(&[0.0, 0.0])[0].clone()];
        assert_eq!(keep(&mut b, &h, &only).unwrap(), (0, Reason::LeastLoaded));
    }

    #[test]
    fn the_memory_is_bounded() {
        let mut b = Balancer::new(NonZeroUsize::new(4).unwrap(), 1.0);
        let c = cands(&[0.0]);
        for i in 0..10u8 {
            keep(&mut b, &prefix_hashes(&[i; 8], 4), &c);
        }
        assert_eq!(b.remembered(), 4);
    }
}
