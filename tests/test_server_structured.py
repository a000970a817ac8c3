"""Structured output through the server (server/structured.py), driven by the
official `openai` and `anthropic` clients: `response_format` (json_object,
json_schema) and Anthropic's `output_config.format` answer JSON valid under
the schema; forced tool calls (OpenAI `required` / a named function,
Anthropic `any` / `tool`) come back as tool calls whose arguments are valid
under the tool's parameters; a prompt that leaves the model thinking gets
its reasoning, then the structure; `stop` strings still end the answer; the
prefix cache serves a constrained conversation's next turn; bad schemas and
tool choices are 400s naming the field.

The model is a tiny random checkpoint whose chat template calls tools in
Qwen3-Next's JSON format and thinks (testing/synthetic.py): its free text
is noise, so every valid answer here is the grammar's doing. The XML format
of Qwen3.5/3.6 (mlx_lm's qwen3_coder parser) is checked in-process, through
mlx_lm's own parser."""

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

from serving import Server  # noqa: E402

from mlx_mtp.testing.synthetic import write_checkpoint  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "adds",
                                           "parameters": ADD}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
THINK_END = 260  # `</think>`'s id in the checkpoint's tokenizer (synthetic.THINK_TOKENS)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tools") / "ck", tools="json",
                            thinking=True, seed=7)
    s = Server(["mlx_mtp.server", "--model", str(path)],
               tmp_path_factory.mktemp("log") / "server.log")
    yield s
    s.close()


def client(srv):
    return srv.openai(timeout=120)


def valid(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# -- response_format -----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_is_valid(srv, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                  "strict": True}}
    kw = dict(model="any", messages=MSGS, max_tokens=120, temperature=0, response_format=fmt,
              extra_body=NO_THINKING)
    if not stream:
        r = client(srv).chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        mtp = r.usage.model_extra["mtp"]  # the grammar's forced drafts are counted
        assert mtp["forced"] > 0 and 0 <= mtp["jumps"] <= mtp["cycles"]
    else:
        text, finish = "", None
        for chunk in client(srv).chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop", text
    valid(text, WEATHER)


def test_json_object_answer_is_an_object(srv):
    # (this model's strings run long: a bias on '"' (id 1) ends them sooner)
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=200, temperature=0, logit_bias={"1": 3},
        response_format={"type": "json_object"}, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_sampled_answers_are_valid(srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    for seed in range(3):
        r = client(srv).chat.completions.create(
            model="any", messages=MSGS, max_tokens=60, temperature=1.0, seed=seed,
            response_format=fmt, extra_body=NO_THINKING)
        assert r.choices[0].finish_reason == "stop"
        valid(r.choices[0].message.content, ADD)


def test_the_reasoning_comes_first_then_the_structure(srv):
    """The template opens a think block: the reasoning is free up to
    `</think>` (biased here so that this model writes it at once), and the
    answer after it follows the schema (mlx_lm's reasoning split)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=80, temperature=0, response_format=fmt,
        logit_bias={str(THINK_END): 30})
    assert r.choices[0].finish_reason == "stop"
    valid(r.choices[0].message.content, ADD)


def test_stop_strings_are_still_honoured(srv):
    """ADD's answer is `{"a": N, "b": ...}`: a stop string "," ends it there."""
    fmt = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=60, temperature=0, response_format=fmt,
        stop=[","], extra_body=NO_THINKING)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and "," not in text
    assert text.startswith('{"a": ') and text[6:].isdigit(), text


def test_logprobs_of_masked_tokens_are_json(srv):
    """Where the grammar leaves one token, the others' logprob is -inf: it
    is written as OpenAI's -9999.0, since JSON has no infinity."""
    fmt = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json=dict(
        messages=MSGS, max_tokens=40, temperature=0, logprobs=True, top_logprobs=3,
        response_format=fmt, **NO_THINKING))
    assert r.status_code == 200

    def strict(name):
        raise ValueError(f"{name} is not JSON")

    content = json.loads(r.text, parse_constant=strict)["choices"][0]["logprobs"]["content"]
    first = content[0]  # '{': forced
    assert first["logprob"] == 0.0 and first["top_logprobs"][0]["token"] == "{"
    assert [t["logprob"] for t in first["top_logprobs"][1:]] == [-9999.0, -9999.0]


def test_the_prefix_cache_serves_constrained_turns(srv):
    """A constrained answer's tokens stay in the prefix cache: the next
    turn (holding it) prefills only what follows, and is valid too."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    messages = [{"role": "user", "content": "Weather in Oslo, in a cached turn?"}]
    first = client(srv).chat.completions.create(
        model="any", messages=messages, max_tokens=120, temperature=0, response_format=fmt,
        extra_body=NO_THINKING)
    valid(first.choices[0].message.content, WEATHER)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And tomorrow?"}]
    second = client(srv).chat.completions.create(
        model="any", messages=messages, max_tokens=120, temperature=0, response_format=fmt,
        extra_body=NO_THINKING)
    valid(second.choices[0].message.content, WEATHER)
    # more than turn 1's prompt: the answer itself came from the cache
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens


def test_anthropic_output_format_is_valid(srv):
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    m = a.messages.create(model="local-model", max_tokens=120, messages=MSGS,
                          thinking={"type": "disabled"},
                          output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert m.stop_reason == "end_turn"
    valid(m.content[0].text, WEATHER)


# -- forced tool calls ---------------------------------------------------------------------------
@pytest.mark.parametrize("choice,name", [
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ({"type": "function", "function": {"name": "add"}}, "add"),
    ("required", None),
])
def test_openai_forced_tool_call_has_valid_arguments(srv, choice, name):
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=160, temperature=0, tools=TOOLS,
        tool_choice=choice, parallel_tool_calls=False, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls[0].function.name in ([name] if name else schemas)
    valid(calls[0].function.arguments, schemas[calls[0].function.name])
    if name:  # the call's name and keys are runs the grammar forces: verified alone
        assert r.usage.model_extra["mtp"]["jumps"] >= 1


def test_forced_tool_call_after_reasoning(srv):
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=160, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        logit_bias={str(THINK_END): 30},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    call, = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    valid(call.function.arguments, ADD)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_anthropic_forced_tool_use_has_valid_input(srv, choice, stream):
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    kw = dict(model="local-model", max_tokens=160, messages=MSGS,
              thinking={"type": "disabled"}, tool_choice=choice,
              tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                     for t in TOOLS])
    if stream:
        with a.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = a.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1
    if choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER if uses[0].name == "get_weather" else ADD)


# -- forced calls on a template that thinks --------------------------------------------------------
def test_a_forced_call_is_made_with_thinking_off_unless_asked_for(srv):
    """The template opens a think block this model never closes: a forced
    call would wait behind max_tokens of reasoning. Unasked, thinking is
    off for it."""
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=160, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}})
    assert r.choices[0].finish_reason == "tool_calls"
    assert not (r.choices[0].message.model_extra or {}).get("reasoning")
    call, = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    valid(call.function.arguments, ADD)


def test_a_forced_call_after_thinking_asked_for_gets_a_reasoning_budget(srv):
    """Thinking asked for: the reasoning gets half of max_tokens, then it is
    ended (`</think>` forced: this model would not write it) and the call
    follows."""
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=200, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, logprobs=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert (r.choices[0].message.model_extra or {}).get("reasoning")
    ids = [e.model_extra["id"] for e in r.choices[0].logprobs.content]
    assert ids.index(THINK_END) == 100
    assert r.choices[0].finish_reason == "tool_calls"
    call, = r.choices[0].message.tool_calls
    valid(call.function.arguments, WEATHER)


def test_anthropic_thinking_budget_before_a_forced_call(srv):
    """Anthropic's thinking.budget_tokens bounds the reasoning before a
    forced tool_use."""
    body = dict(model="local-model", max_tokens=200, messages=MSGS, stream=True,
                thinking={"type": "enabled", "budget_tokens": 24},
                tool_choice={"type": "tool", "name": "get_weather"},
                tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                       for t in TOOLS])
    r = requests.post(srv.url + "/v1/messages", json=body, stream=True, timeout=120)
    data = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
            if line.startswith("data: ")]
    starts = {d["index"]: d["content_block"] for d in data if d["type"] == "content_block_start"}
    assert starts[0]["type"] == "thinking" and {b["type"] for b in starts.values()} == {
        "thinking", "tool_use"}
    text = "".join(d["delta"].get("thinking", "") for d in data if d.get("index") == 0
                   and d["type"] == "content_block_delta")
    assert 0 < len(text) <= 24  # (a token decodes to at most one character here)
    assert [d["delta"]["stop_reason"] for d in data if d["type"] == "message_delta"] == [
        "tool_use"]
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    with a.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
        m = s.get_final_message()
    assert m.stop_reason == "tool_use" and m.content[0].type == "thinking"
    use, = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER)


# -- what the answer says is what happened -------------------------------------------------------
def test_anthropic_thinking_block_streams_a_signature_delta(srv):
    """Before its content_block_stop, a thinking block gets a signature_delta
    (empty: nothing signs a local model's thinking), which clients keeping
    thinking blocks wait for."""
    r = requests.post(srv.url + "/v1/messages", stream=True, timeout=120, json=dict(
        model="local-model", max_tokens=20, messages=MSGS, stream=True,
        thinking={"type": "enabled", "budget_tokens": 1024}))
    data = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
            if line.startswith("data: ")]
    block = [d for d in data if d.get("index") == 0]
    assert block[0]["content_block"]["type"] == "thinking"
    assert block[-2]["delta"] == {"type": "signature_delta", "signature": ""}
    assert block[-1]["type"] == "content_block_stop"
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    with a.messages.stream(model="local-model", max_tokens=20, messages=MSGS,
                           thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        m = s.get_final_message()
    assert m.content[0].type == "thinking" and m.content[0].signature == ""


# A tool-call block the parser cannot read: the grammar makes this model write
# the markers inside a JSON string ("\n" escaped), around what is not JSON.
NOT_A_CALL = "<tool_call>\nnot json\n</tool_call>"
WRITES_NOT_A_CALL = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
    "const": NOT_A_CALL}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_tool_call_is_text_and_the_finish_is_stop(srv, stream):
    """(mlx_lm.server: finish_reason "tool_calls" with no calls, the text
    between the markers gone)"""
    kw = dict(model="any", messages=MSGS, max_tokens=60, temperature=0,
              response_format=WRITES_NOT_A_CALL, extra_body=NO_THINKING)
    if stream:
        text, finish, calls = "", None, []
        for chunk in client(srv).chat.completions.create(stream=True, **kw):
            if chunk.choices:
                delta = chunk.choices[0].delta
                text += delta.content or ""
                calls += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
    else:
        r = client(srv).chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        calls = r.choices[0].message.tool_calls or []
    assert (text, finish, calls) == (json.dumps(NOT_A_CALL), "stop", [])
    assert json.loads(text) == NOT_A_CALL


def test_anthropic_malformed_tool_call_is_a_text_block(srv):
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    m = a.messages.create(model="local-model", max_tokens=60, messages=MSGS,
                          thinking={"type": "disabled"}, output_config={"format": {
                              "type": "json_schema", "schema": {"const": NOT_A_CALL}}})
    assert m.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in m.content] == [("text", json.dumps(NOT_A_CALL))]


ADD_ONLY = [t for t in TOOLS if t["function"]["name"] == "add"]


def test_a_call_cut_by_max_tokens_is_length_and_stays_text(srv):
    """Several calls allowed: this model writes call after call, and
    max_tokens cuts one. OpenAI: "length", the whole calls as tool_calls, the
    cut one as text; Anthropic: "max_tokens" (mlx_lm.server's: "tool_use")."""
    r = client(srv).chat.completions.create(
        model="any", messages=MSGS, max_tokens=100, temperature=0, tools=ADD_ONLY,
        tool_choice="required", extra_body=NO_THINKING)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        valid(call.function.arguments, ADD)
    cut = choice.message.content.strip()
    assert cut.startswith("<tool_call>") and not cut.endswith("</tool_call>"), cut
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    m = a.messages.create(model="local-model", max_tokens=100, messages=MSGS,
                          thinking={"type": "disabled"}, tool_choice={"type": "any"},
                          tools=[{"name": "add", "input_schema": ADD}])
    assert m.stop_reason == "max_tokens"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(jsonschema.validate(u.input, ADD) is None for u in uses)
    assert m.content[-1].type == "text" and m.content[-1].text.strip().startswith("<tool_call>")


# -- refusals ------------------------------------------------------------------------------------
REPEATABLE_KEYS = {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                   "minProperties": 2, "maxProperties": 3}


def _fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


BAD = [  # (body fields, the param the 400 names, words of its message)
    (dict(response_format=_fmt({"type": "nope"})), "response_format.json_schema.schema",
     "invalid JSON schema"),
    (dict(response_format=_fmt({"type": "array", "uniqueItems": True})),
     "response_format.json_schema.schema", "uniqueItems"),
    (dict(response_format=_fmt({"type": "string", "format": "no-such-format"})),
     "response_format.json_schema.schema", "format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "required"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "response_format.json_schema.name", "name"),
    (dict(response_format={"type": "yaml"}), "response_format", "json_object"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", "not one of the request's tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "null"}}}}}}],
          tool_choice="required"), "tools.0.function.parameters", "not"),
    (dict(tool_choice="required"), "tool_choice", "no tools"),
    # (the issue's: llguidance wrote {"x_origs": 0, "x_origs": 0, "x_origs": 1}, one key parsed)
    (dict(response_format=_fmt(REPEATABLE_KEYS)), "response_format.json_schema.schema",
     "minProperties"),
]


@pytest.mark.parametrize("fields,param,words", BAD, ids=range(len(BAD)))
def test_bad_schemas_and_choices_are_400(srv, fields, param, words):
    r = requests.post(srv.url + "/v1/chat/completions", timeout=60,
                      json=dict(messages=MSGS, max_tokens=8, **fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "\n" not in error["message"]
    # the OpenAI client raises it as a BadRequestError
    with pytest.raises(openai.BadRequestError):
        client(srv).chat.completions.create(model="any", messages=MSGS, max_tokens=8, **fields)


@pytest.mark.parametrize("fields,words", [
    (dict(output_config={"format": {"type": "json_schema", "schema": {"type": "array",
                                                                       "uniqueItems": True}}}),
     "uniqueItems"),
    (dict(output_config={"format": {"type": "yaml"}}), "output_config.format"),
    (dict(output_config={"format": {"type": "json_schema", "schema": REPEATABLE_KEYS}}),
     "minProperties"),
    (dict(tools=[{"name": "f", "input_schema": ADD}], tool_choice={"type": "tool", "name": "g"}),
     "'g' is not one of the request's tools"),
])
def test_anthropic_bad_formats_are_400(srv, fields, words):
    r = requests.post(srv.url + "/v1/messages", timeout=60, json=dict(
        model="claude", max_tokens=8, messages=MSGS, **fields))
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and words in body["error"]["message"], body


# -- Qwen3.5/3.6's XML tool calls (mlx_lm's qwen3_coder parser), in-process ----------------------
XML_TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 10},
            "mode": {"type": "string", "enum": ["fast", "deep"]},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "exact": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            "where": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                              "maximum": 9}},
                      "required": ["x"], "additionalProperties": False}},
        "required": ["query", "mode", "limit", "exact", "tags", "where"]}}},
    {"type": "function", "function": {"name": "noop"}},
]


@pytest.fixture(scope="module")
def xml_model(tmp_path_factory):
    import mlx_mtp

    path = write_checkpoint(tmp_path_factory.mktemp("xml") / "ck", tools="xml", thinking=True,
                            seed=3)
    return mlx_mtp.load(path, quiet=True)


def _tool_texts(tok, text: str):
    """The tool-call texts mlx_lm.server would hand its parser (its text
    state machine's "tool" segments)."""
    from mlx_lm.generate import make_text_state_machine

    from mlx_mtp.mlx_lm_compat import text_segments

    sm = make_text_state_machine(tok)
    state, segments = text_segments(sm.make_state("normal"), text, "length")
    calls, current = [], None
    for kind, piece in segments:
        if kind == "tool":
            current = (current or "") + piece
        elif current is not None:
            calls.append(current)
            current = None
    return calls + ([current] if current is not None else [])


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "search"}},
                                    {"type": "function", "function": {"name": "noop"}},
                                    "required"])
@pytest.mark.parametrize("k", [0, 2])
def test_xml_tool_calls_parse_to_valid_arguments(xml_model, choice, k):
    import mlx_mtp
    from mlx_mtp.server import structured

    model, tok = xml_model
    assert tok.tool_parser.__module__ == "mlx_lm.tool_parsers.qwen3_coder"
    wanted = structured.openai(dict(tools=XML_TOOLS, tool_choice=choice, parallel_tool_calls=False),
                               tok, model.vocab_size)
    prompt = tok.apply_chat_template(MSGS, tools=XML_TOOLS, add_generation_prompt=True,
                                     enable_thinking=False)
    text = mlx_mtp.generate(model, tok, prompt, max_tokens=300, draft_tokens=k,
                            constraint=structured.constraint(wanted))
    calls = _tool_texts(tok, text)
    assert len(calls) == 1, text
    call = tok.tool_parser(calls[0], XML_TOOLS)  # mlx_lm's own parser
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {
        "type": "object", "additionalProperties": False} for t in XML_TOOLS}
    if isinstance(choice, dict):
        assert call["name"] == choice["function"]["name"]
    jsonschema.validate(call["arguments"], schemas[call["name"]])


@pytest.mark.parametrize("prop,words", [
    ({"type": "string", "pattern": "^a+$"}, "'pattern'"),
    ({"type": ["string", "null"]}, "'type'"),
    ({"enum": ["a", "b"]}, "'type'"),
    ({"type": "string", "enum": ["null"]}, "'null'"),
    ({"type": "integer", "uniqueItems": True}, "uniqueItems"),
])
def test_xml_refuses_what_its_format_cannot_carry(xml_model, prop, words):
    from mlx_mtp.server import structured
    from mlx_mtp.server.schemas import ApiError

    model, tok = xml_model
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": prop}}}}]
    with pytest.raises(ApiError) as e:
        structured.openai(dict(tools=tools, tool_choice="required"), tok, model.vocab_size)
    assert e.value.status == 400 and e.value.param.startswith("tools.0.function.parameters")
    assert words in str(e.value), str(e.value)


# -- the Responses API (Codex, the Agents SDK): a forced call is a function_call item ----------
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_call_is_a_function_call_item(srv, stream):
    """tool_choice "required" on /v1/responses: the answer is a function_call
    item whose arguments are valid under the tool's parameters; sent back
    with its output, the conversation goes on (the agent loop)."""
    kw = dict(model="any", input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
              tool_choice={"type": "function", "name": "get_weather"},
              reasoning={"effort": "none"}, max_output_tokens=120)
    if stream:
        events = list(client(srv).responses.create(stream=True, **kw))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds, kinds
        response = events[-1].response
    else:
        response = client(srv).responses.create(**kw)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1, response.output
    assert calls[0].name == "get_weather"
    valid(calls[0].arguments, WEATHER)
    turn = client(srv).responses.create(
        model="any", tools=RESPONSES_TOOLS, max_output_tokens=4, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert turn.usage.input_tokens > response.usage.input_tokens
