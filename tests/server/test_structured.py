"""Structured output of `tessera serve` through OpenAI's official Python client (issue 34), on the real SmolLM2-135M:
response_format json_object and json_schema (chat and completions: every reply parses and validates against its
schema), tools with tool_choice "required" and a named function (the reply's tool_calls parse with the client's
tool-call types and their arguments validate against the function's parameters), "auto", streaming with both, and
the 400s of a schema XGrammar cannot compile. Two servers: the single-sequence engine (--parallel 1) and the batched
engine (--parallel 2), whose rows take the grammar's mask as logit edits (runtime/sampling.h). With
TESSERA_DEVICE=cuda the same script runs the GPU engines (scripts/gpu).
"""
import json

import openai

from harness import MODEL_ID, Server, cli_answer, run, test

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time in a time zone",
                 "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                                "required": ["zone"]}},
}


def validate(value, schema, path="$"):
    """The JSON Schema subset these tests use (type, properties, required, additionalProperties, enum, const,
    items, maxItems, maxLength, minimum, maximum); raises AssertionError naming the path."""
    t = schema.get("type")
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool}
    if t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (path, value)
    elif t is not None:
        assert isinstance(value, kinds[t]), (path, t, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if "const" in schema:
        assert value == schema["const"], (path, value)
    if "minimum" in schema:
        assert value >= schema["minimum"], (path, value)
    if "maximum" in schema:
        assert value <= schema["maximum"], (path, value)
    if "maxLength" in schema:
        assert len(value) <= schema["maxLength"], (path, value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, (path, "missing", key, value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (path, "extra keys", value)
        for key, sub in props.items():
            if key in value:
                validate(value[key], sub, f"{path}.{key}")
    if isinstance(value, list):
        if "maxItems" in schema:
            assert len(value) <= schema["maxItems"], (path, value)
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")


class Servers:
    def __init__(self):
        self.servers = {"single": Server("--parallel", "1"), "batched": Server("--parallel", "2")}
        self.clients = {name: openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
                        for name, srv in self.servers.items()}

    def each(self):
        return self.clients.items()

    def stop(self):
        for srv in self.servers.values():
            srv.stop()


def setup():
    return Servers()


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}], **kw)


CAT = [{"role": "system", "content": "You answer in JSON."},
       {"role": "user", "content": "Give the name and color of a cat as a JSON object with the keys name and color."}]


@test
def json_object(s):
    # Any JSON object: nothing bounds its strings, so the prompt asks for a short one (a 135M model asked only to
    # "describe a cat as JSON" writes prose inside a key until max_tokens).
    for name, c in s.each():
        for temperature, seed in ((0, 0), (0.8, 1), (0.8, 2), (0.8, 3)):
            r = c.chat.completions.create(model=MODEL_ID, messages=CAT, response_format={"type": "json_object"},
                                          max_tokens=120, temperature=temperature, seed=seed)
            ch = r.choices[0]
            assert ch.finish_reason == "stop", (name, ch.finish_reason, ch.message.content)
            value = json.loads(ch.message.content)
            assert isinstance(value, dict), (name, ch.message.content)
        # without response_format the same greedy request is not a JSON object
        r = c.chat.completions.create(model=MODEL_ID, messages=CAT, max_tokens=120, temperature=0)
        try:
            plain = json.loads(r.choices[0].message.content)
        except json.JSONDecodeError:
            plain = None
        assert not isinstance(plain, dict), (name, r.choices[0].message.content)
        # completions take response_format too
        r = c.completions.create(model=MODEL_ID, prompt=CAT[1]["content"] + "\n", max_tokens=120, temperature=0,
                                 extra_body={"response_format": {"type": "json_object"}})
        assert r.choices[0].finish_reason == "stop", (name, r.choices[0].text)
        assert isinstance(json.loads(r.choices[0].text), dict), (name, r.choices[0].text)


@test
def json_schema_replies_validate(s):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for name, c in s.each():
        # greedy and sampled, several seeds and n > 1: every reply parses and validates
        r = chat(c, "Invent a person.", response_format=fmt, max_tokens=200, temperature=0)
        replies = [r.choices[0]]
        r = chat(c, "Invent a person who likes music.", response_format=fmt, max_tokens=200, temperature=1.0,
                 seed=11, n=4)
        replies += r.choices
        for ch in replies:
            assert ch.finish_reason == "stop", (name, ch.finish_reason, ch.message.content)
            validate(json.loads(ch.message.content), PERSON)


@test
def tool_choice_required_and_named(s):
    for name, c in s.each():
        r = chat(c, "What is the weather like in Paris?", tools=[WEATHER, TIME], tool_choice="required",
                 max_tokens=120, temperature=0)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (name, ch)
        assert ch.message.content is None and len(ch.message.tool_calls) == 1, (name, ch.message)
        call = ch.message.tool_calls[0]
        assert isinstance(call, openai.types.chat.ChatCompletionMessageToolCall), type(call)
        assert call.type == "function" and call.id.startswith("call_"), call
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        # a named function: that one, whatever the question
        r = chat(c, "What is the weather like in Paris?", tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=120, temperature=0.7,
                 seed=3)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time", (name, r.choices[0])
        validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
        # "none": the tools are not shown and the answer is text
        r = chat(c, "Say hello.", tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content, (name, r.choices[0])
        # "auto": text or a call, and a call that parses
        r = chat(c, "What is the weather like in Paris?", tools=[WEATHER], max_tokens=80, temperature=0)
        ch = r.choices[0]
        if ch.finish_reason == "tool_calls":
            validate(json.loads(ch.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
        else:
            assert ch.message.content is not None and ch.message.tool_calls is None, (name, ch)


@test
def tool_conversation(s):
    # The second turn: the assistant's call and the tool's result go back in the messages (rendered as the
    # <tool_call> / <tool_response> turns of the tools' format); the answer is text.
    for name, c in s.each():
        q = {"role": "user", "content": "What is the weather like in Paris?"}
        r = c.chat.completions.create(model=MODEL_ID, messages=[q], tools=[WEATHER], tool_choice="required",
                                      max_tokens=120, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        turn = [q, {"role": "assistant", "content": None,
                    "tool_calls": [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "unit": "celsius"}'}]
        r2 = c.chat.completions.create(model=MODEL_ID, messages=turn, tools=[WEATHER], tool_choice="none",
                                       max_tokens=40, temperature=0)
        ch = r2.choices[0]
        assert ch.message.content and ch.message.tool_calls is None, (name, ch)
        t = c.post("/tokenize", body={"model": MODEL_ID, "messages": turn}, cast_to=object)
        text = c.post("/detokenize", body={"model": MODEL_ID, "tokens": t["tokens"]}, cast_to=object)["prompt"]
        assert "<tool_response>\n" + turn[2]["content"] + "\n</tool_response>" in text, text
        assert "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":" in text, text


@test
def streaming(s):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for name, c in s.each():
        pieces, finish = [], None
        for chunk in chat(c, "Invent a person.", response_format=fmt, max_tokens=200, temperature=0, stream=True):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        text = "".join(pieces)
        assert finish == "stop", (name, finish, text)
        validate(json.loads(text), PERSON)
        # equal to the same request unstreamed
        r = chat(c, "Invent a person.", response_format=fmt, max_tokens=200, temperature=0)
        assert r.choices[0].message.content == text, (name, r.choices[0].message.content, text)
        # a forced tool call streamed: one delta with the call, then finish_reason tool_calls
        calls, finish = [], None
        for chunk in chat(c, "Weather in Tokyo?", tools=[WEATHER], tool_choice="required", max_tokens=120,
                          temperature=0, stream=True):
            if chunk.choices:
                d = chunk.choices[0].delta
                assert not d.content, (name, d)
                calls += d.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and len(calls) == 1, (name, finish, calls)
        assert calls[0].index == 0 and calls[0].function.name == "get_weather", calls[0]
        validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}, "maxItems": 5}},
     "required": ["items"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24}, "done": {"type": "boolean"}},
     "required": ["title", "done"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99,
                                                                                       "maximum": 99},
                                                                                 "y": {"type": "boolean"}},
                                                "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
     "required": ["city", "population"]},
    {"type": "string", "maxLength": 30},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "maxItems": 3}, "score": {"type": "integer", "minimum": -5,
                                                                         "maximum": 5}},
     "required": ["tags", "score"]},
    {"type": "object", "properties": {"ok": {"const": True}, "note": {"type": "string", "maxLength": 20}},
     "required": ["ok", "note"]},
]


@test
def hundred_schema_requests(s):
    # 100 json_schema answers (10 schemas x n 10, sampled at temperature 1, 4 requests at a time on a server with 8
    # batched slots): every one parses and validates against its schema. Every value is bounded (maxLength, maximum,
    # maxItems, enums): an unbounded number or string lets a sampled 135M model write digits until max_tokens.
    # Under ASan + UBSan (TESSERA_SANITIZED, ~4x slower) 3 of the schemas (30 answers); the ci build runs all 100.
    import concurrent.futures
    import os
    import time
    count = 3 if os.environ.get("TESSERA_SANITIZED") == "1" else len(SCHEMAS)
    srv = Server("--parallel", "8", "--queue", "64")
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=600)

        def one(i):
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}
            r = chat(c, "Answer in JSON.", response_format=fmt, max_tokens=160, temperature=1.0, seed=100 + i, n=10)
            return i, r

        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(count)))
        answers = 0
        for i, r in results:
            for ch in r.choices:
                assert ch.finish_reason == "stop", (i, ch.finish_reason, ch.message.content)
                validate(json.loads(ch.message.content), SCHEMAS[i])
                answers += 1
        assert answers == 10 * count
        print(f"  {answers} json_schema answers valid in {time.time() - t0:.1f} s", flush=True)
    finally:
        srv.stop()


@test
def cli_json_schema_and_grammar(s):
    # `tessera run --json-schema` (and --grammar, llama.cpp's flags): the greedy answer the single-sequence server
    # gives with the same schema; a bad grammar is an error naming the flag.
    want, _ = cli_answer("--chat", "-p", "Invent a person.", "-n", "200", "--json-schema", json.dumps(PERSON))
    validate(json.loads(want), PERSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(s.clients["single"], "Invent a person.", response_format=fmt, max_tokens=200, temperature=0)
    assert r.choices[0].message.content == want, (r.choices[0].message.content, want)
    want, _ = cli_answer("--chat", "-p", "Is the sky blue?", "-n", "20", "--grammar", 'root ::= "yes" | "no"')
    assert want in ("yes", "no"), want
    import subprocess
    from harness import BIN, DEVICE, MODEL
    p = subprocess.run([BIN, "run", "-m", MODEL, "--device", DEVICE, "-p", "x", "--grammar", "root ::= nope"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.strip() == \
        "tessera: error: --grammar: the grammar: EBNF parser error at line 1, column 10: Rule \"nope\" is not defined", \
        (p.returncode, p.stderr)


def expect_400(fn, message, param):
    try:
        fn()
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["message"] == message and e.body["param"] == param, e.body
        return
    raise AssertionError("no error")


@test
def bad_schemas(s):
    c = s.clients["single"]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    expect_400(lambda: chat(c, "Hi", response_format=bad, max_tokens=5),
               "Invalid JSON schema in 'response_format.json_schema.schema': the JSON schema: Unsupported type "
               "\"objekt\"", "response_format.json_schema.schema")
    expect_400(lambda: chat(c, "Hi", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
               "'response_format.json_schema.schema' is missing", "response_format.json_schema.schema")
    expect_400(lambda: chat(c, "Hi", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "f"}}),
               "'tool_choice' names the function 'f', which is not in 'tools'", "tool_choice")
    expect_400(lambda: chat(c, "Hi", tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
               "'response_format' json_object or json_schema cannot be combined with 'tools' unless 'tool_choice' "
               "is \"none\"", "response_format")
    # the server still answers afterwards
    assert chat(c, "Hi", max_tokens=2).choices[0].message.content is not None


def teardown(s):
    s.stop()


run(setup, teardown)
