//! Sampling and logits controls of a generation request: temperature,
//! top-p, top-k, min-p, seed; OpenAI's `presence_penalty`,
//! `frequency_penalty` and `logit_bias`; vLLM's `repetition_penalty`,
//! `min_tokens` and `stop_token_ids`; completions' integer `logprobs`.
//! Each bad value is a 400 naming its field.

use specgate_verify::{Controls, SamplingParams};

use super::error::ApiError;
use super::json::{as_int, as_number, get, type_err};
use super::json::{Json, Obj};

/// Largest `temperature` (OpenAI's range is `0..=2`).
pub const MAX_TEMPERATURE: f32 = 2.0;
/// `temperature` when the request gives none (OpenAI's default).
pub const DEFAULT_TEMPERATURE: f32 = 1.0;
/// Most alternatives per token (`top_logprobs`, completions' `logprobs`):
/// OpenAI's chat limit, and the engine's.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Largest `|presence_penalty|` and `|frequency_penalty|` (OpenAI's).
pub const MAX_PENALTY: f64 = 2.0;
/// Largest `|bias|` of a `logit_bias` entry (OpenAI's).
pub const MAX_LOGIT_BIAS: f64 = 100.0;
/// Temperatures below this are greedy (stored as 0): `1/t` of a smaller
/// (or subnormal) `t` overflows f32, and `0 * inf` turns the warp into
/// NaNs. The sampler's own bound.
pub const GREEDY_TEMPERATURE: f64 = specgate_verify::sample::GREEDY_TEMPERATURE as f64;
/// Range of `repetition_penalty`: dividing or multiplying a logit by a
/// factor inside it stays finite for any logit a model produces (vLLM
/// only asks for > 0, which lets `1e-39` overflow every logit to inf).
pub const MIN_REPETITION_PENALTY: f64 = 0.01;
pub const MAX_REPETITION_PENALTY: f64 = 100.0;
/// Most `logit_bias` entries (OpenAI's limit), and most `stop_token_ids`.
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 300;
pub const MAX_STOP_TOKEN_IDS: usize = 300;

/// Temperature, top-p, top-k, min-p and seed.
///
/// A `temperature` below [`GREEDY_TEMPERATURE`] is stored as 0 (greedy).
///
/// Errors (400 naming the field): `temperature` outside `0..=2`, `top_p`
/// outside `(0, 1]`, `top_k` below -1, `seed` outside `0..2^64`, `min_p`
/// outside `0..=1`; any of them of the wrong type.
pub(super) fn parse_sampling(map: &Obj) -> Result<SamplingParams, ApiError> {
    let mut s = SamplingParams {
        temperature: DEFAULT_TEMPERATURE,
        ..SamplingParams::default()
    };
    if let Some(v) = get(map, "temperature") {
        let t = as_number(v, "temperature")?;
        if !(0.0..=MAX_TEMPERATURE as f64).contains(&t) {
            return Err(ApiError::invalid(
                "temperature",
                format!(
                    "Invalid 'temperature': expected a value between 0 and 2, but got {t} instead."
                ),
            ));
        }
        s.temperature = if t < GREEDY_TEMPERATURE {
            0.0
        } else {
            t as f32
        };
    }
    if let Some(v) = get(map, "top_p") {
        let p = as_number(v, "top_p")?;
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("Invalid 'top_p': expected a value in (0, 1], but got {p} instead."),
            ));
        }
        s.top_p = p as f32;
    }
    if let Some(v) = get(map, "top_k") {
        let k = as_int(v, "top_k")?;
        s.top_k = match k {
            -1 | 0 => 0,
            k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            k => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("Invalid 'top_k': expected a value >= 0 (0 or -1 turn it off), but got {k} instead."),
                ))
            }
        };
    }
    if let Some(v) = get(map, "seed") {
        let seed = as_int(v, "seed")?;
        s.seed = Some(u64::try_from(seed).map_err(|_| {
            ApiError::invalid(
                "seed",
                format!("Invalid 'seed': expected a value between 0 and 2^64-1, but got {seed} instead."),
            )
        })?);
    }
    if let Some(v) = get(map, "min_p") {
        let p = as_number(v, "min_p")?;
        if !(0.0..=1.0).contains(&p) {
            return Err(ApiError::invalid(
                "min_p",
                format!("Invalid 'min_p': expected a value between 0 and 1, but got {p} instead."),
            ));
        }
        s.min_p = p as f32;
    }
    Ok(s)
}

/// Penalties, `logit_bias` and `min_tokens`. `max_tokens` is the request's
/// limit when it gave one (`min_tokens` may not exceed it).
///
/// Errors (400 naming the field): a penalty outside `-2..=2`;
/// `repetition_penalty` outside `0.01..=100`; `logit_bias` not an
/// object, a key that is not a token id (a non-negative integer in
/// decimal), two keys naming the same id (`"5"` and `"05"`), a bias
/// outside `-100..=100`, more than 300 entries;
/// `min_tokens` negative or above `max_tokens`.
pub(super) fn parse_controls(map: &Obj, max_tokens: Option<usize>) -> Result<Controls, ApiError> {
    let mut c = Controls::default();
    for (name, slot) in [
        ("presence_penalty", &mut c.presence_penalty),
        ("frequency_penalty", &mut c.frequency_penalty),
    ] {
        if let Some(v) = get(map, name) {
            let p = as_number(v, name)?;
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&p) {
                return Err(ApiError::invalid(
                    name,
                    format!(
                        "Invalid '{name}': expected a value between -2 and 2, but got {p} instead."
                    ),
                ));
            }
            *slot = p as f32;
        }
    }
    if let Some(v) = get(map, "repetition_penalty") {
        let p = as_number(v, "repetition_penalty")?;
        if !(MIN_REPETITION_PENALTY..=MAX_REPETITION_PENALTY).contains(&p) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!(
                    "Invalid 'repetition_penalty': expected a value between \
                     {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY} (1 is off), but got {p} instead."
                ),
            ));
        }
        c.repetition_penalty = p as f32;
    }
    if let Some(v) = get(map, "logit_bias") {
        c.logit_bias = parse_logit_bias(v)?;
    }
    if let Some(v) = get(map, "min_tokens") {
        let n = as_int(v, "min_tokens")?;
        if n < 0 {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("Invalid 'min_tokens': expected a value >= 0, but got {n} instead."),
            ));
        }
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if let Some(max) = max_tokens.filter(|&m| n > m) {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("Invalid 'min_tokens': it is {n}, above the request's token limit {max}."),
            ));
        }
        c.min_tokens = n;
    }
    Ok(c)
}

fn parse_logit_bias(v: &Json) -> Result<Vec<(u32, f32)>, ApiError> {
    let obj = v
        .as_object()
        .ok_or_else(|| type_err("logit_bias", "an object mapping token ids to numbers", v))?;
    if obj.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "Invalid 'logit_bias': at most {MAX_LOGIT_BIAS_ENTRIES} entries, but got {}.",
                obj.len()
            ),
        ));
    }
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(obj.len());
    for (k, b) in obj.iter() {
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|_| k.bytes().all(|c| c.is_ascii_digit()))
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("Invalid 'logit_bias': key '{k}' is not a token id (a non-negative integer)."),
                )
            })?;
        let bias = b.as_f64().filter(|_| b.is_number()).ok_or_else(|| {
            ApiError::invalid(
                "logit_bias",
                format!("Invalid 'logit_bias': the bias of token {id} must be a number."),
            )
        })?;
        if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&bias) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("Invalid 'logit_bias': the bias of token {id} must be between -100 and 100, but is {bias}."),
            ));
        }
        // Keys are compared by the id they name: `"5"` and `"05"` would
        // otherwise add two biases to one token.
        if out.iter().any(|&(seen, _)| seen == id) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("Invalid 'logit_bias': token id {id} is given more than once (as '{k}' and another key)."),
            ));
        }
        out.push((id, bias as f32));
    }
    Ok(out)
}

/// vLLM's `stop_token_ids`: an array of at most 300 token ids.
///
/// Errors (400 naming `stop_token_ids`): not an array, an item that is
/// not an integer in `0..2^32`, too many items.
pub(super) fn parse_stop_token_ids(map: &Obj) -> Result<Vec<u32>, ApiError> {
    let Some(v) = get(map, "stop_token_ids") else {
        return Ok(Vec::new());
    };
    let items = v
        .as_array()
        .ok_or_else(|| type_err("stop_token_ids", "an array of token ids", v))?;
    if items.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "Invalid 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} ids, but got {}.",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .map(|item| {
            let n = as_int(item, "stop_token_ids")?;
            u32::try_from(n).map_err(|_| {
                ApiError::invalid(
                    "stop_token_ids",
                    format!("Invalid 'stop_token_ids': {n} is not a token id."),
                )
            })
        })
        .collect()
}

/// Completions' `logprobs`: an integer `0..=20` (vLLM's limit and the
/// chat endpoint's; OpenAI documents 5), `Some(n)` = the chosen token's
/// log-probability and the `n` most likely. `false` counts as absent.
///
/// Errors (400 naming `logprobs`): `true`, a non-integer, out of range.
pub(super) fn parse_logprobs(map: &Obj) -> Result<Option<usize>, ApiError> {
    match get(map, "logprobs") {
        None | Some(Json::Bool(false)) => Ok(None),
        Some(v) => {
            let n = as_int(v, "logprobs")?;
            if !(0..=MAX_TOP_LOGPROBS as i128).contains(&n) {
                return Err(ApiError::invalid(
                    "logprobs",
                    format!("Invalid 'logprobs': expected a value between 0 and {MAX_TOP_LOGPROBS}, but got {n} instead."),
                ));
            }
            Ok(Some(n as usize))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `f` over the object `v` as a request body gives it.
    fn with<R>(v: serde_json::Value, f: impl FnOnce(&Obj) -> R) -> R {
        let text = v.to_string();
        f(&super::super::json::parse_object(text.as_bytes()).unwrap())
    }

    fn param_of(e: ApiError) -> String {
        e.param.unwrap_or_default()
    }

    #[test]
    fn a_temperature_too_small_to_divide_by_is_greedy() {
        for t in [1e-39, 1e-20, 9e-6, 0.0] {
            let s = with(json!({ "temperature": t }), parse_sampling).unwrap();
            assert_eq!(s.temperature, 0.0, "{t}");
            assert!(s.is_greedy());
        }
        let s = with(json!({"temperature": 1e-5}), parse_sampling).unwrap();
        assert_eq!(s.temperature, 1e-5);
        assert!(!s.is_greedy());
    }

    #[test]
    fn repetition_penalty_stays_where_the_arithmetic_is_finite() {
        for bad in [1e-39, 0.009, 100.5, 1e30, 0.0, -1.0] {
            let e = with(json!({ "repetition_penalty": bad }), |m| {
                parse_controls(m, None)
            })
            .unwrap_err();
            assert_eq!(param_of(e), "repetition_penalty", "{bad}");
        }
        for ok in [0.01, 1.0, 100.0] {
            let c = with(json!({ "repetition_penalty": ok }), |m| {
                parse_controls(m, None)
            })
            .unwrap();
            assert_eq!(c.repetition_penalty, ok as f32);
        }
    }

    #[test]
    fn logit_bias_keys_are_compared_by_value() {
        for keys in [json!({"5": 1, "05": 2}), json!({"0": 1, "00": 1})] {
            let e = with(json!({ "logit_bias": keys }), |m| parse_controls(m, None)).unwrap_err();
            assert_eq!(param_of(e), "logit_bias", "{keys}");
        }
        let c = with(json!({"logit_bias": {"05": 2, "6": 1}}), |m| {
            parse_controls(m, None)
        })
        .unwrap();
        let mut b = c.logit_bias;
        b.sort_by_key(|x| x.0);
        assert_eq!(b, vec![(5, 2.0), (6, 1.0)]);
    }
}
