//! Memory that follows what is sent and kept (issue 57's memory item): a
//! request's parse allocates at most 3x its body; 8 concurrent 1 MB bodies
//! (of tool schemas, of text, of both) raise the server's peak RSS by at
//! most 5x their size; 16 concurrent
//! continuations of a 3.6 MB chain peak at most 2x what 16 fresh requests
//! do, plus one copy of the chain; a stored response costs what the store
//! counts it at (within 2x).
//!
//! The server runs in this process, so its RSS is this process's: the
//! peak is read as `VmHWM` after resetting it (`/proc/self/clear_refs`),
//! with every request body built beforehand. This binary holds only these
//! tests, run one at a time, so nothing else allocates meanwhile. Bytes a
//! parse allocates are counted by this binary's global allocator.

mod common;

use common::*;
use serde_json::{json, Value};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// System's allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Relaxed) + l.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Relaxed);
    }
    /// The system's own realloc (glibc grows a large block in place with
    /// `mremap`, as the server's allocator does), counted as the change in
    /// size: the default would allocate, copy and free, holding both.
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new_size) };
        if !q.is_null() {
            if new_size >= l.size() {
                let now = LIVE.fetch_add(new_size - l.size(), Relaxed) + new_size - l.size();
                PEAK.fetch_max(now, Relaxed);
            } else {
                LIVE.fetch_sub(l.size() - new_size, Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One test at a time: each measures the whole process.
static ONE: Mutex<()> = Mutex::new(());

/// The most bytes `f` had allocated at once, beyond what was live before.
fn peak_of<R>(f: impl FnOnce() -> R) -> (usize, R) {
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let r = f();
    (PEAK.load(Relaxed) - before, r)
}

fn status_kb(field: &str) -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// How far this process's RSS rose above where it stood while `f` ran,
/// in bytes (the peak counted by the kernel).
fn rss_rise(f: impl FnOnce()) -> usize {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak RSS");
    let before = status_kb("VmRSS:");
    f();
    status_kb("VmHWM:").saturating_sub(before) * 1024
}

/// `n` properties, each a small schema: the shape that makes a JSON tree
/// cost the most per byte.
fn big_schema(bytes: usize) -> Value {
    let mut props = serde_json::Map::new();
    let mut i = 0;
    while props.len() * 80 < bytes {
        props.insert(
            format!("field_{i}"),
            json!({"type": "string", "description": format!("the {i}th field"), "enum": ["a", "b"]}),
        );
        i += 1;
    }
    json!({"type": "object", "properties": props})
}

/// Bodies of each wire format of about `bytes`, most of it tool schemas
/// and message text (`text_share` of it).
fn bodies_of(bytes: usize, text_share: f64) -> Vec<(&'static str, String)> {
    let text_bytes = (bytes as f64 * text_share) as usize;
    let schema = big_schema(bytes - text_bytes);
    let text = "word ".repeat(text_bytes / 5 + 1);
    vec![
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 2, "temperature": 0, "tool_choice": "none",
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                   "messages": [{"role": "user", "content": text}]})
            .to_string(),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 2, "temperature": 0, "tool_choice": {"type": "none"},
                   "tools": [{"name": "f", "input_schema": schema}],
                   "messages": [{"role": "user", "content": text}]})
            .to_string(),
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 2, "temperature": 0, "tool_choice": "none",
                   "store": false,
                   "tools": [{"type": "function", "name": "f", "parameters": schema}],
                   "input": [{"role": "user", "content": text}]})
            .to_string(),
        ),
    ]
}

/// Bodies of about `bytes`, a third of it message text.
fn bodies(bytes: usize) -> Vec<(&'static str, String)> {
    bodies_of(bytes, 1.0 / 3.0)
}

#[test]
fn a_parse_allocates_at_most_three_times_its_body() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    for (path, body) in bodies(1 << 20) {
        let b = body.as_bytes();
        let (peak, ok) = peak_of(|| match path {
            "/v1/chat/completions" => specgate::api::parse_chat(b).is_ok(),
            "/v1/messages" => specgate::api::anthropic::parse_messages_request(b, 64).is_ok(),
            _ => specgate::api::responses::parse_responses_request(b).is_ok(),
        });
        assert!(ok, "{path}");
        eprintln!("{path}: body {} B, parse peak {peak} B", b.len());
        assert!(
            peak <= 3 * b.len(),
            "{path}: {peak} B for a {} B body",
            b.len()
        );
    }
}

/// The tiny server with room for 1 MB bodies and their prompts.
fn server() -> Server {
    Server::start(
        config(|c| {
            c.server.max_body_bytes = 2 << 20;
            c.kv.num_blocks = 256;
        }),
        None,
    )
}

/// POSTs `body` as JSON and reads the answer, never copying the body on
/// this side (the client shares the server's process and its RSS).
fn post_uncopied(addr: std::net::SocketAddr, path: &str, body: &str) -> Resp {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    read_response(s)
}

/// `bodies` posted to `path`s at once; each answer's status.
fn burst(addr: std::net::SocketAddr, bodies: &[(&'static str, String)]) -> Vec<u16> {
    std::thread::scope(|s| {
        let hs: Vec<_> = bodies
            .iter()
            .map(|(path, body)| {
                s.spawn(move || {
                    let r = post_uncopied(addr, path, body);
                    assert!(
                        r.status == 200 || (r.status == 400 && r.body.contains("context length")),
                        "{path}: {} {}",
                        r.status,
                        r.body
                    );
                    r.status
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn eight_concurrent_one_megabyte_bodies_peak_at_five_times_their_size() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let s = server();
    // Warm up: the runtime's threads, the allocator's arenas, the engine.
    let warm: Vec<_> = bodies(64 << 10).into_iter().cycle().take(8).collect();
    burst(s.addr, &warm);
    // Bodies of tool schemas (what a parse holds), of a third text, and
    // of text alone (what the tokenizer holds while it encodes: ~100x a
    // piece of text, not of the prompt). A prompt past the tiny model's
    // context is refused after it is encoded, so those answer 400.
    for text_share in [0.0, 1.0 / 3.0, 1.0] {
        let all = bodies_of(1 << 20, text_share);
        let eight: Vec<_> = all.iter().cycle().take(8).cloned().collect();
        let total: usize = eight.iter().map(|(_, b)| b.len()).sum();
        let statuses = std::cell::Cell::new(Vec::new());
        let mut heap = 0;
        let rise = rss_rise(|| heap = peak_of(|| statuses.set(burst(s.addr, &eight))).0);
        eprintln!(
            "8 bodies, {:.0}% text, {total} B in all: peak RSS +{rise} B, heap +{heap} B",
            text_share * 100.0
        );
        let statuses = statuses.take();
        if text_share == 0.0 {
            assert!(statuses.iter().all(|&c| c == 200), "every request answers");
        }
        assert!(
            rise <= 5 * total,
            "{text_share}: peak RSS rose {rise} B for {total} B of bodies"
        );
        // The heap counts what is allocated, touched or not. A body of text
        // alone holds, per byte of text while it encodes: the parsed text,
        // the template's copy of it, the rendered prompt, and ids (the tiny
        // vocabulary takes 2.5 bytes a token; a real one ~4) in a vector
        // with room to grow. So 6x for text alone, 5x for the rest.
        let heap_bound = if text_share < 1.0 {
            5 * total
        } else {
            6 * total
        };
        assert!(
            heap <= heap_bound,
            "{text_share}: the heap peaked {heap} B above for {total} B of bodies"
        );
    }
}

/// A Responses turn continuing `prev` whose input is `reasoning_bytes` of
/// reasoning (followed by its assistant answer) and a user question.
fn turn(prev: Option<&str>, reasoning_bytes: usize) -> String {
    let mut input = Vec::new();
    if reasoning_bytes > 0 {
        input.push(json!({"type": "reasoning", "summary": [
            {"type": "summary_text", "text": "hmm ".repeat(reasoning_bytes / 4)}]}));
        input.push(json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}]}));
    }
    input.push(json!({"role": "user", "content": "go on"}));
    let mut body =
        json!({"model": MODEL, "max_output_tokens": 2, "temperature": 0, "input": input});
    if let Some(p) = prev {
        body["previous_response_id"] = json!(p);
    }
    body.to_string()
}

#[test]
fn continuations_share_the_stored_chain() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let s = server();
    let post = |body: &str| {
        let r = post_uncopied(s.addr, "/v1/responses", body);
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str::<Value>(&r.body).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    // A 4-turn chain of 3.6 MB, most of it reasoning the template never
    // writes (the tiny model's ChatML template has no reasoning).
    let chain_bytes = 4 * 900_000;
    let mut id: Option<String> = None;
    let rss_before = status_kb("VmRSS:") * 1024;
    let live_before = LIVE.load(Relaxed);
    for _ in 0..4 {
        id = Some(post(&turn(id.as_deref(), 900_000)));
    }
    let kept = (status_kb("VmRSS:") * 1024).saturating_sub(rss_before);
    let held = LIVE.load(Relaxed).saturating_sub(live_before);
    eprintln!("4 stored turns of {chain_bytes} B: RSS +{kept} B, heap +{held} B");
    let fresh: Vec<_> = (0..16).map(|_| ("/v1/responses", turn(None, 0))).collect();
    burst(s.addr, &fresh);
    let (mut fresh_heap, mut cont_heap) = (0, 0);
    let fresh_rise = rss_rise(|| fresh_heap = peak_of(|| burst(s.addr, &fresh)).0);
    let next: Vec<_> = (0..16)
        .map(|_| ("/v1/responses", turn(id.as_deref(), 0)))
        .collect();
    let cont_rise = rss_rise(|| {
        let (peak, statuses) = peak_of(|| burst(s.addr, &next));
        cont_heap = peak;
        assert!(statuses.iter().all(|&c| c == 200));
    });
    eprintln!(
        "16 fresh: RSS +{fresh_rise} B, heap +{fresh_heap} B; \
         16 continuations of the chain: RSS +{cont_rise} B, heap +{cont_heap} B"
    );
    assert!(
        cont_heap <= 2 * fresh_heap + chain_bytes,
        "continuations' heap +{cont_heap} B, fresh +{fresh_heap} B, chain {chain_bytes} B"
    );
    assert!(
        cont_rise <= 2 * fresh_rise + chain_bytes,
        "continuations +{cont_rise} B, fresh +{fresh_rise} B, chain {chain_bytes} B"
    );
    // What the store keeps costs what it counts (each response counts its
    // whole chain: 0.9 + 1.8 + 2.7 + 3.6 MB), within 2x; and each turn is
    // held once: the heap keeps the chain's text and little more.
    let counted = 900_000 * (1 + 2 + 3 + 4);
    assert!(
        kept <= 2 * counted,
        "4 stored responses raised RSS {kept} B"
    );
    assert!(
        held <= chain_bytes * 3 / 2,
        "4 stored responses hold {held} B"
    );
}
