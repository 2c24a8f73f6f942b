//! Toy grammars for the speculation tests: a grammar that decides each
//! output token by its position alone ([`mask_at`], [`valid_prefix_at`]).

use specgate_verify::TokenMask;

/// The ids of a `vocab`-sized vocabulary that `ok` allows at output
/// position `pos`.
pub fn mask_at(vocab: usize, pos: usize, ok: impl Fn(usize, u32) -> bool) -> TokenMask {
    let mut m = TokenMask::none(vocab);
    (0..vocab as u32)
        .filter(|&t| ok(pos, t))
        .for_each(|t| m.allow(t));
    m
}

/// How many leading `tokens`, the first at output position `start`, `ok`
/// allows in order.
pub fn valid_prefix_at(start: usize, tokens: &[u32], ok: impl Fn(usize, u32) -> bool) -> usize {
    tokens
        .iter()
        .enumerate()
        .take_while(|&(i, &t)| ok(start + i, t))
        .count()
}
