"""Walks the parameter table (mlx_mtp/params.py): for every bound, the value
at it is taken and the value just past it (±1 for integers, 0.001 for
numbers) is refused, in the same words, by the Python API's check, by both
CLIs' argparse (exit 2, one `error:` line) and by both HTTP APIs of one real
`python -m mlx_mtp.server` (400 with OpenAI's error object naming the field,
or Anthropic's error body), before anything is queued."""

import json
import subprocess
import sys

import pytest

requests = pytest.importorskip("requests")

from mlx_mtp import checks, params, server  # noqa: E402
from mlx_mtp.cli import setup_arg_parser  # noqa: E402
from mlx_mtp.loader import demo_model_path  # noqa: E402
from mlx_mtp.sampling import make_sampler  # noqa: E402
from serving import Server  # noqa: E402

LIMIT = 4  # the test server's --max-tokens-limit: max_tokens' upper bound on HTTP
VOCAB = json.loads((demo_model_path() / "config.json").read_text())["text_config"]["vocab_size"]


def bounds(p):
    """[(at, past)] for each of the row's bounds."""
    step = 1 if p.kind is int else 1e-3
    out = []
    if p.lo is not None:
        out.append((p.kind(p.lo), p.kind(p.lo) - step))
    if p.hi is not None:
        out.append((p.kind(p.hi), p.kind(p.hi) + step))
    return out


CASES = [(p, at, past) for p in params.TABLE for at, past in bounds(p)]


def ids(cases):
    return [f"{getattr(c[0], 'name', c[0])}={c[1]}|{c[2]}" for c in cases]


# -- (a) the Python API -----------------------------------------------------------------
SAMPLER = {"temp", "draft_temp", "top_p", "min_p", "top_k", "min_tokens_to_keep",
           "xtc_probability", "xtc_threshold"}


def api_checks(name):
    """The API's checks of a parameter: the table's, and the functions made from it."""
    yield lambda v: params.check(name, v)
    if name in SAMPLER:
        yield lambda v: checks.sampling(**{**params.SAMPLER_DEFAULTS, name: v})
        yield lambda v: make_sampler(**{name: v})
    if name == "draft_tokens":
        yield checks.depth


@pytest.mark.parametrize("p,at,past", CASES, ids=ids(CASES))
def test_api(p, at, past):
    for check in api_checks(p.name):
        check(at)
        with pytest.raises(ValueError) as e:
            check(past)
        message = str(e.value)
        assert message == f"{p.name} must be {p.allowed()}, not {past}", message


def test_api_extra_values_and_types():
    assert checks.depth("auto") == "auto" and checks.depth("3") == 3
    # generate_step's max_tokens: the table's, and 0 (the prompt is only prefilled)
    assert checks.max_tokens(-1) == -1 and checks.max_tokens(0) == 0
    with pytest.raises(ValueError, match="max_tokens must be at least 1 or -1"):
        checks.max_tokens(-2)
    for name, bad in [("top_k", 2.0), ("temp", "hot"), ("temp", float("nan")), ("seed", True),
                      ("draft_tokens", 1.5)]:
        with pytest.raises(TypeError, match=name):
            params.check(name, bad)
    assert checks.top_k(VOCAB - 1, VOCAB) == VOCAB - 1
    with pytest.raises(ValueError, match=f"top_k must be in 0..{VOCAB - 1}"):
        checks.top_k(VOCAB, VOCAB)


# -- (b) both CLIs' argparse, in process ------------------------------------------------
PARSERS = {"generate": setup_arg_parser, "server": server.build_parser}
FLAG_CASES = [(surface, f, p, at, past) for p, at, past in CASES
              for surface in PARSERS for f in getattr(p, surface)]


def refused(parse, argv, capsys) -> str:
    """The one `error:` line of an argparse exit 2."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("surface,flag,p,at,past", FLAG_CASES,
                         ids=[f"{s}{f}={at}|{past}" for s, f, _, at, past in FLAG_CASES])
def test_cli(surface, flag, p, at, past, capsys):
    parse = PARSERS[surface]().parse_args
    assert getattr(parse([flag, str(at)]), p.name) == at
    line = refused(parse, [flag, str(past)], capsys)
    assert flag in line and p.name in line and f"not {past}" in line, line
    assert p.allowed(surface) in line, line


def test_cli_types_are_the_table(capsys):
    """Every numeric flag of both CLIs has the table's converter, and every
    flag in the table is there (the suppressed no-op flags excepted)."""
    for surface, make in PARSERS.items():
        actions = {o: a for a in make()._actions for o in a.option_strings}
        for p in params.TABLE:
            for f in getattr(p, surface):
                assert getattr(actions[f].type, "param", None) is p, (surface, f)
        unchecked = {o for o, a in actions.items() if a.type in (int, float)}
        assert unchecked <= {"--prompt-concurrency", "--kv-group-size", "--quantized-kv-start",
                             "--kv-bits"}, (surface, unchecked)
    # the generate CLI's -1, the server's refusal of it, and their words
    assert setup_arg_parser().parse_args(["--max-tokens", "-1"]).max_tokens == -1
    assert "at least 1, not -1" in refused(server.build_parser().parse_args,
                                           ["--max-tokens", "-1"], capsys)
    line = refused(server.parse_args, ["--max-tokens", "9", "--max-tokens-limit", "8"], capsys)
    assert "--max-tokens (9) must be at most --max-tokens-limit (8)" in line
    line = refused(setup_arg_parser().parse_args, ["--temp", "1e9"], capsys)
    assert line.endswith("argument --temp: temp must be in [0, 100], not 1000000000.0"), line


def test_server_flag_out_of_range_exits_2():
    r = subprocess.run([sys.executable, "-m", "mlx_mtp.server", "--top-p", "1.5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "python -m mlx_mtp.server: error: argument --top-p: top_p must be in [0, 1], not 1.5")


# -- (c) both HTTP APIs of one server ---------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(["mlx_mtp.server", "--max-tokens-limit", str(LIMIT), "--max-tokens", str(LIMIT)],
               tmp_path_factory.mktemp("params") / "server.log")
    try:
        yield s
    finally:
        s.close()


# what the table cannot know: the server's --max-tokens-limit, the model's vocabulary
LIMITS = {"max_tokens": (LIMIT, LIMIT + 1), "max_completion_tokens": (LIMIT, LIMIT + 1),
          "top_k": (VOCAB - 1, VOCAB)}


def http_cases(surface):
    return ([(f, at, past) for p, at, past in CASES for f in getattr(p, surface)]
            + [(f, *LIMITS[f]) for f in params.FIELDS[surface] if f in LIMITS])


MESSAGES = [{"role": "user", "content": "def f():"}]


def post_openai(srv, field, value, path="/v1/chat/completions"):
    body = {"prompt": "def f():"} if path == "/v1/completions" else {"messages": MESSAGES}
    body.update(max_tokens=1)
    body[field] = value
    return requests.post(srv.url + path, json=body, timeout=60)


def post_anthropic(srv, field, value):
    body = {"model": "mlx-mtp-demo", "max_tokens": 1, "messages": MESSAGES, field: value}
    return requests.post(srv.url + "/v1/messages", json=body, timeout=60)


# max_tokens past --max-tokens-limit is said in the words each API's clients
# parse (Claude Code lowers its max_tokens to the limit Anthropic's names)
OVER_LIMIT = {"openai": "{field} is too large: {value}. This model supports at most {limit} "
                        "completion tokens (--max-tokens-limit), whereas you provided {value}.",
              "anthropic": "{field}: {value} > {limit}, which is the maximum allowed number of "
                           "output tokens for mlx-mtp-demo"}


def refused_in_words(message, surface, field, value):
    if field in ("max_tokens", "max_completion_tokens") and value == LIMIT + 1:
        assert message == OVER_LIMIT[surface].format(field=field, value=value, limit=LIMIT)
    else:
        assert message.startswith(f"{field} must be ") and f"not {value}" in message


def openai_refusal(r, field, value):
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == field
    refused_in_words(error["message"], "openai", field, value)
    assert "\n" not in error["message"]


OPENAI = http_cases("openai")


@pytest.mark.parametrize("field,at,past", OPENAI, ids=ids(OPENAI))
def test_openai(srv, field, at, past):
    r = post_openai(srv, field, at)
    assert r.status_code == 200, r.text
    assert r.json()["choices"]
    openai_refusal(post_openai(srv, field, past), field, past)
    openai_refusal(post_openai(srv, field, past, "/v1/completions"), field, past)


ANTHROPIC = http_cases("anthropic")


@pytest.mark.parametrize("field,at,past", ANTHROPIC, ids=ids(ANTHROPIC))
def test_anthropic(srv, field, at, past):
    r = post_anthropic(srv, field, at)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    r = post_anthropic(srv, field, past)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    refused_in_words(body["error"]["message"], "anthropic", field, past)


# the review's cases (issue 26), wrong types, and numbers that are not JSON
@pytest.mark.parametrize("field,value,words", [
    ("num_draft_tokens", 99, "num_draft_tokens must be in 0..16 or 'auto', not 99"),
    ("xtc_threshold", 0.9, "xtc_threshold must be in [0, 0.5], not 0.9"),
    ("temperature", 1e9, "temperature must be in [0, 100], not 1000000000.0"),
    ("top_k", 5.0, "top_k must be an integer, not 5.0"),
    ("seed", -1, "seed must be in 0..18446744073709551615, not -1"),
])
def test_openai_review_cases(srv, field, value, words):
    r = post_openai(srv, field, value)
    openai_refusal(r, field, value)
    assert r.json()["error"]["message"] == words


def test_null_auto_and_not_json(srv):
    for field, value in [("num_draft_tokens", None), ("num_draft_tokens", "auto"),
                         ("seed", None), ("xtc_probability", 1)]:
        assert post_openai(srv, field, value).status_code == 200, (field, value)
    raw = '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    r = requests.post(srv.url + "/v1/chat/completions", data=raw, timeout=60)
    assert r.status_code == 400 and "NaN is not a JSON number" in r.json()["error"]["message"]
    raw = '{"model": "m", "max_tokens": 1, "messages": [], "top_p": Infinity}'
    r = requests.post(srv.url + "/v1/messages", data=raw, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "Infinity is not a JSON number" in r.json()["error"]["message"]


# -- environment flags: one truth table (params.env_flag), read where each one acts ----------
ON, OFF = ("1", "true", "TRUE", "yes", "On"), ("0", "false", "False", "no", "OFF", " off ")


def _readers(monkeypatch, tmp_path):
    """Each flag's reader where it acts: flag -> a function of no arguments
    giving what the flag decides there."""
    from mlx_mtp import metal, quantized, rows, schedule

    monkeypatch.setattr(metal, "backend", lambda: "metal")
    monkeypatch.setattr(quantized, "share_weight_reads", lambda model: 1)

    def converter_raises() -> bool:
        from mlx_mtp.convert.__main__ import main

        try:
            main(["--hf-path", str(tmp_path / "missing"), "--mlx-path", str(tmp_path / "out")])
        except Exception:
            return True
        return False

    return {"MLX_MTP_DISABLE": schedule.mtp_disabled_by_env,
            "MLX_MTP_QMV_ROWS": lambda: quantized.use_shared_reads(None) == 1,
            "MLX_MTP_FAST_KERNELS": metal.fused_default,
            "MLX_MTP_CHECK_COUNTS": lambda: rows.Ledger().checking,
            "MLX_MTP_DEBUG": converter_raises}


@pytest.mark.parametrize("flag", list(params.ENV_FLAGS))
def test_each_environment_flag_reads_one_truth_table(flag, monkeypatch, tmp_path):
    reader = _readers(monkeypatch, tmp_path)[flag]
    for value in ON:
        monkeypatch.setenv(flag, value)
        assert reader() is True, (flag, value)
    for value in OFF:
        monkeypatch.setenv(flag, value)
        assert reader() is False, (flag, value)
    monkeypatch.delenv(flag, raising=False)
    assert reader() is params.ENV_FLAGS[flag][0]
    monkeypatch.setenv(flag, "maybe")
    with pytest.raises(ValueError, match=f"{flag} must be one of"):
        params.env_flag(flag)
