"""Real-client test: the official `openai` package against `specgate serve`
on the real Qwen2.5-Coder pair, and once more on the tiny Kimi K3 config.
Run by scripts/test-openai.sh, which starts the server and sets SPECGATE_URL
(and SPECGATE_MODEL, SPECGATE_RANDOM_WEIGHTS=1 for a model whose text means
nothing: checks that need a sensible answer are skipped there, checks of
the API's mechanics all run)."""
import json
import os
import sys
import traceback

import openai

client = openai.OpenAI(base_url=os.environ["SPECGATE_URL"], api_key="unused")
MODEL = os.environ.get("SPECGATE_MODEL", "qwen2.5-coder-1.5b-instruct")
RANDOM = os.environ.get("SPECGATE_RANDOM_WEIGHTS") == "1"
# Kimi K3 thinks by default: its text is `reasoning_content` (an extra field
# the SDK keeps in `model_extra`), its call ids `functions.NAME:IDX`.
K3 = MODEL.startswith("kimi-k3")


# Random weights may think forever before a forced call or JSON answer:
# K3's constrained checks run with thinking off.
FORCED = {"extra_body": {"chat_template_kwargs": {"thinking": False}}} if K3 else {}


def text_of(message):
    """A turn's text: its reasoning (K3, an extra field) then its content."""
    extra = message.model_extra or {}
    return (extra.get("reasoning_content") or "") + (message.content or "")


def delta_text(delta):
    extra = delta.model_extra or {}
    return (extra.get("reasoning_content") or "") + (delta.content or "")
# Random weights fill a grammar's strings to their maxLength with rare
# multi-byte characters before the grammar closes them: more room.
TOOL_TOKENS = 200 if RANDOM else 60
# Random weights decide how many parallel calls a forced turn makes by
# noise; one call keeps the protocol checks below about the protocol.
ONE_CALL = {"parallel_tool_calls": False} if RANDOM else {}
MSG = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def test_models():
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL], ids


def test_chat_whole():
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and text_of(c.message), r
    if K3:
        # Thinking on: the text is reasoning, read from the extra field.
        assert c.message.model_extra.get("reasoning_content"), c.message
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    return text_of(c.message)


def test_chat_stream_matches_whole():
    whole = test_chat_whole()
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += delta_text(ch.delta)
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert text == whole, (text, whole)
    assert usage is not None and usage.completion_tokens > 0, usage
    assert len(reasons) == 1, reasons


def test_completion_and_stop():
    r = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = r.choices[0].text
    # A stop string from the answer itself: "return" for a real coder model,
    # a piece of the middle for random weights.
    stop = "return" if not RANDOM else text[len(text) // 2:len(text) // 2 + 2]
    assert stop and stop in text, (stop, text)
    r = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=24, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert stop not in r.choices[0].text and r.choices[0].finish_reason == "stop", r
    assert text.startswith(r.choices[0].text)


def test_errors_are_sdk_exceptions():
    try:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10**6)
    except openai.BadRequestError as e:
        assert "context length" in str(e), e
    else:
        raise AssertionError("no BadRequestError")
    try:
        client.chat.completions.create(model="no-such-model", messages=MSG, max_tokens=4)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("no NotFoundError")


def test_speculative_override():
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0,
                                       extra_body={"speculative": {"method": "ngram", "num_tokens": 4}})
    assert text_of(r.choices[0].message)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def check_weather_call(call):
    prefix = "functions.get_weather:" if K3 else "call_"
    assert call.type == "function" and call.id.startswith(prefix), call
    assert call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str) and set(args) <= {"city", "unit"}, args
    assert args.get("unit", "celsius") in ("celsius", "fahrenheit"), args
    return args


def test_tool_round_trip():
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       max_tokens=TOOL_TOKENS, temperature=0, **ONE_CALL, **FORCED)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls, c.message
    call = c.message.tool_calls[0]
    check_weather_call(call)
    # Send the result back, as an agent does, and get the final answer.
    messages = ASK + [c.message, {"role": "tool", "tool_call_id": call.id,
                                  "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40,
                                       temperature=0)
    final = r.choices[0]
    assert text_of(final.message) and final.finish_reason in ("stop", "length"), final
    assert not final.message.tool_calls, final.message


def test_named_tool_choice():
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=TOOL_TOKENS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False, **FORCED)
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1, r
    check_weather_call(calls[0])


def test_streamed_tool_call_deltas():
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=TOOL_TOKENS, temperature=0, stream=True, **ONE_CALL,
                                            **FORCED)
    calls, reasons = {}, []
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or d.id
                if d.function and d.function.name:
                    entry["name"] = d.function.name
                if d.function and d.function.arguments:
                    entry["arguments"] += d.function.arguments
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["tool_calls"], reasons
    prefix = "functions.get_weather:" if K3 else "call_"
    assert calls and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith(prefix), calls
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str), calls


def test_logprobs():
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.content) == r.usage.completion_tokens, lp
    for e in lp.content:
        assert e.logprob <= 0 and isinstance(e.token, str) and e.bytes is not None, e
        assert len(e.top_logprobs) == 3, e
        # Greedy: the chosen token is the most likely one.
        assert e.top_logprobs[0].logprob == e.logprob, e
    r = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=6, temperature=0,
                                  logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith("def add(a, b):\n"), c.text
    assert c.logprobs.token_logprobs[0] is None, c.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(c.logprobs.tokens) == len(c.logprobs.text_offset) == n, c.logprobs


def test_response_format_json_schema():
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, max_tokens=TOOL_TOKENS, temperature=0, **FORCED,
        messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    person = json.loads(c.message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person


def test_unknown_fields_are_refused():
    try:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, extra_body={"frobnicate": 1})
    except openai.BadRequestError as e:
        assert e.body and e.body.get("param") == "frobnicate", e.body
    else:
        raise AssertionError("no BadRequestError")


if __name__ == "__main__":
    passed = failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                passed += 1
                print(f"ok   {name}")
            except Exception:
                failed += 1
                print(f"FAIL {name}")
                traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
