"""`python -m mlx_mtp.generate --json-schema / --regex / --grammar` (cli.py):
the printed text follows the constraint (on a tiny random checkpoint, whose
free text is noise), and a bad one is one `error:` line and exit 2."""

import json
import re

import jsonschema
import pytest

from mlx_mtp import cli
from mlx_mtp.testing.synthetic import write_checkpoint

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


def run(capsys, *argv):
    code = cli.main([*argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("k", ["0", "2"])
def test_json_schema_as_text_and_as_file(dense_ckpt, tmp_path, capsys, k):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for given in (json.dumps(SCHEMA), str(path)):
        code, out, err = run(capsys, "--model", str(dense_ckpt), "--prompt", "hi",
                             "--max-tokens", "80", "--draft-tokens", k, "--json-schema", given)
        assert code == 0, err
        jsonschema.validate(json.loads(out), SCHEMA)


def test_regex_and_grammar(dense_ckpt, tmp_path, capsys):
    code, out, err = run(capsys, "--model", str(dense_ckpt), "--prompt", "hi",
                         "--max-tokens", "40", "--regex", r"(ab|cd){2,5}-[0-9]{3}")
    assert code == 0, err
    assert re.fullmatch(r"(ab|cd){2,5}-[0-9]{3}", out.rstrip("\n")), out
    lark = tmp_path / "answer.lark"
    lark.write_text('start: ("yes" | "no") " because " REASON\nREASON: /[a-z]{1,12}\\./\n')
    code, out, err = run(capsys, "--model", str(dense_ckpt), "--prompt", "hi",
                         "--max-tokens", "40", "--grammar", str(lark), "--draft-tokens", "3")
    assert code == 0, err
    assert re.fullmatch(r"(yes|no) because [a-z]{1,12}\.", out.rstrip("\n")), out


def test_verbose_counts_the_grammars_forced_drafts_and_jumps(dense_ckpt, capsys):
    """--verbose: the MTP line says how many drafts the grammar forced and
    how many runs were verified in one forward (a run of 6 forced letters)."""
    code, out, err = run(capsys, "--model", str(dense_ckpt), "--prompt", "hi", "--verbose",
                         "--max-tokens", "40", "--regex", r"(ab|cd)efghij(k|l)")
    assert code == 0, err
    m = re.search(r"; (\d+) drafts forced by the grammar, (\d+) runs verified in one forward",
                  out)
    assert m and int(m[1]) >= 5 and int(m[2]) >= 1, out


def test_thinking_is_off_under_a_constraint(tmp_path, capsys):
    """A template that would open a think block: the grammar covers the whole
    output, so the CLI asks the template not to think (and says so)."""
    path = write_checkpoint(tmp_path / "thinks", tools="json", thinking=True, seed=7)
    code, out, err = run(capsys, "--model", str(path), "--prompt", "hi", "--max-tokens", "80",
                         "--json-schema", json.dumps(SCHEMA))
    assert code == 0, err
    assert "thinking is off" in err
    jsonschema.validate(json.loads(out), SCHEMA)


@pytest.mark.parametrize("argv,words", [
    (["--regex", "(ab"], "argument --regex: cannot use this regex"),
    (["--json-schema", '{"type": "nope"}'], "invalid JSON schema"),
    (["--json-schema", '{"type": "array", "uniqueItems": true}'], "uniqueItems"),
    (["--json-schema", '{"type": '], "json_schema is not valid JSON"),
    (["--json-schema", '{"patternProperties": {"^x_": {"type": "integer"}}, "minProperties": 2}'],
     "minProperties"),
    (["--json-schema", "no/such/file.json"], "not a file or a JSON object"),
    (["--grammar", "no/such/file.lark"], "not a file"),
    (["--regex", "a", "--json-schema", "{}"], "not allowed with argument"),
])
def test_a_bad_constraint_is_one_error_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.setup_arg_parser().parse_args(argv)
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert len(lines) == 1 and words in lines[0], lines


def test_a_bad_grammar_file_is_one_error_line(tmp_path, capsys):
    lark = tmp_path / "bad.lark"
    lark.write_text("start: undefined_rule\n")
    with pytest.raises(SystemExit) as e:
        cli.setup_arg_parser().parse_args(["--grammar", str(lark)])
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert len(lines) == 1 and "cannot use this Lark grammar" in lines[0], lines
