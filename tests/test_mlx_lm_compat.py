"""mlx_lm's private and undocumented names we rely on (mlx_mtp/mlx_lm_compat.py)
still have the shape we rely on; each failure names the symbol and what changed."""

import dataclasses
import email.message
import inspect
import io
import json
import types
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm.server
import pytest

from mlx_mtp import mlx_lm_compat as compat
from mlx_mtp.mlx_lm_compat import Need, problems


class FakeTokenizer:
    eos_token_ids = {0}
    has_thinking = has_tool_calling = False
    structural_markers = ()
    response_transitions = {}

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


# -- the checker --------------------------------------------------------------------------------
def test_installed_mlx_lm_has_all_we_rely_on():
    found = problems()
    assert not found, "mlx_lm changed what mlx_mtp relies on (mlx_mtp/mlx_lm_compat.py):\n" + \
        "\n".join(found)


def test_checker_names_a_missing_symbol(monkeypatch):
    monkeypatch.delattr(mlx_lm.server, "_make_logits_processors")
    monkeypatch.delattr(mlx_lm.server.ResponseGenerator, "_tokenize")
    found = problems()
    assert any(p.startswith("mlx_lm.server._make_logits_processors: not found")
               for p in found), found
    assert any(p.startswith("mlx_lm.server.ResponseGenerator._tokenize: not found")
               for p in found), found
    assert len(found) == 2, found


def test_checker_names_a_changed_signature(monkeypatch):
    monkeypatch.setattr(mlx_lm.server.ResponseGenerator, "_make_state_machine",
                        lambda self, tokenizer, stop_words: None)
    found = problems()
    assert len(found) == 1 and found[0].startswith(
        "mlx_lm.server.ResponseGenerator._make_state_machine: parameters are now "
        "(self, tokenizer, stop_words)"), found


def test_checker_names_changed_fields():
    @dataclasses.dataclass
    class Response:  # a release that put `token` first
        token: int
        text: str
        logprob: float
        finish_reason: str
        top_tokens: tuple

    fake = types.ModuleType("fake_server")
    fake.Response = Response
    fake.GenerationContext = object  # no longer a dataclass
    needs = [n for n in compat.RELIED_ON if n.path in (
        "mlx_lm.server:Response", "mlx_lm.server:GenerationContext")]
    found = problems(needs, import_module=lambda name: fake)
    assert len(found) == 2, found
    assert found[0].startswith("mlx_lm.server.Response: fields are now (token, text, "), found
    assert found[1].startswith("mlx_lm.server.GenerationContext: no longer a dataclass"), found


def test_checker_names_an_instance_attribute_no_longer_set(monkeypatch):
    """The server reads attributes mlx_lm's handler and generator set on
    themselves; a release that stops setting one is named."""
    class Handler:  # a release whose handler no longer sets `stream`
        def do_POST(self):
            self.max_tokens = 1

    fake = types.ModuleType("fake_server")
    fake.APIHandler = Handler
    found = problems([Need("fake_server:APIHandler", sets=("max_tokens", "stream"))],
                     import_module=lambda name: fake)
    assert found == ["fake_server.APIHandler: no longer sets stream, which mlx_mtp reads"]


def test_every_reexport_is_checked():
    """Each mlx_lm class or function compat.py hands out has an entry in RELIED_ON."""
    paths = {n.path for n in compat.RELIED_ON}
    for name, obj in vars(compat).items():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        module = getattr(obj, "__module__", "")
        if not module.startswith("mlx_lm"):
            continue
        path = f"{module}:{obj.__qualname__}"
        assert path in paths or any(p.startswith(path + ".") for p in paths), \
            f"mlx_mtp.mlx_lm_compat.{name} ({path}) is not in RELIED_ON"


# -- behaviour the signatures do not show ----------------------------------------------------------
def test_tokenize_returns_five():
    request = compat.CompletionRequest("text", "hi", [], None, None)
    out = compat.ResponseGenerator._tokenize(None, FakeTokenizer(), request, None)
    assert isinstance(out, tuple) and len(out) == 5, \
        f"mlx_lm.server.ResponseGenerator._tokenize returns {out!r}; mlx_mtp unpacks " \
        "(prompt, segments, segment_types, initial_state, vision)"
    prompt, segments, kinds, initial_state, vision = out
    assert prompt == [104, 105] and segments == [prompt] and kinds == ["assistant"]
    assert initial_state == "normal" and vision is None


def test_make_state_machine_returns_stop_sequences_and_text_machine():
    owner = SimpleNamespace(_state_machine_cache={})
    out = compat.ResponseGenerator._make_state_machine(owner, "key", FakeTokenizer(), ())
    assert isinstance(out, tuple) and len(out) == 2, \
        f"mlx_lm.server.ResponseGenerator._make_state_machine returns {out!r}; mlx_mtp " \
        "unpacks (stop_sequences, text_sm)"
    assert isinstance(out[1], compat.TextStateMachine)


def test_a_transition_to_none_ends_the_text():
    """server/stops.py's stop strings: split's last segment is (None, "")
    once one matched, the text before it in the segments."""
    sm = compat.TextStateMachine({"text": [("ab", None)]})
    state, first = compat.TextStateMachine.split(sm.make_state("text"), "xa")
    assert first == [("text", "x")]
    state, second = compat.TextStateMachine.split(state, "bc")
    assert second == [("text", ""), (None, "")]


def test_share_object_in_one_process_and_on_rank_0_is_the_object_itself():
    mx.distributed.init()
    news = ({"a": 1}, [2], False)
    for owner in (SimpleNamespace(_is_distributed=False, _rank=0),
                  SimpleNamespace(_is_distributed=True, _rank=0)):
        assert compat.ResponseGenerator._share_object(owner, news) is news, \
            "mlx_lm.server.ResponseGenerator._share_object no longer hands rank 0 its own object"
        assert compat.ResponseGenerator._share_object(owner, None) is None


def test_generation_context_stop_sets_should_stop():
    ctx = compat.GenerationContext(has_tool_calling=False, has_thinking=False, tool_parser=None,
                                   text_sm=None, initial_state="normal", prompt=[1],
                                   prompt_cache_count=0)
    assert ctx._should_stop is False
    ctx.stop()
    assert ctx._should_stop is True, "mlx_lm.server.GenerationContext.stop() no longer sets " \
        "_should_stop (the generation loop reads it for a client that left)"


def test_response_generator_thread_queue_and_attributes():
    """The generation thread runs `_run_generate`; `generate` queues
    (response queue, request, args) and reads back the context, progress,
    responses and None; the attributes MTPResponseGenerator reads exist."""
    served = []

    class Probe(compat.ResponseGenerator):
        def _run_generate(self):
            rqueue, request, args = self.requests.get(timeout=30)
            served.append((request, args))
            for item in ("ctx", (1, 2), "token", None):
                rqueue.put(item)

    provider = SimpleNamespace(cli_args=SimpleNamespace())
    gen = Probe(provider, "prompt cache")
    for name in ("_is_distributed", "_rank", "_stop", "_generation_failed", "requests",
                 "model_provider", "prompt_cache", "cli_args"):
        assert hasattr(gen, name), f"mlx_lm.server.ResponseGenerator has no attribute {name!r}"
    progress = []
    ctx, response = gen.generate("request", "args", progress_callback=lambda *a: progress.append(a))
    assert ctx == "ctx" and list(response) == ["token"] and progress == [(1, 2)]
    assert served == [("request", "args")]
    gen.stop_and_join()
    assert gen._stop is True


class _Handler(compat.APIHandler):
    """mlx_lm's APIHandler as MTPAPIHandler validates the depth."""

    def validate_model_parameters(self):
        compat.validate_depth(self, super().validate_model_parameters)


def test_model_provider_attributes():
    """What MTPModelProvider reads of mlx_lm's ModelProvider after __init__."""
    cli = SimpleNamespace(model="m", adapter_path=None, draft_model=None, pipeline=False,
                          trust_remote_code=False, chat_template="{{x}}")
    provider = compat.ModelProvider(cli)
    for name in ("cli_args", "model_key", "model", "tokenizer", "processor", "draft_model",
                 "is_batchable", "pipeline_group", "tensor_group", "is_distributed"):
        assert hasattr(provider, name), f"mlx_lm.server.ModelProvider has no attribute {name!r}"
    assert provider._tokenizer_config == {"trust_remote_code": False, "chat_template": "{{x}}"}, \
        f"mlx_lm.server.ModelProvider._tokenizer_config is now {provider._tokenizer_config!r} " \
        "(MTPModelProvider passes it to load as tokenizer_config)"


def _handler(body: bytes, cls):
    """An APIHandler (cls) with no socket: the request line and headers read."""
    h = cls.__new__(cls)
    h.path, h.command = "/v1/completions", "POST"
    h.requestline, h.request_version = "POST /v1/completions HTTP/1.1", "HTTP/1.1"
    h.headers = email.message.Message()
    h.headers["Content-Length"] = str(len(body))
    h.rfile, h.wfile = io.BytesIO(body), io.BytesIO()
    h.response_generator = SimpleNamespace(cli_args=SimpleNamespace(
        num_draft_tokens=None, max_tokens=7, temp=0.0, top_p=1.0, top_k=0, min_p=0.0))
    return h


def test_do_post_reads_the_handed_body_and_validates_the_depth():
    """do_POST parses what `hand_body_to` gives it (rfile, Content-Length),
    runs validate_model_parameters (through `validate_depth`), then
    handle_completion(request, stop_words) with the request's attributes set."""
    seen = {}

    class Probe(_Handler):
        def handle_completion(self, request, stop_words):
            seen.update(request=request, stop_words=stop_words, depth=self.num_draft_tokens,
                        max_tokens=self.max_tokens, logit_bias=self.logit_bias,
                        kwargs=self.chat_template_kwargs, stream=self.stream)

    h = _handler(b"{}", Probe)
    h.rfile.read()  # (server.py has read the body to check it)
    compat.hand_body_to(h, {"prompt": "hi", "stop": "x", "num_draft_tokens": "auto",
                            "logit_bias": {"3": 1}, "chat_template_kwargs": {"a": 1}})
    h.do_POST()
    assert h.wfile.getvalue() == b"", h.wfile.getvalue()
    assert seen["request"] == compat.CompletionRequest("text", "hi", [], None, None)
    assert seen["stop_words"] == ["x"] and seen["depth"] == "auto" and seen["max_tokens"] == 7
    assert seen["logit_bias"] == {3: 1.0}, "validate_model_parameters no longer ran"
    assert seen["kwargs"] == {"a": 1} and seen["stream"] is False


def test_validate_depth_refuses_what_mlx_lm_refuses():
    h = SimpleNamespace(num_draft_tokens=-1)

    def validate():
        raise ValueError(f"num_draft_tokens must be at least 0, not {h.num_draft_tokens}")

    with pytest.raises(ValueError, match="-1"):
        compat.validate_depth(h, validate)
    for depth in (None, "auto"):
        h.num_draft_tokens = depth
        compat.validate_depth(h, lambda: None if h.num_draft_tokens == 0 else 1 / 0)
        assert h.num_draft_tokens == depth


def test_text_segments():
    sm = compat.TextStateMachine({"normal": [("<think>", "reasoning")],
                                  "reasoning": [("</think>", "normal")]})
    state = sm.make_state("normal")
    state, a = compat.text_segments(state, "a<thi", None)
    state, b = compat.text_segments(state, "nk>r</think>b<th", "length")
    assert a == [("normal", "a")]
    assert b == [("normal", ""), ("reasoning", "r"), ("normal", "b"), ("normal", "<th")]
    state = sm.make_state("normal")
    state, _ = compat.text_segments(state, "c<th", None)
    # the end lets out what was held, whatever ended it (mlx_lm drops it on "stop")
    assert compat.text_segments(state, "", "stop")[1] == [("normal", ""), ("normal", "<th")]


def test_generation_arguments_fill_every_field():
    args = compat.generation_arguments(**compat.NEUTRAL, model="m", draft="d", temperature=0.5,
                                       top_p=1.0, top_k=0, min_p=0.0, stop_words=["x"],
                                       max_tokens=3, chat_template_kwargs=None)
    assert isinstance(args, compat.GenerationArguments)
    assert args.model == compat.ModelDescription("m", "d", None)
    assert args.sampling.temperature == 0.5 and args.logits.repetition_context_size == 20
    assert args.stop_words == ["x"] and args.max_tokens == 3


def test_generation_arguments_name_a_field_not_filled():
    with pytest.raises(TypeError, match="GenerationArguments has a field 'seed'"):
        values = dict(compat.NEUTRAL, model="m", draft="d", temperature=0.5, top_p=1.0,
                      top_k=0, min_p=0.0, stop_words=[], max_tokens=3,
                      chat_template_kwargs=None)
        del values["seed"]
        compat.generation_arguments(**values)


def test_neutral_matches_mlx_lm_do_post_defaults():
    """NEUTRAL is what mlx_lm's do_POST gives a request that names none of them."""
    seen = {}

    class Probe(_Handler):
        def handle_completion(self, request, stop_words):
            seen.update({k: getattr(self, k) for k in compat.NEUTRAL if k != "num_draft_tokens"})

    h = _handler(json.dumps({"prompt": "hi"}).encode(), Probe)
    h.do_POST()
    assert seen == {k: v for k, v in compat.NEUTRAL.items() if k != "num_draft_tokens"}
