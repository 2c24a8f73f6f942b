"""Real-client test: the official `openai` package against `specgate serve`
on the real Qwen2.5-Coder pair. Run by scripts/test-openai.sh, which starts
the server and sets SPECGATE_URL."""
import os
import sys
import traceback

import openai

client = openai.OpenAI(base_url=os.environ["SPECGATE_URL"], api_key="unused")
MODEL = "qwen2.5-coder-1.5b-instruct"
MSG = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def test_models():
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL], ids


def test_chat_whole():
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content, r
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    return c.message.content


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
            text += ch.delta.content or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert text == whole, (text, whole)
    assert usage is not None and usage.completion_tokens > 0, usage
    assert len(reasons) == 1, reasons


def test_completion_and_stop():
    r = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=24, temperature=0)
    text = r.choices[0].text
    assert "return" in text, text
    r = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=24, temperature=0,
                                  stop=["return"])
    assert "return" not in r.choices[0].text and r.choices[0].finish_reason == "stop", r
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
    assert r.choices[0].message.content


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
