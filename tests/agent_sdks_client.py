"""Real-client test of the two agent APIs: the official `openai` package's
`responses.create` (OpenAI's Responses API), the official `anthropic`
package's `messages.create` / `messages.stream` / `count_tokens`, and the
OpenAI Agents SDK (`openai-agents`) running one agent with one function tool
to the end. Run by scripts/test-openai.sh against `specgate serve` (the real
Qwen pair, and the tiny Kimi K3 with SPECGATE_RANDOM_WEIGHTS=1, where only
the API's mechanics are checked)."""
import json
import os
import sys
import traceback

import anthropic
import openai

URL = os.environ["SPECGATE_URL"]  # ends in /v1
MODEL = os.environ.get("SPECGATE_MODEL", "qwen2.5-coder-1.5b-instruct")
RANDOM = os.environ.get("SPECGATE_RANDOM_WEIGHTS") == "1"
K3 = MODEL.startswith("kimi-k3")
oai = openai.OpenAI(base_url=URL, api_key="unused")
ant = anthropic.Anthropic(base_url=URL[: -len("/v1")], api_key="unused")
TOOL_TOKENS = 200 if RANDOM else 60
# Random weights may think forever before a forced call: constrained checks
# on K3 run with thinking off.
NO_THINK_R = {"reasoning": {"effort": "none"}} if K3 else {}
NO_THINK_A = {"thinking": {"type": "disabled"}} if K3 else {}

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 32}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = "What is the weather like in Paris right now?"
# The `anthropic` SDK no longer takes sampling arguments; the server still
# honours Anthropic's `temperature`, sent as a body field.
GREEDY = {"temperature": 0}


def chat_text(max_tokens=24):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                    max_tokens=max_tokens, temperature=0)
    m = r.choices[0].message
    return (m.model_extra or {}).get("reasoning_content") or "", m.content or "", r.usage


# ---- Responses ----

def reasoning_of(resp):
    return "".join(c.text for item in resp.output if item.type == "reasoning" for c in (item.content or []))


def test_responses_text_matches_chat():
    reasoning, content, usage = chat_text()
    r = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    assert r.output_text == content, (r.output_text, content)
    assert reasoning_of(r) == reasoning, (reasoning_of(r), reasoning)
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    if K3 and reasoning:
        assert r.output[0].type == "reasoning", r.output
        assert r.usage.output_tokens_details.reasoning_tokens > 0, r.usage
    assert r.status in ("completed", "incomplete"), r.status


def test_responses_stream():
    whole = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    text, seqs, final = "", [], None
    for ev in oai.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0, stream=True):
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert seqs == list(range(len(seqs))), seqs
    assert text == whole.output_text and final is not None and final.output_text == text


def test_responses_json_schema():
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="Invent a person. Answer in JSON.", temperature=0,
                             max_output_tokens=TOOL_TOKENS, **NO_THINK_R,
                             text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                              "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person


def test_responses_function_call_round_trip_and_continuation():
    tools = [{"type": "function", "name": "get_weather", "description": "Get the weather in a city.",
              "parameters": WEATHER_SCHEMA, "strict": True}]
    r = oai.responses.create(model=MODEL, input=ASK, tools=tools, tool_choice="required", temperature=0,
                             max_output_tokens=TOOL_TOKENS, **NO_THINK_R)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.output
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}
    # Fed back whole...
    r2 = oai.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, *r.output, out],
                              tools=tools, temperature=0, max_output_tokens=40, store=False)
    # ... and by id: the same conversation, the same answer.
    r3 = oai.responses.create(model=MODEL, previous_response_id=r.id, input=[out], tools=tools,
                              temperature=0, max_output_tokens=40)
    assert r2.output_text == r3.output_text and r2.usage.input_tokens == r3.usage.input_tokens, (r2, r3)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output[0].type == r.output[0].type
    oai.responses.delete(r3.id)
    try:
        oai.responses.retrieve(r3.id)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("deleted response still readable")


def test_responses_errors():
    try:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown")
    except openai.NotFoundError as e:
        assert e.body.get("param") == "previous_response_id", e.body
    else:
        raise AssertionError("no NotFoundError")
    try:
        oai.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "x"}])
    except openai.BadRequestError as e:
        assert e.body.get("param") == "input[0].type", e.body
    else:
        raise AssertionError("no BadRequestError")


def test_agents_sdk_runs_an_agent_with_a_tool():
    if RANDOM:
        return  # an agent loop needs a model that stops calling
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return json.dumps({"city": city, "temperature": 21, "unit": "celsius"})

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=URL, api_key="unused"))
    agent = Agent(name="weather", instructions="Use the get_weather tool to answer, then answer briefly.",
                  tools=[get_weather], model=model,
                  # The first turn must call the tool; the SDK then resets
                  # the choice to auto, so the model answers.
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80))
    result = Runner.run_sync(agent, ASK, max_turns=4)
    assert seen, "the tool was never called"
    assert isinstance(result.final_output, str) and result.final_output, result


# ---- Anthropic Messages ----

def test_messages_text_matches_chat():
    reasoning, content, usage = chat_text()
    m = ant.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": ASK}])
    text = "".join(b.text for b in m.content if b.type == "text")
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    assert text == content and thinking == reasoning, (m.content, content, reasoning)
    assert m.usage.input_tokens == usage.prompt_tokens and m.usage.output_tokens == usage.completion_tokens
    assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason


def test_messages_stream_matches_create():
    m = ant.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": ASK}])
    with ant.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY,
                             messages=[{"role": "user", "content": ASK}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in m.content if b.type == "text"), text
    assert [b.type for b in final.content] == [b.type for b in m.content], final.content
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_messages_tool_use_round_trip():
    tools = [{"name": "get_weather", "description": "Get the weather in a city.", "input_schema": WEATHER_SCHEMA}]
    ask = [{"role": "user", "content": ASK}]
    m = ant.messages.create(model=MODEL, max_tokens=TOOL_TOKENS, extra_body=GREEDY, tools=tools,
                            tool_choice={"type": "any"}, messages=ask, **NO_THINK_A)
    assert m.stop_reason == "tool_use", m
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input["city"], str), use
    with ant.messages.stream(model=MODEL, max_tokens=TOOL_TOKENS, extra_body=GREEDY, tools=tools,
                             tool_choice={"type": "tool", "name": "get_weather"}, messages=ask, **NO_THINK_A) as s:
        final = s.get_final_message()
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert streamed.input == use.input, (streamed, use)
    back = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": '{"temperature": 21}'}]}]
    r = ant.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=tools, messages=back)
    assert r.content is not None and r.stop_reason in ("end_turn", "max_tokens", "tool_use"), r


def test_messages_thinking_on_k3():
    if not K3:
        try:
            ant.messages.create(model=MODEL, max_tokens=2048, messages=[{"role": "user", "content": ASK}],
                                thinking={"type": "enabled", "budget_tokens": 1024})
        except anthropic.BadRequestError as e:
            assert "thinking" in str(e), e
        else:
            raise AssertionError("a model without thinking took thinking")
        return
    m = ant.messages.create(model=MODEL, max_tokens=2048, extra_body=GREEDY, messages=[{"role": "user", "content": ASK}],
                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content and m.content[0].type == "thinking", m.content
    off = ant.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": ASK}],
                              thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in off.content), off.content


def test_messages_count_tokens_and_errors():
    msgs = [{"role": "user", "content": ASK}]
    n = ant.messages.count_tokens(model=MODEL, messages=msgs)
    m = ant.messages.create(model=MODEL, max_tokens=2, messages=msgs)
    assert n.input_tokens == m.usage.input_tokens, (n, m.usage)
    try:
        ant.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error" and "tool_use_id" in e.body["error"]["message"], e.body
    else:
        raise AssertionError("no BadRequestError")
    try:
        ant.messages.create(model="no-such-model", max_tokens=4, messages=msgs)
    except anthropic.NotFoundError:
        pass
    else:
        raise AssertionError("no NotFoundError")


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
