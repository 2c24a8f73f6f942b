#!/usr/bin/env python3
"""Soak test of `specgate serve` (Python 3 stdlib only; scripts/soak.sh builds
the binary and calls this).

Starts the server on a free loopback port with the given config, sends N
requests at concurrency C with random parameters -- mostly streamed, a third
of the clients dropping the connection after a random number of SSE events, a
few non-streamed, a few slow readers, chats with tools, OpenAI Responses and
Anthropic Messages requests (streamed, whole, or dropped), chats run to the
context's end (capped by max_tokens when the decode rate measured under the
load says the rest of the context would not fit in half of the server's
request_timeout_secs), JSON answers spelling markup (never with a tool_choice
that forces a call), and every hostile case at least once
(bad bodies, 560 KB schemas that once took the process down, schemas just
past each grammar bound, n x n tables merged through $ref, more messages than
server.max_messages, a UTF-8 path across the log's route cut, subnormal
sampling numbers, a duplicated logit_bias id, prompt logprobs past the cap) -- then checks:
every request not dropped by its client completed (streams with [DONE]),
hostile bodies got a 4xx with an OpenAI error body (a valid but extreme one
may finish with a 200 instead, or a schema at the bounds a 503 with
Retry-After when the grammar compiler's queue is full), nothing else got a 5xx;
running = waiting = 0 and kv_cache_usage_ratio = 0 on /metrics after a short
settle; /health is 200; a fresh request completes; the log has no panic; the
server exits 0 on SIGTERM. Prints the counts, then `N passed, M failed`, and
exits non-zero on any failure. Traffic goes to 127.0.0.1 only. A request
budget (N) and a wall-clock cap (--max-seconds) make it always stop.
"""

import argparse
import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tomllib

HOST = "127.0.0.1"
PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "hello hello hello hello hello hello",
    "def fib(n):\n    if n < 2:\n        return n\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Count from one to twenty: one, two, three, four, five,",
    "Explain what a TCP handshake is in one sentence.",
    "Translate to French: good morning, my friend.",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "What is 17 times 23?",
    "Write a limerick about a cat who codes.",
    "a b c d e f g h i j k l m n o p",
]
STOPS = ["\n", ".", " the", "!", "```", " and", "fox", "4", "\n\n", ","]
SYSTEM = "You are a terse assistant."
# A few ways to be wrong; each must get a 4xx with an OpenAI error body.
HOSTILE = [
    ("malformed JSON", b'{"model": "M", "messages": [{"role": "user", "content": "hi"'),
    ("not an object", b"[1, 2, 3]"),
    ("wrong type: temperature", '{"model":"M","messages":[{"role":"user","content":"hi"}],"temperature":"hot"}'),
    ("wrong type: messages", '{"model":"M","messages":5}'),
    ("negative max_tokens", '{"model":"M","messages":[{"role":"user","content":"hi"}],"max_tokens":-3}'),
    ("NaN", '{"model":"M","messages":[{"role":"user","content":"hi"}],"top_p":NaN}'),
    ("unknown role", '{"model":"M","messages":[{"role":"wizard","content":"hi"}]}'),
    ("empty messages", '{"model":"M","messages":[]}'),
    ("invalid UTF-8", b'{"model":"M","messages":[{"role":"user","content":"\xff\xfe"}]}'),
    ("top_p out of range", '{"model":"M","prompt":"hi","top_p":7}'),
    ("huge max_tokens", '{"model":"M","messages":[{"role":"user","content":"Say hi."}],"temperature":0,"max_tokens":18446744073709551615}'),
    # Numbers at the edge of float arithmetic: greedy (or a 400), never garbage or a 5xx.
    ("subnormal temperature", '{"model":"M","messages":[{"role":"user","content":"Name a color."}],"temperature":1e-39,"max_tokens":8}'),
    ("subnormal repetition_penalty", '{"model":"M","prompt":"hi","repetition_penalty":1e-39,"max_tokens":8}'),
]
# Valid but extreme: a 200 that finished (capped at the context, or
# greedy) is an allowed answer to these, as is a 4xx.
ACCEPTABLE_200 = {"huge max_tokens", "subnormal temperature", "subnormal repetition_penalty"}
# A UTF-8 character across byte 256 of the path (the log line's cut): a
# 404 with an x-request-id, not a reset connection.
UTF8_PATH = "UTF-8 path across the route cut"


# A JSON answer's value that spells chat markup (K3's markers, Hermes'
# tags): text, never markup, so the answer must come back whole.
SPELLED = "x<|open|>think<|sep|>y<|close|>response<|sep|><tool_call>{}</tool_call>z"
SPELLED_SCHEMA = {
    "type": "object",
    "properties": {"a": {"const": SPELLED}},
    "required": ["a"],
    "additionalProperties": False,
}


def huge_schema(n, counted):
    """n empty properties; `counted`: under minProperties with no other
    properties allowed (an n x n table for a naive compiler)."""
    schema = {"type": "object", "properties": {f"prop_{i:05}": {} for i in range(n)}}
    if counted:
        schema.update(minProperties=1, additionalProperties=False)
    return schema


def huge_schema_bodies():
    """Requests whose grammar once took the process down (a stack overflow,
    a ~9.6 GB table): each must be a 400 within the 1 MiB body limit."""
    wide, square = huge_schema(40_000, False), huge_schema(20_000, True)

    def chat(extra):
        body = {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        return json.dumps({**body, **extra})

    def fmt(schema):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}

    def tools(schema):
        return {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "big", "parameters": schema}}]}

    # Just past each of the grammar bounds (src/grammar/limits.rs): a 400
    # naming the field, before any compile.
    deep = {"type": "integer"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    enum = {"enum": [f"v{i}" for i in range(2_001)]}
    pattern = {"type": "string", "pattern": "^" + "(a|b)" * 200 + "$"}
    return [
        ("40,000-property schema by response_format", chat(fmt(wide))),
        ("n x n schema by response_format", chat(fmt(square))),
        ("40,000-property schema by forced tools", chat(tools(wide))),
        ("n x n schema by forced tools", chat(tools(square))),
        ("n x n schema one past the bound by forced tools", chat(tools(huge_schema(129, True)))),
        ("schema nested past the bound by response_format", chat(fmt(deep))),
        ("enum past the bound by forced tools", chat(tools(enum))),
        ("pattern past the bound by response_format", chat(fmt(pattern))),
        # 64 places that each add minProperties to one 128-property
        # definition through $ref: 64 tables, refused like 64 in place.
        ("n x n tables through $ref past the cells bound by response_format", chat(fmt(ref_tables(64)))),
        # The largest n x n the bounds admit: compiles (a 200) or a 400.
        (SQUARE_AT_BOUND, chat(fmt(huge_schema(128, True)))),
        (SQUARE_AT_BOUND_TOOLS, chat(tools(huge_schema(128, True)))),
    ]


def ref_tables(places):
    """`places` objects each adding minProperties through a $ref to one
    128-property definition."""
    place = {"$ref": "#/$defs/t", "minProperties": 1}
    return {"$defs": {"t": huge_schema(128, False) | {"additionalProperties": False}},
            "type": "object", "properties": {f"a{i}": place for i in range(places)}}


# Valid, and as large as the bounds admit: a 200 or a 4xx, or a 503 with
# Retry-After when the grammar compiler's queue is full.
SQUARE_AT_BOUND = "n x n schema at the bound by response_format"
SQUARE_AT_BOUND_TOOLS = "n x n schema at the bound by forced tools"
ACCEPTABLE_200.update([SQUARE_AT_BOUND, SQUARE_AT_BOUND_TOOLS])
ACCEPTABLE_BUSY = {SQUARE_AT_BOUND, SQUARE_AT_BOUND_TOOLS}
HOSTILE += huge_schema_bodies()
HOSTILE += [
    # Two spellings of one token id.
    ("logit_bias duplicate id", '{"model":"M","messages":[{"role":"user","content":"hi"}],"logit_bias":{"5":1,"05":2},"max_tokens":4}'),
    ("logit_bias out of range", '{"model":"M","prompt":"hi","logit_bias":{"5":1e39},"max_tokens":4}'),
    # Prompt logprobs past scheduler.max_echo_prompt_tokens (2,048 by default).
    ("echo logprobs past the cap", json.dumps({"model": "M", "prompt": "one two three " * 1_000, "echo": True, "logprobs": 1, "max_tokens": 1})),
    ("token-id prompt past the vocabulary", '{"model":"M","prompt":[1,2,4000000000],"max_tokens":4}'),
    # One more message than server.max_messages (2,048 by default): a 400
    # before any template runs (the K3 template is quadratic in tool runs).
    ("more messages than the bound", json.dumps({"model": "M", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"} if i % 2 == 0 else {"role": "assistant", "content": "ok"}
        for i in range(2_049)]})),
]
HOSTILE.append((UTF8_PATH, ""))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- a minimal HTTP/1.1 client over a socket ----


class Conn:
    """One request on its own connection (Connection: close)."""

    def __init__(self, port, method, path, body=b"", key=None, timeout=120.0):
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n"
        if key:
            head += f"Authorization: Bearer {key}\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + body)
        self.f = self.sock.makefile("rb")
        self.status = None
        self.headers = {}

    def read_head(self):
        line = self.f.readline()
        if not line:
            raise ConnectionError("closed before a status line")
        self.status = int(line.split()[1])
        while True:
            line = self.f.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            self.headers[k.strip().lower()] = v.strip()
        return self.status

    def chunks(self):
        """Body pieces as they arrive."""
        if "chunked" in self.headers.get("transfer-encoding", ""):
            while True:
                size_line = self.f.readline()
                if not size_line:
                    raise ConnectionError("closed mid-body")
                n = int(size_line.split(b";")[0].strip(), 16)
                if n == 0:
                    self.f.readline()
                    return
                data = self.f.read(n)
                if len(data) < n:
                    raise ConnectionError("closed mid-chunk")
                self.f.readline()
                yield data
        elif "content-length" in self.headers:
            data = self.f.read(int(self.headers["content-length"]))
            yield data
        else:
            while True:
                data = self.f.read1(65536)
                if not data:
                    return
                yield data

    def body(self):
        return b"".join(self.chunks())

    def events(self):
        """SSE `data:` payloads (str) as they arrive; comments skipped."""
        for _, data in self.named_events():
            yield data

    def named_events(self):
        """(`event:` name or None, `data:` payload) as they arrive; comments
        skipped. An event is at most one `event:` line, then one `data:`."""
        buf = b""
        for piece in self.chunks():
            buf += piece
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                ev = ev.decode("utf-8")
                if ev.startswith(":"):
                    continue
                name = None
                if ev.startswith("event: ") and "\n" in ev:
                    first, ev = ev.split("\n", 1)
                    name = first[7:]
                if not ev.startswith("data: ") or "\n" in ev:
                    raise ValueError(f"bad SSE event {ev[:80]!r}")
                yield name, ev[6:]
        if buf.strip():
            raise ValueError(f"trailing bytes after the last event: {buf[:80]!r}")

    def close(self, reset=False):
        try:
            if reset:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.f.close()
            self.sock.close()
        except OSError:
            pass


def get(port, path, key=None, timeout=10.0):
    c = Conn(port, "GET", path, key=key, timeout=timeout)
    try:
        c.read_head()
        return c.status, c.body()
    finally:
        c.close()


def is_error_body(body):
    try:
        e = json.loads(body)["error"]
        return isinstance(e["message"], str) and isinstance(e["type"], str) and "param" in e and "code" in e
    except (ValueError, KeyError, TypeError):
        return False


# ---- the decode rate, and runs to the context's end sized by it ----


class Pace:
    """What the load has shown so far of the server's decode rate per
    request: finished streams record (tokens, seconds from the first event
    to the end; the usage's count, else the content events, each at least
    one token). Timed under the load itself, so the rate is what a run
    beside that load gets."""

    def __init__(self):
        self.lock = threading.Lock()
        self.samples = []

    def record(self, tokens, seconds):
        if tokens >= 8 and seconds > 0.2:
            with self.lock:
                self.samples.append(tokens / seconds)

    def rate(self, wait, stop):
        """The median rate (tokens/s) once 3 streams have ended, waiting up
        to `wait` seconds (not past `stop`); None without."""
        end = min(time.monotonic() + wait, stop)
        while True:
            with self.lock:
                s = sorted(self.samples)
            if len(s) >= 3:
                return s[len(s) // 2]
            if time.monotonic() > end:
                return None
            time.sleep(0.5)


PACE = Pace()

# Share of server.request_timeout_secs a run to the context's end may take
# decoding (its prefill and its queueing behind the other clients take
# the rest).
TO_END_SHARE = 0.5


def count_prompt(port, key, model, messages):
    c = Conn(port, "POST", "/tokenize", json.dumps({"model": model, "messages": messages}).encode(), key=key, timeout=60)
    try:
        if c.read_head() != 200:
            raise ValueError(f"/tokenize: {c.status} {c.body()[:200]!r}")
        return json.loads(c.body())["count"]
    finally:
        c.close()


def size_to_end(port, key, body, ctx, timeout_s, stop):
    """Sizes a run to the context's end by the server's request timeout:
    the rest of the context is decoded when it fits in TO_END_SHARE of the
    timeout at the rate measured so far (a floor of 1 token/s without a
    measure); past that, max_tokens caps the run at what does fit, so it
    ends with `length` inside the timeout whatever the model, the machine
    or the concurrency. Returns (tokens it may decode, the rate used)."""
    rate = PACE.rate(120, stop) or 1.0
    allowed = max(16, int(rate * timeout_s * TO_END_SHARE))
    left = ctx - count_prompt(port, key, body["model"], body["messages"])
    if left > allowed:
        body["max_tokens"] = allowed
        return allowed, round(rate, 1)
    return left, round(rate, 1)


# ---- the requests ----


def make_plan(rng, n, model, methods):
    """n request specs: kinds, bodies, and when each client misbehaves."""
    # Every hostile case at least once, the rest of the load around them.
    n_hostile = max(len(HOSTILE), n // 40)
    n_slow = max(2, n // 100)
    n_drop = n // 3
    # Issue 49: chats that run to the end of the context (drafting trees
    # beside everyone else), and JSON answers whose value spells markup.
    n_to_end = max(1, n // 150)
    n_spelled = max(1, n // 100)
    # The other wire APIs (Responses, Messages), some with tools.
    n_wire = max(2, n // 12)
    rest = max(0, n - n_hostile - n_slow - n_drop - n_to_end - n_spelled - n_wire)
    n_whole = rest // 8
    kinds = (
        ["hostile"] * n_hostile
        + ["slow"] * n_slow
        + ["drop"] * n_drop
        + ["to_end"] * n_to_end
        + ["spelled"] * n_spelled
        + ["wire"] * n_wire
        + ["whole"] * n_whole
        + ["stream"] * (rest - n_whole)
    )[:n]
    rng.shuffle(kinds)
    plan = []
    hostile_seen = 0
    for i, kind in enumerate(kinds):
        spec = {"id": i, "kind": kind}
        if kind == "hostile":
            name, raw = HOSTILE[hostile_seen % len(HOSTILE)]
            hostile_seen += 1
            raw = raw if isinstance(raw, bytes) else raw.encode()
            if name == UTF8_PATH:
                # Unauthenticated, as a scanner would send it.
                spec.update(name=name, method="GET", path="/" + "a" * 254 + "\u00e9", raw=b"", anonymous=True)
                plan.append(spec)
                continue
            if b'"prompt"' in raw:
                path = "/v1/completions"
            elif b'"messages"' in raw:
                path = "/v1/chat/completions"
            else:
                path = rng.choice(["/v1/chat/completions", "/v1/completions"])
            spec.update(name=name, path=path, raw=raw.replace(b'"M"', json.dumps(model).encode()))
        elif kind == "to_end":
            # No max_tokens: a chat may use the whole context; ignore_eos
            # takes it there.
            spec["path"] = "/v1/chat/completions"
            spec["body"] = random_body(rng, model, True, True, methods)
            del spec["body"]["max_tokens"]
            spec["body"].pop("stop", None)
            spec["body"]["ignore_eos"] = True
            spec["body"]["speculative"] = {"method": rng.choice(methods)}
            # Sized when it runs (see size_to_end); a forced call would
            # end it early.
            spec["body"].pop("tools", None)
            spec["body"].pop("tool_choice", None)
        elif kind == "spelled":
            spec["path"] = "/v1/chat/completions"
            spec["body"] = random_body(rng, model, True, False, methods)
            spec["body"].pop("stop", None)
            # Only valid requests: a schema-bound answer is text, and a
            # tool_choice that forces a call cannot be combined with it (the
            # server rightly refuses that with a 400).
            spec["body"].pop("tools", None)
            spec["body"].pop("tool_choice", None)
            spec["body"]["max_tokens"] = 200
            spec["body"]["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "spelled", "schema": SPELLED_SCHEMA},
            }
        elif kind == "wire":
            spec.update(wire_spec(rng, model))
        else:
            chat = rng.random() < 0.5
            spec["path"] = "/v1/chat/completions" if chat else "/v1/completions"
            spec["body"] = random_body(rng, model, chat, kind != "whole", methods)
            if kind == "drop":
                spec["drop_after"] = rng.randint(0, 12)
                spec["reset"] = rng.random() < 0.5
            if kind == "slow":
                spec["body"]["max_tokens"] = 48
                spec["pauses"] = [round(rng.uniform(1.0, 3.0), 2) for _ in range(rng.randint(1, 3))]
        plan.append(spec)
    return plan


def random_body(rng, model, chat, stream, methods):
    prompt = rng.choice(PROMPTS)
    b = {"model": model, "max_tokens": rng.randint(1, 48), "stream": stream}
    b["temperature"] = 0 if rng.random() < 0.2 else round(rng.uniform(0, 1.5), 3)
    if chat:
        msgs = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": SYSTEM})
        b["messages"] = msgs
    else:
        b["prompt"] = prompt
    if rng.random() < 0.5:
        b["top_p"] = round(rng.uniform(0.3, 1.0), 3)
    if rng.random() < 0.2:
        b["top_k"] = rng.randint(0, 50)
    if rng.random() < 0.3:
        b["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.3:
        b["seed"] = rng.randrange(2**32)
    if stream and rng.random() < 0.5:
        b["stream_options"] = {"include_usage": True}
    if chat and rng.random() < 0.15:
        b["tools"] = [{"type": "function", "function": WEATHER}]
        b["tool_choice"] = rng.choice(["auto", "required", "none"])
        b["max_tokens"] = rng.randint(8, 64)
    r = rng.random()
    if r < 0.3:
        b["speculative"] = {"method": "off"}
    elif r < 0.7:
        b["speculative"] = {"method": rng.choice(methods), "num_tokens": rng.randint(1, 5)}
    return b


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]},
}


def wire_spec(rng, model):
    """A Responses or Messages request: streamed (a third of those dropped
    after a few events) or whole, some with a tool."""
    prompt = rng.choice(PROMPTS)
    stream = rng.random() < 0.7
    tools = rng.random() < 0.3
    if rng.random() < 0.5:
        path = "/v1/responses"
        b = {"model": model, "input": prompt, "max_output_tokens": rng.randint(16, 48),
             "stream": stream, "store": rng.random() < 0.5,
             "temperature": round(rng.uniform(0, 1.5), 3)}
        if rng.random() < 0.3:
            b["instructions"] = SYSTEM
        if tools:
            b["tools"] = [{"type": "function", **WEATHER}]
            b["tool_choice"] = rng.choice(["auto", "required"])
    else:
        path = "/v1/messages"
        b = {"model": model, "max_tokens": rng.randint(1, 48), "stream": stream,
             "messages": [{"role": "user", "content": prompt}],
             "temperature": round(rng.uniform(0, 1), 3)}
        if rng.random() < 0.3:
            b["system"] = SYSTEM
        if rng.random() < 0.3:
            b["stop_sequences"] = rng.sample(STOPS, rng.randint(1, 2))
        if tools:
            b["tools"] = [{"name": WEATHER["name"], "description": WEATHER["description"],
                           "input_schema": WEATHER["parameters"]}]
            b["tool_choice"] = {"type": rng.choice(["auto", "any"])}
    spec = {"path": path, "body": b}
    if stream and rng.random() < 0.33:
        spec["drop_after"] = rng.randint(1, 8)
        spec["reset"] = rng.random() < 0.5
    return spec


def check_wire(conn, path, body, drop_after=None):
    """Reads a Responses or Messages answer; returns "done" or "dropped";
    raises on anything wrong: a stream's events must be named after their
    `type`, in order (Responses: `sequence_number` 0, 1, ...), start and end
    with the API's own events, and carry no error."""
    status = conn.read_head()
    if status != 200:
        raise ValueError(f"status {status}: {conn.body()[:200]!r}")
    responses = path == "/v1/responses"
    if not body.get("stream"):
        v = json.loads(conn.body())
        if responses:
            u = v["usage"]
            if v["status"] not in ("completed", "incomplete"):
                raise ValueError(f"status {v['status']!r}")
            if u["output_tokens"] > body["max_output_tokens"] or \
                    u["total_tokens"] != u["input_tokens"] + u["output_tokens"]:
                raise ValueError(f"usage {u}")
        else:
            if v["type"] != "message" or v["stop_reason"] not in (
                    "end_turn", "max_tokens", "stop_sequence", "tool_use"):
                raise ValueError(f"message {str(v)[:200]}")
            if v["usage"]["output_tokens"] > body["max_tokens"]:
                raise ValueError(f"usage {v['usage']}")
        return "done"
    if "text/event-stream" not in conn.headers.get("content-type", ""):
        raise ValueError(f"content-type {conn.headers.get('content-type')}")
    types = []
    for name, data in conn.named_events():
        ev = json.loads(data)
        t = ev.get("type")
        if name != t or t == "error":
            raise ValueError(f"event {name!r}: {data[:200]}")
        if responses and ev.get("sequence_number") != len(types):
            raise ValueError(f"sequence_number {ev.get('sequence_number')} at event {len(types)}")
        if types and types[-1] in ("response.completed", "response.incomplete", "message_stop"):
            raise ValueError(f"{t} after the end")
        types.append(t)
        if drop_after is not None and len(types) >= drop_after:
            return "dropped"
    first, ends = ("response.created", ("response.completed", "response.incomplete")) if responses \
        else ("message_start", ("message_stop",))
    if not types or types[0] != first or types[-1] not in ends:
        raise ValueError(f"events {types[:3]} ... {types[-3:]}")
    return "done"


def check_stream(conn, body, drop_after=None, pauses=()):
    """Reads a stream. Returns "done", or "dropped" if the client hung up
    after `drop_after` events first; raises on anything wrong."""
    if drop_after == 0:
        return "dropped"
    if conn.read_head() != 200:
        raise ValueError(f"status {conn.status}: {conn.body()[:200]!r}")
    if "text/event-stream" not in conn.headers.get("content-type", ""):
        raise ValueError(f"content-type {conn.headers.get('content-type')}")
    chat = "messages" in body
    text, finish, usage, done, seen = [], None, None, False, 0
    pauses = list(pauses)
    first = None
    for data in conn.events():
        if first is None:
            first = time.monotonic()
        if done:
            raise ValueError("data after [DONE]")
        seen += 1
        if data == "[DONE]":
            done = True
            continue
        ev = json.loads(data)
        if "error" in ev:
            raise ValueError(f"error event: {data[:200]}")
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            piece = ch.get("delta", {}).get("content") if chat else ch.get("text")
            if piece:
                text.append(piece)
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
        if drop_after is not None and seen >= drop_after:
            return "dropped"
        if pauses:
            time.sleep(pauses.pop(0))
    if not done:
        raise ValueError("stream ended without [DONE]")
    check_answer(body, "".join(text), finish, usage)
    if not pauses and first is not None and "pauses" not in body:
        # The usage's count when the stream sent one (a speculative step
        # may put several tokens in one event).
        PACE.record(usage["completion_tokens"] if usage else len(text), time.monotonic() - first)
    return "done"


def check_answer(body, text, finish, usage):
    ends = ("stop", "length", "tool_calls") if body.get("tools") else ("stop", "length")
    if finish not in ends:
        raise ValueError(f"finish_reason {finish!r}")
    for s in body.get("stop") or []:
        if s in text:
            raise ValueError(f"stop string {s!r} in the output {text[:100]!r}")
    if usage is not None:
        if "max_tokens" in body and usage["completion_tokens"] > body["max_tokens"]:
            raise ValueError(f"{usage['completion_tokens']} tokens > max_tokens {body['max_tokens']}")
        if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
            raise ValueError(f"usage does not add up: {usage}")


def run_one(port, key, spec, timeout, deadline, limits=None):
    """Runs one spec; returns (spec, outcome, detail). `limits` (the
    context length and the server's request timeout) size a run to the
    context's end."""
    if time.monotonic() > deadline:
        return spec, "skipped", "past the wall-clock cap"
    kind = spec["kind"]
    if kind == "to_end" and limits:
        try:
            spec["left"] = size_to_end(port, key, spec["body"], *limits, deadline)
        except (OSError, ValueError, KeyError) as e:
            return spec, "fail", f"sizing the run to the context's end: {type(e).__name__}: {e}"
    raw = spec["raw"] if "raw" in spec else json.dumps(spec["body"]).encode()
    conn = None
    try:
        method = spec.get("method", "POST")
        conn = Conn(port, method, spec["path"], raw, key=None if spec.get("anonymous") else key, timeout=timeout)
        if kind == "hostile":
            status = conn.read_head()
            body = conn.body()
            if spec["name"] == UTF8_PATH:
                if status == 404 and is_error_body(body) and conn.headers.get("x-request-id"):
                    return spec, "rejected", status
                return spec, "fail", f"hostile {spec['name']!r}: {status} {conn.headers} {body[:200]!r}"
            if 400 <= status < 500 and is_error_body(body):
                return spec, "rejected", status
            if spec["name"] in ACCEPTABLE_BUSY and status == 503 and is_error_body(body) \
                    and conn.headers.get("retry-after"):
                return spec, "rejected", status
            if spec["name"] in ACCEPTABLE_200 and status == 200:
                v = json.loads(body)
                check_answer({}, "", v["choices"][0]["finish_reason"], v["usage"])
                return spec, "capped", status
            return spec, "fail", f"hostile {spec['name']!r}: {status} {body[:200]!r}"
        if kind == "spelled":
            status = conn.read_head()
            body = conn.body()
            if status != 200:
                return spec, "fail", f"{status} {body[:200]!r}"
            ch = json.loads(body)["choices"][0]
            content = ch["message"]["content"] or ""
            if ch["finish_reason"] == "stop" and json.loads(content) != {"a": SPELLED}:
                return spec, "fail", f"spelled markup was parsed: {ch['message']}"
            return spec, "done", 200
        if kind == "wire":
            return spec, check_wire(conn, spec["path"], spec["body"], spec.get("drop_after")), None
        if kind == "whole":
            status = conn.read_head()
            body = conn.body()
            if status != 200:
                return spec, "fail", f"{status} {body[:200]!r}"
            v = json.loads(body)
            ch = v["choices"][0]
            # A reasoning model's turn may be all reasoning: content null
            # (stop strings apply to content only).
            text = (ch["message"]["content"] or "") if "messages" in spec["body"] else ch["text"]
            check_answer(spec["body"], text, ch["finish_reason"], v["usage"])
            return spec, "done", 200
        out = check_stream(conn, spec["body"], spec.get("drop_after"), spec.get("pauses", ()))
        return spec, out, None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        status = conn.status if conn else None
        return spec, "fail", f"{type(e).__name__}: {e} (status {status})"
    finally:
        if conn:
            conn.close(reset=spec.get("reset", False))


# ---- the server ----


def metric(text, name):
    """Sum of a metric's samples, or None when absent."""
    vals = [
        float(m.group(2))
        for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    ]
    return sum(vals) if vals else None


def start_server(binary, config, logf):
    proc = subprocess.Popen(
        [binary, "serve", "--config", config, "--host", HOST, "--port", "0"],
        stdout=logf,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc


def wait_ready(proc, log_path, timeout):
    """The port, once /health answers 200; None if the server died or never got ready."""
    end = time.monotonic() + timeout
    port = None
    while time.monotonic() < end:
        if proc.poll() is not None:
            return None
        if port is None:
            with open(log_path, errors="replace") as f:
                m = re.search(r"http://127\.0\.0\.1:(\d+)", f.read())
            port = int(m.group(1)) if m else None
        if port is not None:
            try:
                if get(port, "/health", timeout=5)[0] == 200:
                    return port
            except OSError:
                pass
        time.sleep(0.2)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=300, help="requests in all (default 300)")
    ap.add_argument("-c", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--binary", default="target/release/specgate")
    ap.add_argument("--max-seconds", type=float, default=900, help="wall-clock cap on the load (default 900)")
    ap.add_argument("--read-timeout", type=float, default=120, help="client socket timeout (default 120 s)")
    ap.add_argument("--ready-timeout", type=float, default=600, help="model load limit (default 600 s)")
    ap.add_argument("--settle-seconds", type=float, default=30)
    ap.add_argument("--log", help="server log file (default: a temporary file)")
    ap.add_argument("--through-router", action="store_true",
                    help="send the load through `specgate route` in front of the server "
                         "(the gauges and /health are still read from the server)")
    args = ap.parse_args()

    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    server = cfg.get("server", {})
    # The server's own default (src/config.rs).
    args.request_timeout = server.get("request_timeout_secs", 600)
    key = (server.get("api_keys") or [None])[0]
    method = cfg.get("speculative", {}).get("method", "draft")
    methods = ["ngram", "draft"] if method == "draft" else ["ngram"]
    model_path = cfg.get("model", {}).get("path", "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    if not os.path.exists(model_path):
        log(f"soak: {model_path} is missing; run scripts/fetch-models.sh first")
        return 2

    log_path = args.log or tempfile.mkstemp(prefix="specgate-soak-", suffix=".log")[1]
    checks = []

    def check(name, ok, detail=""):
        checks.append((name, bool(ok)))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + str(detail) if detail else ''}", flush=True)

    print(f"soak: {args.binary} serve --config {args.config} (log {log_path})", flush=True)
    with open(log_path, "wb") as logf:
        proc = start_server(args.binary, args.config, logf)
    try:
        soak(args, proc, log_path, key, methods, check)
    except BaseException as e:  # a driver bug or Ctrl-C must still stop the server
        check("the soak driver ran to the end", False, f"{type(e).__name__}: {e}")
    router = getattr(args, "router_proc", None)
    if router is not None and router.poll() is None:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(router.pid, signal.SIGKILL)
    return finish(checks, proc, log_path)


def soak(args, proc, log_path, key, methods, check):
    t0 = time.monotonic()
    port = wait_ready(proc, log_path, args.ready_timeout)
    check("server started and /health is 200", port, f"{time.monotonic() - t0:.1f}s")
    if port is None:
        return
    status, body = get(port, "/v1/models", key=key)
    card = json.loads(body)["data"][0]
    model = card["id"]
    limits = (card["max_model_len"], args.request_timeout)
    server_port, router = port, None
    if args.through_router:
        rlog = log_path + ".router"
        with open(rlog, "wb") as rf:
            router = subprocess.Popen(
                [args.binary, "route", "--host", HOST, "--port", "0",
                 "--replica", f"http://{HOST}:{port}"],
                stdout=rf, stderr=subprocess.STDOUT, start_new_session=True)
        args.router_proc = router
        port = wait_ready(router, rlog, 60)
        check("router started and /health is 200", port, f"log {rlog}")
        if port is None:
            return

    rng = random.Random(args.seed)
    plan = make_plan(rng, args.n, model, methods)
    t1 = time.monotonic()
    deadline = t1 + args.max_seconds
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.c) as pool:
        futs = [pool.submit(run_one, port, key, s, args.read_timeout, deadline, limits) for s in plan]
        for fut in concurrent.futures.as_completed(futs):
            results.append(fut.result())
    elapsed = time.monotonic() - t1

    def count(kind, out):
        return sum(1 for s, o, _ in results if (kind is None or s["kind"] == kind) and o == out)

    fails = [(s, d) for s, o, d in results if o == "fail"]
    for s, d in fails[:20]:
        print(f"    request {s['id']} ({s['kind']} {s['path']}): {d}", flush=True)
    if len(fails) > 20:
        print(f"    ... and {len(fails) - 20} more", flush=True)
    summary = (
        f"soak: {len(plan)} requests at concurrency {args.c} (seed {args.seed}) in {elapsed:.1f}s: "
        f"{count('stream', 'done')} streamed done, "
        f"{count('drop', 'dropped')} dropped by their client ({count('drop', 'done')} finished first), "
        f"{count('whole', 'done')} whole done, {count('slow', 'done')} slow readers done, "
        f"{count('to_end', 'done')} run to the context's end "
        f"(tokens each might decode, tokens/s: {[s.get('left') for s, _, _ in results if s['kind'] == 'to_end']}), "
        f"{count('spelled', 'done')} spelled-markup answers, "
        f"{count('wire', 'done')} Responses/Messages done ({count('wire', 'dropped')} dropped), "
        f"{count('hostile', 'rejected')} hostile rejected with a 4xx, {count('hostile', 'capped')} extreme but valid done, "
        f"{len(fails)} failed, {count(None, 'skipped')} skipped"
    )
    for kind, what in [
        ("stream", "every streamed request ended with [DONE]"),
        ("drop", "every dropping client that read to the end saw [DONE]"),
        ("whole", "every non-streamed request completed"),
        ("to_end", "every chat run to the context's end ended with [DONE]"),
        ("spelled", "every JSON answer spelling markup came back whole as content"),
        ("wire", "every Responses and Messages answer was whole and in order"),
        ("slow", "every slow reader ended with [DONE]"),
        ("hostile", "every hostile body got a 4xx with an OpenAI error body"),
    ]:
        bad = [d for s, o, d in results if s["kind"] == kind and o == "fail"]
        check(what, not bad, bad[0] if bad else "")
    fivexx = [d for s, o, d in results if o == "fail" and re.search(r"\b5\d\d\b", str(d))]
    check("no 5xx answers", not fivexx, fivexx[0] if fivexx else "")
    check("the load ended within the wall-clock cap", count(None, "skipped") == 0, f"{elapsed:.1f}s")

    # Settle: the gauges come back to idle once the engine has noticed
    # every hang-up.
    end = time.monotonic() + args.settle_seconds
    while True:
        try:
            text = get(server_port, "/metrics", timeout=10)[1].decode()
        except OSError as e:
            text = ""
            log(f"soak: /metrics: {e}")
        vals = {
            n: metric(text, f"specgate_{n}")
            for n in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio"]
        }
        if all(v == 0 for v in vals.values()) or time.monotonic() > end:
            break
        time.sleep(0.5)
    for n, v in vals.items():
        check(f"specgate_{n} back to 0", v == 0, v)
    try:
        health = get(server_port, "/health")[0]
    except OSError as e:
        health = e
    check("/health is 200 afterwards", health == 200, health)
    fresh = {
        "id": "fresh",
        "kind": "stream",
        "path": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "stream": True,
        },
    }
    _, out, detail = run_one(port, key, fresh, args.read_timeout, time.monotonic() + 60)
    check("a fresh request completes", out == "done", detail)
    print(summary, flush=True)


def finish(checks, proc, log_path):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = "still running 60 s after SIGTERM (killed)"
        checks.append(("server exits 0 on SIGTERM", code == 0))
        print(f"  [{'ok' if code == 0 else 'FAIL'}] server exits 0 on SIGTERM: {code}", flush=True)
    else:
        checks.append(("server still running at the end", False))
        print(f"  [FAIL] server exited early with {proc.returncode}", flush=True)
    with open(log_path, errors="replace") as f:
        text = f.read()
    panics = [l for l in text.splitlines() if "panicked" in l]
    checks.append(("no panic in the server log", not panics))
    print(f"  [{'FAIL' if panics else 'ok'}] no panic in the server log{': ' + panics[0] if panics else ''}", flush=True)
    failed = [n for n, ok in checks if not ok]
    if failed:
        print(f"soak: server log tail ({log_path}):", flush=True)
        for l in text.splitlines()[-15:]:
            print(f"    {l}", flush=True)
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
