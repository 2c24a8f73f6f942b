//! SuffixPool's tests: lookups against a brute-force model of one scope,
//! scope isolation, eviction and index bounds, and lookup trees.

use super::*;

fn cfg(min_match: usize, max_match: usize) -> SuffixConfig {
    SuffixConfig {
        min_match,
        max_match,
        ..SuffixConfig::default()
    }
}

fn found(tokens: &[u32], match_len: usize) -> Option<SuffixMatch> {
    Some(SuffixMatch {
        tokens: tokens.to_vec(),
        match_len,
        branches: Vec::new(),
    })
}

/// splitmix64: the crate has no rand dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// A length drawn from `lens`, then that many tokens below
    /// `alphabet`.
    fn tokens(&mut self, lens: std::ops::Range<usize>, alphabet: u64) -> Vec<u32> {
        let len = lens.start + self.below((lens.end - lens.start) as u64) as usize;
        (0..len).map(|_| self.below(alphabet) as u32).collect()
    }
}

/// Straightforward model of one scope: the spec's truncation and
/// eviction rules, and a brute-force longest-suffix / most-recent
/// search over every position of every live document.
struct Naive {
    cfg: SuffixConfig,
    docs: VecDeque<Vec<u32>>,
}

impl Naive {
    fn new(cfg: SuffixConfig) -> Self {
        Self {
            cfg,
            docs: VecDeque::new(),
        }
    }

    fn insert(&mut self, tokens: &[u32]) {
        let keep = self.cfg.max_doc_tokens.min(self.cfg.max_tokens_per_scope);
        let doc = tokens[tokens.len().saturating_sub(keep)..].to_vec();
        if doc.len() <= self.cfg.min_match {
            return;
        }
        while self.tokens() + doc.len() > self.cfg.max_tokens_per_scope {
            self.docs.pop_front();
        }
        self.docs.push_back(doc);
    }

    fn tokens(&self) -> usize {
        self.docs.iter().map(Vec::len).sum()
    }

    fn lookup(&self, context: &[u32], k: usize) -> Option<SuffixMatch> {
        if k == 0 {
            return None;
        }
        let limit = self.cfg.max_match.min(context.len());
        let mut best: Option<(&[u32], usize)> = None;
        // Oldest to newest, so `>=` lets the most recent tie win.
        for doc in &self.docs {
            for j in 1..doc.len() {
                let mut len = 0;
                while len < limit && len < j && doc[j - len - 1] == context[context.len() - len - 1]
                {
                    len += 1;
                }
                if len >= self.cfg.min_match && best.is_none_or(|(_, l)| len >= l) {
                    best = Some((&doc[j..(j + k).min(doc.len())], len));
                }
            }
        }
        best.map(|(t, match_len)| SuffixMatch {
            tokens: t.to_vec(),
            match_len,
            branches: Vec::new(),
        })
    }

    /// Whether `needle` occurs contiguously in a live document.
    fn contains(&self, needle: &[u32]) -> bool {
        self.docs
            .iter()
            .any(|d| d.windows(needle.len()).any(|w| w == needle))
    }
}

/// Checks that an answer is a real match in `model`'s documents: the
/// claimed suffix followed by the proposed tokens occurs in one document.
fn assert_real_match(model: &Naive, context: &[u32], got: &SuffixMatch) {
    let mut claimed = context[context.len() - got.match_len..].to_vec();
    claimed.extend_from_slice(&got.tokens);
    assert!(
        model.contains(&claimed),
        "claimed match {claimed:?} does not occur in the scope"
    );
}

#[test]
fn finds_the_continuation_of_an_inserted_document() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(p.lookup("a", &[9, 9, 3, 4, 5], 3), found(&[6, 7, 8], 3));
    assert_eq!(p.lookup("a", &[1, 2, 3, 4, 5], 2), found(&[6, 7], 5));
    // The continuation stops at the document's end.
    assert_eq!(p.lookup("a", &[4, 5, 6, 7], 10), found(&[8], 4));
    // A suffix at the very end of a document has no continuation.
    assert_eq!(p.lookup("a", &[6, 7, 8], 4), None);
}

#[test]
fn longest_match_beats_a_shorter_more_recent_one() {
    let mut p = SuffixPool::new(cfg(2, 12));
    p.insert("a", &[7, 1, 2, 3, 40, 41]);
    p.insert("a", &[9, 2, 3, 50, 51]);
    // [1, 2, 3] (older) beats [2, 3] (newer).
    assert_eq!(p.lookup("a", &[0, 1, 2, 3], 2), found(&[40, 41], 3));
    // Without the longer history, the newer [2, 3] wins.
    assert_eq!(p.lookup("a", &[0, 8, 2, 3], 2), found(&[50, 51], 2));
}

#[test]
fn equal_lengths_prefer_the_most_recent_occurrence() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[1, 2, 3, 10, 0, 1, 2, 3, 11]);
    // Within one document the later position is the more recent.
    assert_eq!(p.lookup("a", &[1, 2, 3], 1), found(&[11], 3));
    p.insert("a", &[5, 1, 2, 3, 12, 13]);
    // A later document beats both.
    assert_eq!(p.lookup("a", &[1, 2, 3], 2), found(&[12, 13], 3));
    // max_match caps the length, so capped matches tie and the newest
    // wins even though an older one shares more history.
    let mut p = SuffixPool::new(cfg(2, 3));
    p.insert("a", &[6, 7, 1, 2, 3, 20]);
    p.insert("a", &[0, 7, 1, 2, 3, 21]);
    p.insert("a", &[9, 9, 1, 2, 3, 22]);
    p.insert("a", &[9, 9, 9, 2, 3, 23]);
    assert_eq!(p.lookup("a", &[6, 7, 1, 2, 3], 1), found(&[22], 3));
}

#[test]
fn matches_shorter_than_min_match_give_none() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[1, 2, 3, 4, 5]);
    assert_eq!(p.lookup("a", &[9, 9, 3, 4], 2), None, "2-token match");
    assert_eq!(p.lookup("a", &[3, 4], 2), None, "context below min_match");
    assert_eq!(p.lookup("a", &[], 2), None);
    assert_eq!(p.lookup("a", &[2, 3, 4], 2), found(&[5], 3));
}

#[test]
fn matches_do_not_span_documents() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[9, 9, 9, 1, 2]);
    p.insert("a", &[3, 4, 5, 6]);
    assert_eq!(p.lookup("a", &[1, 2, 3], 2), None);
    assert_eq!(p.lookup("a", &[9, 1, 2], 2), None);
}

#[test]
fn k_bounds_the_length_and_zero_gives_none() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
    for k in 1..=6 {
        let got = p.lookup("a", &[1, 2, 3], k).unwrap();
        assert_eq!(got.tokens, (4..4 + k as u32).collect::<Vec<_>>());
    }
    assert_eq!(p.lookup("a", &[1, 2, 3], 0), None);
    assert_eq!(p.lookup("nobody", &[1, 2, 3], 4), None);
}

#[test]
fn short_documents_are_ignored_and_create_no_scope() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[1, 2, 3]);
    assert_eq!(p.num_scopes(), 0);
    assert_eq!(p.scope_tokens("a"), 0);
    p.insert("a", &[1, 2, 3, 4]);
    assert_eq!(p.scope_tokens("a"), 4);
    assert_eq!(p.lookup("a", &[1, 2, 3], 1), found(&[4], 3));
}

#[test]
fn scopes_are_isolated() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[1, 2, 3, 4, 5, 6]);
    assert_eq!(p.lookup("b", &[1, 2, 3], 3), None);
    p.insert("b", &[7, 1, 2, 3, 99]);
    assert_eq!(p.lookup("b", &[1, 2, 3], 3), found(&[99], 3));
    assert_eq!(p.lookup("a", &[1, 2, 3], 3), found(&[4, 5, 6], 3));
    p.forget("a");
    assert_eq!(p.lookup("a", &[1, 2, 3], 3), None);
    assert_eq!(p.scope_tokens("a"), 0);
    assert_eq!(p.num_scopes(), 1);
}

#[test]
fn randomized_lookups_never_leak_across_scopes() {
    let mut rng = Rng(7);
    let c = SuffixConfig {
        max_tokens_per_scope: 3000,
        ..cfg(2, 8)
    };
    let mut p = SuffixPool::new(c.clone());
    let mut b = Naive::new(c);
    // Scope a's tokens are even, b's odd: any even token in an answer
    // for b is a leak, and every answer for b must occur in b's docs.
    for _ in 0..300 {
        let len = 3 + rng.below(60) as usize;
        let doc: Vec<u32> = rng.tokens(len..len + 1, 6).iter().map(|t| t * 2).collect();
        p.insert("a", &doc);
        if rng.below(3) == 0 {
            let doc: Vec<u32> = rng
                .tokens(len..len + 1, 4)
                .iter()
                .map(|t| t * 2 + 1)
                .collect();
            p.insert("b", &doc);
            b.insert(&doc);
        }
    }
    let mut answered = 0;
    for i in 0..3000 {
        // Mostly odd contexts (b-like), sometimes a's own even text.
        let parity = u32::from(i % 4 != 0);
        let ctx: Vec<u32> = rng
            .tokens(1..13, 6)
            .iter()
            .map(|t| t * 2 + parity)
            .collect();
        if let Some(got) = p.lookup("b", &ctx, 1 + rng.below(8) as usize) {
            answered += 1;
            assert!(got.tokens.iter().all(|t| t % 2 == 1), "leak: {got:?}");
            assert_real_match(&b, &ctx, &got);
        }
    }
    assert!(
        answered > 100,
        "the test must exercise matches ({answered})"
    );
}

#[test]
fn oldest_documents_are_evicted_past_the_token_cap() {
    let mut p = SuffixPool::new(SuffixConfig {
        max_tokens_per_scope: 20,
        ..cfg(3, 12)
    });
    p.insert("a", &[1, 2, 3, 4, 5, 6, 7, 8]);
    p.insert("a", &[11, 12, 13, 14, 15, 16, 17, 18]);
    assert_eq!(p.scope_tokens("a"), 16);
    assert_eq!(p.lookup("a", &[1, 2, 3], 1), found(&[4], 3));
    p.insert("a", &[21, 22, 23, 24, 25, 26]);
    assert_eq!(p.scope_tokens("a"), 14);
    assert_eq!(p.lookup("a", &[1, 2, 3], 1), None, "oldest evicted");
    assert_eq!(p.lookup("a", &[11, 12, 13], 1), found(&[14], 3));
    assert_eq!(p.lookup("a", &[21, 22, 23], 1), found(&[24], 3));
    // A document as long as the cap evicts everything else.
    let big: Vec<u32> = (100..130).collect();
    p.insert("a", &big);
    assert_eq!(p.scope_tokens("a"), 20);
    assert_eq!(p.lookup("a", &[21, 22, 23], 1), None);
    assert_eq!(p.lookup("a", &[110, 111, 112], 2), found(&[113, 114], 3));
    assert_eq!(p.lookup("a", &[100, 101, 102], 2), None, "cut by the cap");
}

#[test]
fn index_stays_bounded_under_eviction() {
    let mut rng = Rng(11);
    let mut p = SuffixPool::new(SuffixConfig {
        max_tokens_per_scope: 500,
        ..cfg(3, 12)
    });
    for _ in 0..2000 {
        let len = 4 + rng.below(40) as usize;
        p.insert("a", &rng.tokens(len..len + 1, 1000));
        let s = &p.scopes["a"];
        assert!(s.tokens <= 500);
        assert_eq!(
            s.tokens,
            s.docs.iter().map(|d| d.tokens.len()).sum::<usize>()
        );
        // One head per live indexed position at most, none dangling.
        assert!(s.heads.len() <= s.tokens);
        let first = s.docs.front().unwrap().start;
        assert!(s.heads.values().all(|&pos| pos >= first));
    }
}

#[test]
fn least_recently_used_scope_is_dropped() {
    let mut p = SuffixPool::new(SuffixConfig {
        max_scopes: 2,
        ..cfg(3, 12)
    });
    p.insert("a", &[1, 2, 3, 4]);
    p.insert("b", &[1, 2, 3, 5]);
    // A lookup counts as use: now b is the least recently used.
    assert!(p.lookup("a", &[1, 2, 3], 1).is_some());
    p.insert("c", &[1, 2, 3, 6]);
    assert_eq!(p.num_scopes(), 2);
    assert_eq!(p.scope_tokens("b"), 0);
    assert_eq!(p.lookup("b", &[1, 2, 3], 1), None);
    assert_eq!(p.lookup("a", &[1, 2, 3], 1), found(&[4], 3));
    // The failed lookup of b (now unknown) used nothing; a was looked
    // up after c was inserted, so c is now the least recently used.
    p.insert("d", &[1, 2, 3, 7]);
    assert_eq!(p.num_scopes(), 2);
    assert_eq!(p.scope_tokens("c"), 0);
    assert_eq!(p.lookup("d", &[1, 2, 3], 1), found(&[7], 3));
    assert_eq!(p.lookup("a", &[1, 2, 3], 1), found(&[4], 3));
    // Inserting into an existing scope at capacity evicts nobody.
    p.insert("a", &[1, 2, 3, 8]);
    assert_eq!(p.num_scopes(), 2);
    assert!(p.scope_tokens("d") > 0);
}

#[test]
fn long_documents_keep_their_last_tokens() {
    let mut p = SuffixPool::new(SuffixConfig {
        max_doc_tokens: 10,
        ..cfg(3, 12)
    });
    let doc: Vec<u32> = (0..100).collect();
    p.insert("a", &doc);
    assert_eq!(p.scope_tokens("a"), 10);
    assert_eq!(p.lookup("a", &[1, 2, 3], 1), None, "head dropped");
    assert_eq!(p.lookup("a", &[90, 91, 92], 3), found(&[93, 94, 95], 3));
    // The kept part starts at 90: 89 is not part of the match.
    assert_eq!(p.lookup("a", &[89, 90, 91, 92], 1), found(&[93], 3));
}

/// With every gram hashing to one of a handful of buckets and no
/// candidate cap, chains mix unrelated grams: the pool must still equal
/// the brute-force answer exactly, so a collision can never claim a
/// match, hide a longer one or break the recency order.
#[test]
fn hash_collisions_never_change_the_answer() {
    for (seed, mask) in [(1, 0), (2, 1), (3, 3), (4, 15)] {
        let mut rng = Rng(seed);
        let c = SuffixConfig {
            max_tokens_per_scope: 400,
            max_doc_tokens: 60,
            ..cfg(1 + seed as usize % 3, 6)
        };
        let mut p = SuffixPool::with_index(c.clone(), mask, usize::MAX);
        let mut model = Naive::new(c);
        let mut answered = 0;
        for _ in 0..150 {
            let doc = rng.tokens(1..81, 3);
            p.insert("s", &doc);
            model.insert(&doc);
            assert_eq!(p.scope_tokens("s"), model.tokens());
            for _ in 0..10 {
                let ctx = rng.tokens(0..10, 3);
                let k = rng.below(6) as usize;
                let got = p.lookup("s", &ctx, k);
                assert_eq!(got, model.lookup(&ctx, k), "ctx {ctx:?} k {k}");
                answered += usize::from(got.is_some());
            }
        }
        assert!(answered > 500);
    }
}

/// The production index (full hash, capped candidates) may miss an old
/// longer match of a frequent gram, but every answer is real, never
/// longer than the best one, and equal to it when grams are rare.
#[test]
fn production_index_answers_are_real_and_exact_on_sparse_data() {
    let mut rng = Rng(5);
    let c = SuffixConfig {
        max_tokens_per_scope: 2000,
        ..cfg(2, 8)
    };
    let mut dense = SuffixPool::new(c.clone());
    let mut sparse = SuffixPool::new(c.clone());
    let (mut dense_model, mut sparse_model) = (Naive::new(c.clone()), Naive::new(c));
    for _ in 0..200 {
        let len = 3 + rng.below(50) as usize;
        let d = rng.tokens(len..len + 1, 4);
        dense.insert("s", &d);
        dense_model.insert(&d);
        // A large alphabet keeps every bigram's occurrences well under
        // the candidate cap.
        let d = rng.tokens(len..len + 1, 400);
        sparse.insert("s", &d);
        sparse_model.insert(&d);
    }
    for _ in 0..2000 {
        let ctx = rng.tokens(2..12, 4);
        let k = 1 + rng.below(6) as usize;
        let want = dense_model.lookup(&ctx, k);
        if let Some(got) = dense.lookup("s", &ctx, k) {
            assert_real_match(&dense_model, &ctx, &got);
            assert!(got.match_len <= want.unwrap().match_len);
        }
        // Sparse: reuse a stored snippet as context so matches happen.
        let doc = &sparse_model.docs[rng.below(sparse_model.docs.len() as u64) as usize];
        let end = 2 + rng.below(doc.len() as u64 - 1) as usize;
        let ctx = &doc[end.saturating_sub(10)..end];
        assert_eq!(sparse.lookup("s", ctx, k), sparse_model.lookup(ctx, k));
    }
}

#[test]
fn tree_offers_the_other_continuations_as_a_trie() {
    let mut p = SuffixPool::new(cfg(3, 12));
    p.insert("a", &[5, 1, 2, 3, 10, 11, 12]);
    p.insert("a", &[6, 1, 2, 3, 10, 20, 21]);
    p.insert("a", &[7, 1, 2, 3, 30, 31]);
    p.insert("a", &[9, 9, 1, 2, 3, 10, 11, 40]);
    // Every match has length 3: newest first. The chain is the newest
    // (10, 11, 40); 30, 31 branches at the root, 10, 20, 21 under node
    // 0 and 10, 11, 12 under node 1.
    let ctx = [8, 1, 2, 3];
    let t = p.lookup_tree("a", &ctx, 3, 10).unwrap();
    let chain = p.lookup("a", &ctx, 3).unwrap();
    assert_eq!((&t.tokens, t.match_len), (&chain.tokens, chain.match_len));
    assert_eq!(t.tokens, vec![10, 11, 40]);
    let all = vec![
        (30, None),
        (31, Some(3)),
        (20, Some(0)),
        (21, Some(5)),
        (12, Some(1)),
    ];
    assert_eq!(t.branches, all);
    for b in 0..all.len() {
        let got = p.lookup_tree("a", &ctx, 3, b).unwrap();
        assert_eq!(got.branches, all[..b], "budget {b}");
    }
    assert_eq!(p.lookup_tree("a", &ctx, 3, 0), Some(chain));
    // A longer match (4 tokens, in the second document) is the chain;
    // the 3-token ones follow, newest first.
    let t = p.lookup_tree("a", &[6, 1, 2, 3], 3, 10).unwrap();
    assert_eq!((t.tokens.clone(), t.match_len), (vec![10, 20, 21], 4));
    assert_eq!(
        t.branches,
        vec![
            (11, Some(0)),
            (40, Some(3)),
            (30, None),
            (31, Some(5)),
            (12, Some(3))
        ]
    );
    // Depth is at most k.
    let t = p.lookup_tree("a", &ctx, 1, 10).unwrap();
    assert_eq!((t.tokens, t.branches), (vec![10], vec![(30, None)]));
    let prop = p.lookup_tree("a", &ctx, 2, 10).unwrap().into_proposal();
    assert_eq!(prop.tokens, vec![10, 11]);
    assert_eq!(prop.q, None);
    assert_eq!(
        prop.branches,
        vec![(30, None), (31, Some(2)), (20, Some(0))]
    );
    prop.tree().unwrap();
    assert_eq!(p.lookup_tree("b", &ctx, 2, 10), None, "scopes stay apart");
}

/// Randomized, with colliding hashes: the tree's chain is always the
/// brute-force lookup, no node is deeper than k, siblings are distinct,
/// the budget holds and every node's path follows a real occurrence of
/// the context's last `min_match` tokens.
#[test]
fn tree_chains_equal_lookup_and_every_path_is_real() {
    let mut rng = Rng(21);
    let c = SuffixConfig {
        max_tokens_per_scope: 600,
        ..cfg(2, 6)
    };
    let mut p = SuffixPool::with_index(c.clone(), 7, usize::MAX);
    let mut model = Naive::new(c);
    let mut branched = 0;
    for _ in 0..60 {
        let doc = rng.tokens(3..40, 4);
        p.insert("s", &doc);
        model.insert(&doc);
        for _ in 0..10 {
            let ctx = rng.tokens(2..8, 4);
            let k = 1 + rng.below(5) as usize;
            let b = rng.below(9) as usize;
            let Some(t) = p.lookup_tree("s", &ctx, k, b) else {
                assert_eq!(model.lookup(&ctx, k), None);
                continue;
            };
            let want = model.lookup(&ctx, k).unwrap();
            assert_eq!((&t.tokens, t.match_len), (&want.tokens, want.match_len));
            assert!(t.branches.len() <= b);
            branched += usize::from(!t.branches.is_empty());
            let tree = t.clone().into_proposal().tree().unwrap();
            for node in std::iter::once(None).chain((0..tree.len()).map(Some)) {
                let kids = tree.children(node);
                let mut toks: Vec<u32> = kids.iter().map(|&c| tree.token(c)).collect();
                toks.sort_unstable();
                toks.dedup();
                assert_eq!(toks.len(), kids.len(), "repeated sibling: {t:?}");
            }
            for i in 0..tree.len() {
                assert!(tree.depth(i) <= k);
                let mut w = ctx[ctx.len() - 2..].to_vec();
                w.extend(tree.path_tokens(i));
                assert!(model.contains(&w), "{w:?} is not stored");
            }
        }
    }
    assert!(
        branched > 50,
        "the test must exercise branches ({branched})"
    );
}

#[test]
fn validate_names_the_bad_field() {
    assert_eq!(SuffixConfig::default().validate(), Ok(()));
    let bad = |c: SuffixConfig| c.validate().unwrap_err();
    assert!(bad(cfg(0, 12)).contains("min_match"));
    assert!(bad(cfg(5, 4)).contains("max_match"));
    assert!(bad(cfg(3, 65)).contains("max_match"));
    assert_eq!(cfg(64, 64).validate(), Ok(()));
    for field in ["max_tokens_per_scope", "max_scopes", "max_doc_tokens"] {
        let mut c = SuffixConfig::default();
        match field {
            "max_tokens_per_scope" => c.max_tokens_per_scope = 0,
            "max_scopes" => c.max_scopes = 0,
            _ => c.max_doc_tokens = 0,
        }
        assert!(bad(c).contains(field), "{field}");
    }
}

#[test]
#[should_panic(expected = "min_match")]
fn new_rejects_an_invalid_config() {
    SuffixPool::new(cfg(0, 3));
}

#[test]
fn debug_shows_no_tenant_data() {
    let mut p = SuffixPool::new(SuffixConfig::default());
    p.insert("secret-scope", &[123_456, 234_567, 345_678, 456_789]);
    let s = format!("{p:?}");
    assert!(!s.contains("secret") && !s.contains("123456"), "{s}");
    assert!(s.contains("tokens: 4"), "{s}");
}
