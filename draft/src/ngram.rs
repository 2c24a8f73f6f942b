//! N-gram prompt lookup: find the most recent earlier occurrence of the
//! sequence's last n tokens (longest n first, from `max_n` down to `min_n`)
//! and propose the tokens that followed it. No model, no allocation beyond
//! the returned tokens; cost is a backwards scan of the context.

/// Prompt-lookup proposer.
///
/// Invariant: `1 <= min_n <= max_n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramProposer {
    min_n: usize,
    max_n: usize,
}

impl NgramProposer {
    /// Errors when `min_n` is 0 or greater than `max_n`.
    pub fn new(min_n: usize, max_n: usize) -> Result<Self, String> {
        if min_n == 0 || min_n > max_n {
            return Err(format!(
                "n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})"
            ));
        }
        Ok(Self { min_n, max_n })
    }

    /// The tokens that followed the latest earlier match of the context's
    /// suffix, at most `k` of them.
    pub fn lookup<'a>(&self, context: &'a [u32], k: usize) -> &'a [u32] {
        if k == 0 {
            return &[];
        }
        let len = context.len();
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            // Latest match first; a match must end before the suffix starts
            // so that at least one token follows it.
            for start in (0..len - n).rev() {
                if &context[start..start + n] == suffix {
                    let from = start + n;
                    return &context[from..(from + k).min(len)];
                }
            }
        }
        &[]
    }
}

impl Default for NgramProposer {
    fn default() -> Self {
        Self { min_n: 1, max_n: 4 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_latest_match() {
        let p = NgramProposer::new(1, 3).unwrap();
        // suffix [7, 8, 9] occurred at 1..4, followed by 10, 11.
        let ctx = [1, 7, 8, 9, 10, 11, 5, 8, 9, 12, 7, 8, 9];
        assert_eq!(p.lookup(&ctx, 2), &[10, 11]);
        // k longer than what follows: stops at the context end.
        assert_eq!(p.lookup(&ctx, 50), &[10, 11, 5, 8, 9, 12, 7, 8, 9]);
        assert_eq!(p.lookup(&ctx, 0), &[] as &[u32]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_latest_occurrence() {
        let p = NgramProposer::new(1, 4).unwrap();
        // Only the 1-gram [3] repeats; its latest earlier occurrence is at 4.
        let ctx = [3, 1, 2, 0, 3, 4, 5, 3];
        assert_eq!(p.lookup(&ctx, 2), &[4, 5]);
        // min_n = 2 refuses the 1-gram.
        assert!(NgramProposer::new(2, 4).unwrap().lookup(&ctx, 2).is_empty());
    }

    #[test]
    fn no_match_and_tiny_contexts_propose_nothing() {
        let p = NgramProposer::default();
        assert!(p.lookup(&[], 4).is_empty());
        assert!(p.lookup(&[1], 4).is_empty());
        assert!(p.lookup(&[1, 2, 3, 4], 4).is_empty());
        assert_eq!(p.lookup(&[1, 1], 4), &[1]);
    }

    #[test]
    fn bad_sizes_are_rejected() {
        assert!(NgramProposer::new(0, 3).is_err());
        assert!(NgramProposer::new(4, 3).is_err());
    }
}
