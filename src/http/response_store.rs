//! The Responses API's store: responses kept (`store`, on by default) so
//! a client can read one back (`GET /v1/responses/{id}`), delete it, or
//! continue its conversation (`previous_response_id`).
//!
//! Bounded: each scope (one per API key, or one when the server has no
//! keys) holds at most `max_entries` responses and `max_bytes` bytes of
//! them, oldest evicted first; scopes are as many as the configured keys
//! plus one, so the whole store is bounded. A response is found only in
//! the scope that stored it: one key never reads, continues or deletes
//! another's.

use crate::tokenizer::ChatMessage;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// A stored conversation: the turns one response added (its new input
/// turns and its own output), after the conversation it continued, which
/// is shared, never copied. A chain of continuations costs each turn once.
#[derive(Debug, Default)]
pub struct Conversation {
    prior: Option<Arc<Conversation>>,
    turns: Vec<ChatMessage>,
    /// Turns in the whole chain.
    len: usize,
    /// Heap bytes of the whole chain's turns ([`turn_bytes`]).
    bytes: usize,
}

impl Conversation {
    /// `turns` after `prior`.
    pub fn new(prior: Option<Arc<Conversation>>, turns: Vec<ChatMessage>) -> Self {
        let (len, bytes) = prior.as_ref().map_or((0, 0), |p| (p.len, p.bytes));
        Self {
            len: len + turns.len(),
            bytes: bytes + turns.iter().map(turn_bytes).sum::<usize>(),
            prior,
            turns,
        }
    }

    /// Turns in the whole conversation.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no turns.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every turn, oldest first.
    pub fn turns(&self) -> Vec<&ChatMessage> {
        let mut chain = Vec::new();
        let mut at = Some(self);
        while let Some(c) = at {
            chain.push(c);
            at = c.prior.as_deref();
        }
        chain.iter().rev().flat_map(|c| c.turns.iter()).collect()
    }
}

/// What a turn holds on the heap, its own struct included: the size the
/// store counts it at.
pub fn turn_bytes(m: &ChatMessage) -> usize {
    let opt = |s: &Option<String>| s.as_ref().map_or(0, String::capacity);
    std::mem::size_of::<ChatMessage>()
        + m.role.capacity()
        + m.content.capacity()
        + opt(&m.tool_call_id)
        + opt(&m.name)
        + opt(&m.reasoning_content)
        + m.tool_calls
            .iter()
            .map(|c| {
                std::mem::size_of_val(c)
                    + c.id.capacity()
                    + c.function.name.capacity()
                    + value_bytes(&c.function.arguments)
            })
            .sum::<usize>()
}

/// An upper bound of a JSON tree's heap bytes (a tool call's arguments).
fn value_bytes(v: &Value) -> usize {
    // Each node, its text and the allocator's rounding: 64 bytes a node
    // bounds serde_json's map entries and vector slots.
    64 + match v {
        Value::String(s) => s.capacity(),
        Value::Array(a) => a.iter().map(value_bytes).sum(),
        Value::Object(m) => m.iter().map(|(k, v)| k.capacity() + value_bytes(v)).sum(),
        _ => 0,
    }
}

/// One stored response.
#[derive(Debug)]
pub struct Stored {
    /// The response object as `GET` returns it, serialized.
    pub body: Box<str>,
    /// The conversation it ended (its input turns without `instructions`,
    /// then its own assistant turn), which a continuation starts from.
    pub conversation: Arc<Conversation>,
    /// What it counts against the scope's byte bound: its body and its
    /// whole conversation (shared turns counted in each response that
    /// holds them, so what the store keeps alive never exceeds its count).
    bytes: usize,
}

impl Stored {
    /// A response to store: its JSON text and its conversation.
    pub fn new(body: &str, conversation: Arc<Conversation>) -> Self {
        let body: Box<str> = body.into();
        Self {
            bytes: body.len() + conversation.bytes + std::mem::size_of::<Self>(),
            body,
            conversation,
        }
    }
}

#[derive(Default)]
struct Scope {
    /// Ids oldest first.
    order: VecDeque<String>,
    by_id: HashMap<String, Arc<Stored>>,
    bytes: usize,
}

/// The store (see the module doc).
pub struct ResponseStore {
    scopes: Mutex<HashMap<u64, Scope>>,
    max_entries: usize,
    max_bytes: usize,
}

impl ResponseStore {
    /// A store keeping at most `max_entries` responses and `max_bytes`
    /// bytes per scope (0 entries: nothing is ever kept).
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        Self {
            scopes: Mutex::new(HashMap::new()),
            max_entries,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Scope>> {
        self.scopes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `r` as `id` in `scope`, evicting the scope's oldest responses
    /// until both bounds hold; whether it was kept. A response larger than
    /// the byte bound on its own is not kept, and neither is one whose id
    /// the scope already holds: a request never replaces another's stored
    /// response (ids are random, [`super::response_id`], so this is a
    /// second guard, not a case that comes up).
    pub fn put(&self, scope: u64, id: String, r: Stored) -> bool {
        if self.max_entries == 0 || r.bytes > self.max_bytes {
            return false;
        }
        let mut scopes = self.lock();
        let s = scopes.entry(scope).or_default();
        if s.by_id.contains_key(&id) {
            return false;
        }
        while !s.order.is_empty()
            && (s.order.len() >= self.max_entries || s.bytes + r.bytes > self.max_bytes)
        {
            if let Some(old) = s.order.pop_front().and_then(|o| s.by_id.remove(&o)) {
                s.bytes -= old.bytes;
            }
        }
        s.bytes += r.bytes;
        s.order.push_back(id.clone());
        s.by_id.insert(id, Arc::new(r));
        true
    }

    /// The response `id` of `scope`, if it is kept.
    pub fn get(&self, scope: u64, id: &str) -> Option<Arc<Stored>> {
        self.lock().get(&scope)?.by_id.get(id).cloned()
    }

    /// Deletes `id` from `scope`; whether it was there.
    pub fn delete(&self, scope: u64, id: &str) -> bool {
        let mut scopes = self.lock();
        let Some(s) = scopes.get_mut(&scope) else {
            return false;
        };
        match s.by_id.remove(id) {
            Some(old) => {
                s.bytes -= old.bytes;
                s.order.retain(|x| x != id);
                true
            }
            None => false,
        }
    }

    /// Responses kept in `scope`.
    pub fn len(&self, scope: u64) -> usize {
        self.lock().get(&scope).map_or(0, |s| s.order.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resp(n: usize) -> Stored {
        Stored::new(
            &json!({"id": n, "pad": "x".repeat(n)}).to_string(),
            Arc::new(Conversation::default()),
        )
    }

    fn id_of(s: &Stored) -> Value {
        serde_json::from_str::<Value>(&s.body).unwrap()["id"].clone()
    }

    #[test]
    fn a_chain_shares_its_turns_and_counts_them_in_each_response() {
        let turn = |t: &str| ChatMessage::new("user", t.repeat(1000));
        let a = Arc::new(Conversation::new(None, vec![turn("a"), turn("b")]));
        let b = Arc::new(Conversation::new(Some(a.clone()), vec![turn("c")]));
        assert_eq!(b.len(), 3);
        let text: Vec<&str> = b.turns().iter().map(|m| &m.content[..1]).collect();
        assert_eq!(text, ["a", "b", "c"]);
        // The shared turns are the same allocation, not a copy.
        assert!(std::ptr::eq(a.turns()[0], b.turns()[0]));
        assert!(b.bytes >= 3000 && b.bytes > a.bytes);
        let stored = Stored::new("{}", b.clone());
        assert!(stored.bytes >= b.bytes + 2);
    }

    #[test]
    fn entries_are_bounded_oldest_first_and_scopes_never_cross() {
        let s = ResponseStore::new(3, 1 << 20);
        for i in 0..5 {
            s.put(1, format!("r{i}"), resp(1));
        }
        assert_eq!(s.len(1), 3);
        assert!(s.get(1, "r0").is_none() && s.get(1, "r1").is_none());
        assert!(s.get(1, "r4").is_some());
        // Another scope sees none of them, and cannot delete them.
        assert!(s.get(2, "r4").is_none());
        assert!(!s.delete(2, "r4"));
        assert!(s.delete(1, "r4"));
        assert!(s.get(1, "r4").is_none());
    }

    #[test]
    fn a_stored_id_is_never_replaced() {
        let s = ResponseStore::new(8, 1 << 20);
        assert!(s.put(0, "r".into(), resp(1)));
        assert!(!s.put(0, "r".into(), resp(2)));
        assert_eq!(id_of(&s.get(0, "r").unwrap()), 1);
        assert_eq!(s.len(0), 1);
        // Another scope's id of the same text is its own.
        assert!(s.put(1, "r".into(), resp(3)));
        assert_eq!(id_of(&s.get(0, "r").unwrap()), 1);
    }

    #[test]
    fn bytes_are_bounded() {
        let one = resp(100).bytes;
        let s = ResponseStore::new(100, one * 2 + 1);
        for i in 0..4 {
            s.put(0, format!("r{i}"), resp(100));
        }
        assert_eq!(s.len(0), 2);
        assert!(s.get(0, "r3").is_some() && s.get(0, "r2").is_some());
        // Larger than the bound on its own: not kept, nothing evicted.
        s.put(0, "big".into(), resp(10_000));
        assert!(s.get(0, "big").is_none());
        assert_eq!(s.len(0), 2);
    }
}
