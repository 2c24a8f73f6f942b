//! Cross-request suffix pool: a model-free proposer that learns from
//! finished requests (in the spirit of SuffixDecoding and llama.cpp's
//! ngram-mod). It owns the token sequences (prompt + output) of finished
//! requests, grouped by scope, and an index from each `min_match`-gram to
//! its occurrences. While a sequence decodes, [`SuffixPool::lookup`] finds
//! the longest suffix of its context (`max_match` down to `min_match`
//! tokens) that occurs in the scope's documents and proposes what followed
//! the most recent such occurrence.
//!
//! Scoping rule: a scope is an opaque string (a hash of the API key).
//! Inserts and lookups touch only that scope's own documents and index;
//! there is no shared index and no fallback to another scope. Proposals are
//! verified losslessly, so they never change what is sampled, but accepted
//! drafts change how fast tokens arrive: a tenant timing its own requests
//! could learn whether some text was written by another tenant. Isolation
//! is therefore a privacy requirement, not a quality knob.
//!
//! Memory bounds: a scope holds at most `max_tokens_per_scope` tokens (the
//! oldest documents are evicted first), a document at most
//! `max_doc_tokens` (its last ones), and the pool at most `max_scopes`
//! scopes (the least recently used is dropped). Per stored token the index
//! costs one 8-byte chain link plus at most one hash-map head entry, and
//! heads pointing into evicted documents are removed on eviction, so the
//! index never outgrows the tokens it covers: roughly 30-50 bytes per
//! token in the worst case (all grams distinct). With the defaults the
//! worst case is 64 scopes of 64 Ki tokens each, about 200 MB.
//!
//! [`SuffixPool::lookup_tree`] offers several matched continuations at
//! once: the same chain as `lookup`, plus the continuations of the other
//! examined occurrences as branches where they diverge from it.
//!
//! Cost: a lookup hashes `min_match` tokens, then visits at most
//! [`MAX_CANDIDATES`] occurrences of that hash, newest first, each costing a
//! binary search over the scope's documents and at most `max_match` token
//! comparisons: microseconds whatever the pool size. An insert costs
//! `O(len * min_match)` hashing, and evicting a document the same.

use crate::trie::Trie;
use crate::Proposal;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::fmt;

/// The most occurrences of a gram's hash a lookup examines. Bounds lookup
/// cost under repetitive text (a gram seen 10 000 times) and under hash
/// collisions; the newest occurrences are the ones kept in reach, which is
/// what "most recent wins" wants anyway.
pub const MAX_CANDIDATES: usize = 8;

/// The largest `max_match`: every candidate is extended token by token up
/// to `max_match`, so this bounds a lookup's comparisons, and a shared
/// suffix longer than this already makes the continuation a confident
/// guess.
pub const MAX_MATCH_LIMIT: usize = 64;

/// End of a hash chain.
const NONE: u64 = u64::MAX;

/// Limits of a [`SuffixPool`].
///
/// Invariant (checked by [`SuffixConfig::validate`]):
/// `1 <= min_match <= max_match <= MAX_MATCH_LIMIT` and every other field
/// is at least 1.
#[derive(Debug, Clone, PartialEq)]
pub struct SuffixConfig {
    /// Shortest suffix that counts as a match; shorter ones are too common
    /// for their continuation to be a confident guess. Also the gram length
    /// the index is keyed by. Default 3.
    pub min_match: usize,
    /// Longest suffix compared; a longer shared history does not make the
    /// guess better enough to pay for the comparisons. Default 12.
    pub max_match: usize,
    /// Tokens kept per scope; past it the oldest documents are evicted.
    /// Default 1 << 16 (a few hundred recent requests).
    pub max_tokens_per_scope: usize,
    /// Scopes kept; past it the least recently used scope is dropped.
    /// Default 64.
    pub max_scopes: usize,
    /// Tokens kept per document; a longer one keeps its last tokens (the
    /// end of a conversation predicts its next turn best). Default 1 << 14.
    pub max_doc_tokens: usize,
}

impl Default for SuffixConfig {
    fn default() -> Self {
        Self {
            min_match: 3,
            max_match: 12,
            max_tokens_per_scope: 1 << 16,
            max_scopes: 64,
            max_doc_tokens: 1 << 14,
        }
    }
}

impl SuffixConfig {
    /// Errors, naming the offending field, unless
    /// `1 <= min_match <= max_match <= MAX_MATCH_LIMIT` and
    /// `max_tokens_per_scope`, `max_scopes` and `max_doc_tokens` are >= 1.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_match == 0 {
            return Err("suffix min_match must be at least 1 (got 0)".into());
        }
        if self.max_match < self.min_match {
            return Err(format!(
                "suffix max_match ({}) must be at least min_match ({})",
                self.max_match, self.min_match
            ));
        }
        if self.max_match > MAX_MATCH_LIMIT {
            return Err(format!(
                "suffix max_match must be at most {MAX_MATCH_LIMIT} (got {})",
                self.max_match
            ));
        }
        for (name, value) in [
            ("max_tokens_per_scope", self.max_tokens_per_scope),
            ("max_scopes", self.max_scopes),
            ("max_doc_tokens", self.max_doc_tokens),
        ] {
            if value == 0 {
                return Err(format!("suffix {name} must be at least 1 (got 0)"));
            }
        }
        Ok(())
    }
}

/// A proposed continuation.
///
/// Invariant: `tokens` is non-empty and no longer than the `k` asked for;
/// `match_len` is in `min_match..=max_match` and at most the context length:
/// the last `match_len` context tokens equal the `match_len` stored tokens
/// right before `tokens` in one document of the scope. `branches` is in
/// [`Proposal`]'s form (node `i < tokens.len()` is `tokens[i]`, node
/// `tokens.len() + j` is `branches[j]`; a branch's parent is an earlier
/// node, `None` the root) and never repeats a sibling's token; it is empty
/// from [`SuffixPool::lookup`].
#[derive(Debug, Clone, PartialEq)]
pub struct SuffixMatch {
    /// What followed the matched suffix in the stored document.
    pub tokens: Vec<u32>,
    /// How many trailing context tokens matched; longer is more confident.
    pub match_len: usize,
    /// Other stored continuations, `(token, parent node)`, as a trie
    /// hanging off the chain (see [`SuffixPool::lookup_tree`]).
    pub branches: Vec<(u32, Option<usize>)>,
}

impl SuffixMatch {
    /// The match as a deterministic (q `None`) [`Proposal`].
    pub fn into_proposal(self) -> Proposal {
        Proposal {
            branches: self.branches,
            ..Proposal::chain(self.tokens, None)
        }
    }
}

/// One stored document.
struct Doc {
    /// Scope-global position of `tokens[0]`. Positions increase by one per
    /// stored token and are never reused, so live documents occupy one
    /// contiguous range and "more recent" is simply "larger position".
    start: u64,
    tokens: Vec<u32>,
    /// `links[j - min_match]` is the position of the previous occurrence
    /// whose gram hashes like `tokens[j - min_match..j]` (or [`NONE`]). An
    /// occurrence is named by the position right after its gram, i.e. where
    /// its continuation starts, so only `j < tokens.len()` is indexed and
    /// every candidate has a non-empty continuation.
    links: Vec<u64>,
}

impl Doc {
    fn end(&self) -> u64 {
        self.start + self.tokens.len() as u64
    }
}

/// One tenant's documents and index.
struct Scope {
    /// Oldest first.
    docs: VecDeque<Doc>,
    /// Gram hash -> position of its newest occurrence, the head of a chain
    /// through `Doc::links`. Chains only go back in position, so a walk
    /// stops at the first evicted position; heads into evicted documents
    /// are removed on eviction, so the map holds at most one entry per
    /// live token.
    heads: HashMap<u64, u64>,
    tokens: usize,
    next_pos: u64,
    last_used: u64,
}

impl Scope {
    fn new() -> Self {
        Self {
            docs: VecDeque::new(),
            heads: HashMap::new(),
            tokens: 0,
            next_pos: 0,
            last_used: 0,
        }
    }

    /// The live document holding position `pos`, if any.
    fn doc_at(&self, pos: u64) -> Option<&Doc> {
        let first = self.docs.front()?;
        if pos < first.start || pos >= self.next_pos {
            return None;
        }
        let i = self.docs.partition_point(|d| d.start <= pos) - 1;
        let doc = &self.docs[i];
        (pos < doc.end()).then_some(doc)
    }

    /// Drops the oldest document and the chain heads that pointed into it
    /// (their whole chains are then dead: chains only go back).
    fn evict_oldest(&mut self, m: usize, mask: u64) {
        let Some(doc) = self.docs.pop_front() else {
            return;
        };
        let end = doc.end();
        for j in m..doc.tokens.len() {
            let h = gram_hash(&doc.tokens[j - m..j]) & mask;
            if let Entry::Occupied(e) = self.heads.entry(h) {
                if *e.get() < end {
                    e.remove();
                }
            }
        }
        self.tokens -= doc.tokens.len();
    }
}

/// Hash of one gram (FxHash-style mixing plus a finalizer so that the low
/// bits, which a test-only mask keeps, depend on every token).
fn gram_hash(gram: &[u32]) -> u64 {
    let mut h: u64 = 0;
    for &t in gram {
        h = (h.rotate_left(5) ^ u64::from(t)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// Per-scope pools of finished documents, answering suffix lookups.
///
/// Invariants: a lookup only ever returns tokens stored under the same
/// scope; every scope holds at most `max_tokens_per_scope` tokens, at most
/// `max_scopes` scopes exist. `Debug` prints only counts: documents and
/// scope names are tenant data and must not reach logs.
pub struct SuffixPool {
    cfg: SuffixConfig,
    scopes: HashMap<String, Scope>,
    /// LRU clock, bumped by every insert and every lookup of a known scope.
    clock: u64,
    /// Applied to every gram hash; all ones in production, tiny in tests
    /// to force collisions.
    hash_mask: u64,
    max_candidates: usize,
}

impl fmt::Debug for SuffixPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SuffixPool")
            .field("cfg", &self.cfg)
            .field("scopes", &self.scopes.len())
            .field("tokens", &self.total_tokens())
            .finish()
    }
}

impl SuffixPool {
    /// An empty pool.
    ///
    /// # Panics
    /// When `cfg.validate()` fails: a bad config is a startup error, and
    /// `min_match == 0` would index empty grams.
    pub fn new(cfg: SuffixConfig) -> Self {
        Self::with_index(cfg, u64::MAX, MAX_CANDIDATES)
    }

    fn with_index(cfg: SuffixConfig, hash_mask: u64, max_candidates: usize) -> Self {
        if let Err(e) = cfg.validate() {
            panic!("invalid suffix pool config: {e}");
        }
        Self {
            cfg,
            scopes: HashMap::new(),
            clock: 0,
            hash_mask,
            max_candidates,
        }
    }

    /// The limits the pool was built with.
    pub fn config(&self) -> &SuffixConfig {
        &self.cfg
    }

    /// Adds one finished document (prompt + output) to `scope`'s pool, as
    /// its most recent one. A document longer than `max_doc_tokens` (or
    /// `max_tokens_per_scope`) keeps its last tokens; one shorter than
    /// `min_match + 1` after that is ignored (no gram with a continuation)
    /// and creates no scope. Evicts the scope's oldest documents to stay
    /// within `max_tokens_per_scope`, and creating a scope past
    /// `max_scopes` drops the least recently used one.
    pub fn insert(&mut self, scope: &str, tokens: &[u32]) {
        let m = self.cfg.min_match;
        let keep = self.cfg.max_doc_tokens.min(self.cfg.max_tokens_per_scope);
        let tokens = &tokens[tokens.len().saturating_sub(keep)..];
        if tokens.len() <= m {
            return;
        }
        self.clock += 1;
        let clock = self.clock;
        if !self.scopes.contains_key(scope) && self.scopes.len() >= self.cfg.max_scopes {
            let lru = self
                .scopes
                .iter()
                .min_by_key(|(_, s)| s.last_used)
                .map(|(name, _)| name.clone());
            if let Some(name) = lru {
                self.scopes.remove(&name);
            }
        }
        let mask = self.hash_mask;
        let cap = self.cfg.max_tokens_per_scope;
        let s = self
            .scopes
            .entry(scope.to_owned())
            .or_insert_with(Scope::new);
        s.last_used = clock;
        while s.tokens + tokens.len() > cap && !s.docs.is_empty() {
            s.evict_oldest(m, mask);
        }
        let start = s.next_pos;
        let links = (m..tokens.len())
            .map(|j| {
                let h = gram_hash(&tokens[j - m..j]) & mask;
                s.heads.insert(h, start + j as u64).unwrap_or(NONE)
            })
            .collect();
        s.docs.push_back(Doc {
            start,
            tokens: tokens.to_vec(),
            links,
        });
        s.tokens += tokens.len();
        s.next_pos += tokens.len() as u64;
    }

    /// The continuation (1..=`k` tokens) after the longest suffix of
    /// `context` (length in `min_match..=max_match`) found in `scope`'s
    /// documents, taken from its most recent occurrence among ties. `None`
    /// when `k == 0`, the scope is unknown, or nothing matches. Never
    /// returns tokens from another scope. Marks a known scope as used.
    ///
    /// Only the [`MAX_CANDIDATES`] newest occurrences of the context's last
    /// `min_match` tokens are examined, so an older, longer match of a very
    /// frequent gram can be missed; a claimed match is always checked
    /// token by token, never trusted to the hash.
    pub fn lookup(&mut self, scope: &str, context: &[u32], k: usize) -> Option<SuffixMatch> {
        self.lookup_tree(scope, context, k, 0)
    }

    /// [`lookup`](Self::lookup) with up to `branches` branch nodes besides
    /// its chain (which is unchanged): the continuations (at most `k`
    /// tokens each, so no node is deeper than `k`) of the other examined
    /// occurrences of the suffix, longest match first and the most recent
    /// first among equal lengths, each inserted as a trie path under the
    /// node where it diverges from what is already there. Only the
    /// [`MAX_CANDIDATES`] newest occurrences of the last `min_match`
    /// tokens are examined, as for the chain, so the cost stays bounded.
    /// `branches == 0` is exactly `lookup`.
    pub fn lookup_tree(
        &mut self,
        scope: &str,
        context: &[u32],
        k: usize,
        branches: usize,
    ) -> Option<SuffixMatch> {
        if k == 0 {
            return None;
        }
        let s = self.scopes.get_mut(scope)?;
        self.clock += 1;
        s.last_used = self.clock;
        let m = self.cfg.min_match;
        let n = context.len();
        if n < m {
            return None;
        }
        let limit = self.cfg.max_match.min(n);
        let suffix = &context[n - m..];
        let mut pos = *s.heads.get(&(gram_hash(suffix) & self.hash_mask))?;
        // (position of the continuation, match length) of every real match
        // examined, newest first; the chain's is the first of the longest.
        let mut found: Vec<(u64, usize)> = Vec::new();
        for _ in 0..self.max_candidates {
            let Some(doc) = s.doc_at(pos) else {
                break; // evicted: the rest of the chain is older still
            };
            let j = (pos - doc.start) as usize;
            if doc.tokens[j - m..j] == *suffix {
                let mut len = m;
                while len < limit && len < j && doc.tokens[j - len - 1] == context[n - len - 1] {
                    len += 1;
                }
                found.push((pos, len));
                // Nothing older can beat it for the chain; a tree still
                // wants the other continuations.
                if len == limit && branches == 0 {
                    break;
                }
            }
            pos = doc.links[j - m];
            if pos == NONE {
                break;
            }
        }
        // Stable: newest first among equal lengths.
        found.sort_by_key(|&(_, len)| std::cmp::Reverse(len));
        let continuation = |pos: u64| {
            let doc = s.doc_at(pos)?;
            let j = (pos - doc.start) as usize;
            Some(&doc.tokens[j..(j + k).min(doc.tokens.len())])
        };
        let &(best, match_len) = found.first()?;
        let tokens = continuation(best)?.to_vec();
        if tokens.is_empty() {
            return None;
        }
        let mut trie = Trie::new(tokens, branches);
        for &(p, _) in &found[1..] {
            if trie.is_full() {
                break;
            }
            if let Some(c) = continuation(p) {
                trie.insert(c);
            }
        }
        let Proposal {
            tokens, branches, ..
        } = trie.into_proposal();
        Some(SuffixMatch {
            tokens,
            match_len,
            branches,
        })
    }

    /// Tokens stored under `scope` (0 for an unknown one); at most
    /// `max_tokens_per_scope`.
    pub fn scope_tokens(&self, scope: &str) -> usize {
        self.scopes.get(scope).map_or(0, |s| s.tokens)
    }

    /// Tokens stored over all scopes.
    pub fn total_tokens(&self) -> usize {
        self.scopes.values().map(|s| s.tokens).sum()
    }

    /// Scopes currently held; at most `max_scopes`.
    pub fn num_scopes(&self) -> usize {
        self.scopes.len()
    }

    /// Drops everything stored under `scope` (say, its API key was
    /// revoked); a no-op for an unknown scope.
    pub fn forget(&mut self, scope: &str) {
        self.scopes.remove(scope);
    }
}

#[cfg(test)]
#[path = "suffix_tests.rs"]
mod tests;
