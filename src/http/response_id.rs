//! Response ids of the Responses API: minted here, and the one check of an
//! id a client sends back (`GET`/`DELETE /v1/responses/{id}`,
//! `previous_response_id`), shared by the server and the router.
//!
//! Without API keys every client shares one store, so a stored response's
//! id is the only secret that guards it: an id is `resp_` and
//! [`RANDOM_BYTES`] bytes (144 bits) from the OS's CSPRNG in URL-safe
//! base64. Nothing else goes into it: not the client's `X-Request-Id` (a
//! client could then pick another's id and replace that response), not a
//! counter (ids seen anywhere, `/health`'s included, would then narrow the
//! next ones to a few guesses). An id sent back is percent-decoded (the
//! official SDKs encode path segments) and must have the minted shape;
//! anything else is a 404 before the store is asked.

use crate::api::ApiError;
use percent_encoding::percent_decode_str;

/// What every response id starts with (OpenAI's prefix).
pub const PREFIX: &str = "resp_";

/// Random bytes in an id: 144 bits (the issue asked for at least 122, a
/// UUIDv4's), a multiple of 3 so the base64 has no padding.
pub const RANDOM_BYTES: usize = 18;

/// Characters after [`PREFIX`]: 4 per 3 random bytes.
pub const ID_CHARS: usize = RANDOM_BYTES / 3 * 4;

/// URL-safe base64 (RFC 4648 §5): no character needs escaping in a path,
/// a header or a JSON string.
const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// A fresh response id from the OS's CSPRNG.
///
/// Errors: the OS gave no random bytes (then no id is safe to hand out,
/// and the request fails rather than storing under a guessable one).
pub fn mint() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; RANDOM_BYTES];
    getrandom::fill(&mut bytes)?;
    Ok(encode(&bytes))
}

/// [`PREFIX`] and `bytes` in [`ALPHABET`], 6 bits a character.
fn encode(bytes: &[u8; RANDOM_BYTES]) -> String {
    let mut id = String::with_capacity(PREFIX.len() + ID_CHARS);
    id.push_str(PREFIX);
    for c in bytes.chunks_exact(3) {
        let n = u32::from(c[0]) << 16 | u32::from(c[1]) << 8 | u32::from(c[2]);
        for shift in [18, 12, 6, 0] {
            id.push(ALPHABET[(n >> shift) as usize & 63] as char);
        }
    }
    id
}

/// Whether `id` has the shape [`mint`] gives: [`PREFIX`], then exactly
/// [`ID_CHARS`] characters of the URL-safe alphabet. Only such ids are
/// ever stored, so any other is unknown without asking the store.
pub fn is_minted(id: &str) -> bool {
    id.strip_prefix(PREFIX).is_some_and(|rest| {
        rest.len() == ID_CHARS
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

/// The id named by a by-id route's path segment (what follows
/// [`crate::http::RESPONSE_PREFIX`]), percent-decoded; bytes that are not
/// UTF-8 are replaced (such an id is never minted, and the 404 that names it
/// stays valid JSON).
pub fn from_path(segment: &str) -> String {
    percent_decode_str(segment).decode_utf8_lossy().into_owned()
}

/// The 404 of a by-id route for an id the sender's scope does not hold
/// (or that was never minted): the same words from a replica and from the
/// router.
pub fn not_stored(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "No response with id '{id}' is stored: it was never stored, was deleted, or was \
         evicted from this server's bounded store."
    ))
    .with_code("response_not_found")
}

/// The 404 of a `previous_response_id` the sender's scope does not hold.
pub fn previous_not_stored(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "Previous response with id '{id}' not found: it was never stored, was deleted, or \
         was evicted from this server's bounded store."
    ))
    .with_param("previous_response_id")
    .with_code("previous_response_not_found")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// An id's random bytes, decoded back from its characters.
    fn bytes_of(id: &str) -> [u8; RANDOM_BYTES] {
        let rest = id.strip_prefix(PREFIX).unwrap().as_bytes();
        let mut out = [0u8; RANDOM_BYTES];
        for (c, o) in rest.chunks_exact(4).zip(out.chunks_exact_mut(3)) {
            let n = c.iter().fold(0u32, |n, &ch| {
                n << 6 | ALPHABET.iter().position(|&a| a == ch).unwrap() as u32
            });
            o.copy_from_slice(&n.to_be_bytes()[1..]);
        }
        out
    }

    fn as_u128(b: &[u8; RANDOM_BYTES]) -> u128 {
        u128::from_be_bytes(b[..16].try_into().unwrap())
    }

    /// 10,000 mints: each well formed and distinct; no id is what two ids
    /// minted before it predict (the next step of their difference, of
    /// their xor, a neighbour of either), no two consecutive ids are close
    /// as numbers, and every bit is set about half the time.
    #[test]
    fn ten_thousand_ids_are_distinct_well_formed_and_unpredictable_from_two_others() {
        let ids: Vec<String> = (0..10_000).map(|_| mint().unwrap()).collect();
        let all: HashSet<&str> = ids.iter().map(String::as_str).collect();
        assert_eq!(all.len(), ids.len(), "an id was minted twice");
        let raw: Vec<[u8; RANDOM_BYTES]> = ids
            .iter()
            .inspect(|id| {
                assert!(is_minted(id), "{id}");
                assert_eq!(id.len(), PREFIX.len() + ID_CHARS, "{id}");
            })
            .map(|id| bytes_of(id))
            .collect();
        for (id, b) in ids.iter().zip(&raw) {
            assert_eq!(&encode(b), id, "decoding is exact");
        }
        for w in raw.windows(2) {
            let (a, b) = (w[0], w[1]);
            let (x, y) = (as_u128(&a), as_u128(&b));
            let gap = y.wrapping_sub(x).min(x.wrapping_sub(y));
            assert!(gap > 1 << 64, "consecutive ids differ by {gap}");
            // What a counter, a keyed counter or a stepped generator would
            // mint next; none equals `b` itself (the gap above).
            let mut guesses = vec![
                y.wrapping_add(y.wrapping_sub(x)),
                y.wrapping_add(1),
                y.wrapping_sub(1),
                x.wrapping_add(2),
            ];
            guesses.extend((0..128).map(|bit| y ^ (1u128 << bit)));
            for g in guesses {
                let mut gb = b;
                gb[..16].copy_from_slice(&g.to_be_bytes());
                let guess = encode(&gb);
                assert!(
                    !all.contains(guess.as_str()),
                    "{guess} was guessed from two ids"
                );
            }
        }
        // Each of the 144 bits set in 50% ± 8 standard deviations (±400)
        // of the ids: no bit is fixed or biased (a counter's high bits are).
        for bit in 0..RANDOM_BYTES * 8 {
            let set = raw
                .iter()
                .filter(|b| b[bit / 8] >> (7 - bit % 8) & 1 == 1)
                .count();
            assert!((4_600..=5_400).contains(&set), "bit {bit} set {set} times");
        }
    }

    #[test]
    fn only_the_minted_shape_passes() {
        let id = mint().unwrap();
        assert!(is_minted(&id));
        let rest = &id[PREFIX.len()..];
        for bad in [
            String::new(),
            "resp_".into(),
            "resp_x".into(),
            rest.to_string(),
            format!("msg_{rest}"),
            format!("{id}A"),
            id[..id.len() - 1].to_string(),
            format!("resp_{}.", &rest[1..]),
            format!("resp_{}/", &rest[1..]),
            format!("resp_{}%", &rest[1..]),
            format!("resp_{}é", &rest[2..]),
            format!("resp_{}/../v1/models", &rest[13..]),
        ] {
            assert!(!is_minted(&bad), "{bad:?} passed");
        }
    }

    #[test]
    fn path_segments_are_percent_decoded() {
        let id = mint().unwrap();
        let encoded: String = id.bytes().map(|b| format!("%{b:02X}")).collect();
        assert_eq!(from_path(&encoded), id);
        assert_eq!(from_path(&id), id);
        assert_eq!(from_path("resp_a%2F..%2Fb"), "resp_a/../b");
        assert_eq!(from_path("resp_%FF"), "resp_\u{fffd}");
    }
}
