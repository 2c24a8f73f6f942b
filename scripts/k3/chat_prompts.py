#!/usr/bin/env python3
"""Reference chat prompts for the tiny K3: the tiny-hf chat template (llama.cpp's
Kimi-K3.jinja) rendered by jinja2 the way `transformers.apply_chat_template` renders it
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a `tojson` taking
`ensure_ascii`), then tokenized by tiktoken built as Kimi's tokenization_kimi.py builds it
(special-token text in the rendered template becomes the special ids).

The history's call arguments are written with their keys in sorted order: the server
parses `arguments` into a JSON map that keeps keys sorted (serde_json without
`preserve_order`), where transformers keeps the client's order.

Each case is what a client sends to `/tokenize`'s chat form (`messages` plus
`chat_template_kwargs` / `reasoning_effort`) and the template variables that stands for;
tests/kimi_k3_protocol.rs checks the server's ids equal these.

Writes tests/fixtures/kimi_k3/chat-prompts.json: {"cases": [{"name", "request", "ids"}]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jinja2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_vectors import FIX, make_encoding  # noqa: E402

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather",
                                  "arguments": "{\"at\": null, \"city\": \"Paris\", \"days\": 2, \"metric\": true, \"tags\": [\"a\"]}"}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21C"},
    {"role": "assistant", "content": "Sunny, 21C.", "reasoning": "Report it."},
    {"role": "user", "content": "thanks"},
]

# (name, request fields besides messages, template variables they stand for)
CASES = [
    ("plain", {}, {}),
    ("thinking_off", {"chat_template_kwargs": {"thinking": False}}, {"thinking": False}),
    ("effort_low", {"reasoning_effort": "low"}, {"thinking_effort": "low"}),
    ("effort_high_kwargs", {"chat_template_kwargs": {"thinking_effort": "high"}}, {"thinking_effort": "high"}),
    ("history", {"messages": HISTORY}, {}),
    ("history_thinking_off", {"messages": HISTORY, "chat_template_kwargs": {"thinking": False}},
     {"thinking": False}),
]


def template_messages(msgs):
    """Messages as the server hands them to the template: tool call arguments parsed."""
    out = []
    for m in msgs:
        m = dict(m)
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
        if "tool_calls" in m:
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def render(source, messages, variables):
    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, add_generation_prompt=True,
                                          bos_token="[BOS]", eos_token="[EOS]", **variables)


def main():
    hf = FIX / "tiny-hf"
    source = json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    enc = make_encoding(hf)
    cases = []
    for name, request, variables in CASES:
        msgs = request.get("messages", [{"role": "user", "content": "hi"}])
        text = render(source, template_messages(msgs), variables)
        ids = enc.encode(text, allowed_special="all")
        req = dict(request, messages=msgs)
        cases.append({"name": name, "request": req, "ids": ids})
    with open(FIX / "chat-prompts.json", "w") as f:
        json.dump({"script": "scripts/k3/chat_prompts.py", "cases": cases}, f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
