"""Stop strings in the server's generation thread (server/lane.py,
server/stops.py), in-process on the demo model: the answer ends where the
first stop string begins, at any draft depth, whatever tokens the string
starts or ends inside; `ctx.stop_sequence` names it; and the prefix cache
is given nothing past what was answered (a recurrent state cannot be cut
back, so a state holding a stop string's tokens is not stored). The HTTP
side (both APIs, streams): tests/test_server_protocol.py."""

import pytest

from mlx_mtp.loader import demo_model_path
from serving import LONG_PROMPT

pytestmark = pytest.mark.skipif(demo_model_path() is None, reason="demo model not installed")

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def generator():
    from mlx_mtp.server.cli import parse_args
    from mlx_mtp.server.generation import MTPModelProvider, MTPResponseGenerator
    from mlx_mtp.server.prompt_store import TieredPromptCache

    class Recording(TieredPromptCache):
        """The prefix cache, each stored key kept (`inserted`)."""

        inserted: list = []

        def insert_cache(self, model, tokens, prompt_cache, **kw):
            self.inserted.append(list(tokens))
            return super().insert_cache(model, tokens, prompt_cache, **kw)

    args = parse_args(["--model", str(demo_model_path())])
    args.num_draft_tokens = None  # (as server/cli.py's main sets it)
    gen = MTPResponseGenerator(MTPModelProvider(args, "demo"), Recording(64, 1 << 40))
    try:
        yield gen
    finally:
        gen.stop_and_join()


def run(gen, stop, depth):
    """(the responses, the context) of LONG_PROMPT's greedy completion; the
    cache's `inserted` keys are this request's (cleared once the generation
    thread took it up: it stored the previous request's answer before)."""
    from mlx_mtp.mlx_lm_compat import NEUTRAL, CompletionRequest, generation_arguments

    args = generation_arguments(
        **dict(NEUTRAL, num_draft_tokens=depth), model="default_model", draft="default_model",
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, stop_words=stop,
        max_tokens=MAX_TOKENS, chat_template_kwargs=None)
    ctx, responses = gen.generate(CompletionRequest("text", LONG_PROMPT, [], None, None), args)
    del gen.prompt_cache.inserted[:]
    return list(responses), ctx


# (depth 2 in the slow tier: depth 3 crosses cycles the same way)
@pytest.mark.parametrize("depth", [0, pytest.param(2, marks=pytest.mark.slow), 3])
def test_the_answer_ends_where_a_stop_string_begins_and_the_cache_keeps_no_more(
        generator, depth):
    free, _ = run(generator, [], depth)
    tok = generator.model_provider.tokenizer  # (loaded by the generation thread)
    text = "".join(r.text for r in free)
    assert free[-1].finish_reason == "length" and len(text) > 40
    # strings starting inside a token and spanning tokens (never the ids the
    # string encodes to alone), long ones across cycles (their start's state
    # is then past: not stored)
    third = len(text) // 3
    stops = [text[p:p + n] for p, n in ((5, 4), (third, 3), (third, 16), (len(text) // 2, 24),
                                        (len(text) - 6, 4))]
    for stop in stops:
        responses, ctx = run(generator, ["zzzz-not-there", stop], depth)
        answer = "".join(r.text for r in responses)
        assert answer == text[:text.index(stop)], stop
        assert responses[-1].finish_reason == "stop" and ctx.stop_sequence == stop
        assert [r.token for r in responses] == [r.token for r in free][:len(responses)]
        # every stored key: the prompt, then tokens whose text is the answer's
        prompt = ctx.prompt
        for key in generator.prompt_cache.inserted:
            assert key[:len(prompt)] == prompt[:len(key)]
            assert answer.startswith(tok.decode(key[len(prompt):])), (stop, key[len(prompt):])


def test_without_a_stop_string_the_text_is_whole(generator):
    """Text held back as a possible stop string's start comes out at the end."""
    free, _ = run(generator, [], 0)
    text = "".join(r.text for r in free)
    held, ctx = run(generator, [text[-3:] + "#never"], 0)
    assert "".join(r.text for r in held) == text and ctx.stop_sequence is None
    assert held[-1].finish_reason == "length"
