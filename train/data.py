"""Corpus and tokenizer for the demo model (CPython standard library sources).

Deterministic: the file list is the sorted relative paths of the stdlib's
`*.py` files (tests, codec tables and generated data excluded); a file is
held out when the first byte of sha256(relative path) is < 13 (about 5%),
so the split does not depend on which other files exist. Documents are
joined with `<|endoftext|>`.

Chat examples: the `mlx_mtp.generate` CLI applies the tokenizer's chat
template by default, so part of the training stream teaches the model that
template: the user turn is a function's signature (`def name(args):`) taken
from a training file, the assistant turn is the whole function, dedented.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import List, Optional, Tuple

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The usual Qwen ChatML template (as mlx_mtp/testing/synthetic.py's).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

EXCLUDED_DIRS = {
    "test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data",
    "__pycache__", "lib2to3", "turtledemo", "ensurepip", "distutils",
}
EXCLUDED_NAME_PREFIXES = ("_sysconfigdata", "config-")
MAX_FILE_BYTES = 400_000

# Named corpora. "stdlib" is every file above (the first two training stages);
# "algo" is a coherent slice of it for the third: small, well-written
# pure-Python modules of algorithms, text and data handling (~1.3M characters),
# the style the demo is meant to write. The held-out rule is the same, so its
# held-out files (sched, secrets, traceback, chunk) are in the style too.
CORPORA = {
    "stdlib": None,
    "algo": (
        "heapq.py", "bisect.py", "statistics.py", "fractions.py", "textwrap.py",
        "string.py", "functools.py", "collections/__init__.py", "random.py",
        "difflib.py", "shlex.py", "json/__init__.py", "json/encoder.py",
        "json/decoder.py", "csv.py", "graphlib.py", "copy.py", "pprint.py",
        "reprlib.py", "calendar.py", "colorsys.py", "operator.py", "contextlib.py",
        "numbers.py", "glob.py", "fnmatch.py", "posixpath.py", "genericpath.py",
        "queue.py", "sched.py", "base64.py", "quopri.py", "html/__init__.py",
        "html/parser.py", "urllib/parse.py", "tokenize.py", "gettext.py",
        "weakref.py", "_collections_abc.py", "abc.py", "secrets.py", "hmac.py",
        "uuid.py", "linecache.py", "traceback.py", "types.py", "cmd.py",
        "timeit.py", "filecmp.py", "fileinput.py", "netrc.py", "getopt.py",
        "tomllib/_parser.py", "dataclasses.py", "ipaddress.py", "chunk.py",
        "keyword.py", "stat.py", "selectors.py", "_strptime.py",
    ),
}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < 13


def list_files(root: Path = None) -> List[Tuple[str, Path]]:
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(d in EXCLUDED_DIRS or d.startswith(EXCLUDED_NAME_PREFIXES) for d in parts[:-1]):
            continue
        if parts[-1].startswith(EXCLUDED_NAME_PREFIXES):
            continue
        if p.stat().st_size > MAX_FILE_BYTES or p.stat().st_size < 200:
            continue
        out.append((rel, p))
    out.sort()
    return out


def read_text(p: Path):
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def split_corpus(root: Path = None, corpus: str = "stdlib"):
    """-> (train_docs, heldout_docs) as lists of (relpath, text)."""
    keep = CORPORA[corpus]
    train, held = [], []
    for rel, p in list_files(root):
        if keep is not None and rel not in keep:
            continue
        text = read_text(p)
        if text is None:
            continue
        (held if is_heldout(rel) else train).append((rel, text))
    return train, held


def function_examples(docs, max_chars: int = 1200, min_lines: int = 1,
                      classes: bool = False) -> List[Tuple[str, str]]:
    """(signature, dedented source) for the functions of the given docs with at
    least `min_lines` lines and at most `max_chars` characters. With `classes`,
    also each class whose header is one line, as its header and the leading
    statements of its body that fit in `max_chars` (whole statements, at least
    one method): the opening a user prompt like `class Matrix:` asks for."""
    out = []
    for _, text in docs:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if classes and isinstance(node, ast.ClassDef):
                ex = _class_opening(node, lines, max_chars)
                if ex is not None and ex[1].count("\n") + 1 >= min_lines:
                    out.append(ex)
                continue
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if not node.body or node.body[0].lineno <= node.lineno:
                continue
            # skip functions whose signature spans several lines
            if node.body[0].lineno - node.lineno > 1 and not isinstance(node.body[0], ast.Expr):
                continue
            head = lines[node.lineno - 1].strip()
            if not head.endswith(":"):
                continue
            src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            src = textwrap.dedent(src)
            if len(src) > max_chars or src.count("\n") + 1 < min_lines:
                continue
            out.append((head, src))
    return out


def _class_opening(node, lines, max_chars):
    if node.decorator_list or not node.body or node.body[0].lineno <= node.lineno:
        return None
    head = lines[node.lineno - 1].strip()
    if not head.endswith(":") or node.body[0].lineno - node.lineno > 1:
        return None
    end, methods = None, 0
    for stmt in node.body:
        src = textwrap.dedent("\n".join(lines[node.lineno - 1 : stmt.end_lineno]))
        if len(src) > max_chars:
            break
        end = stmt.end_lineno
        methods += isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
    if end is None or methods == 0:
        return None
    return head, textwrap.dedent("\n".join(lines[node.lineno - 1 : end]))


def name_words(docs, min_count: int = 3) -> List[str]:
    """Words of the docs' identifiers (snake_case parts, 3-10 letters, not
    Python keywords or builtins), for renamed examples."""
    import builtins
    import keyword
    from collections import Counter

    skip = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls", "the", "and", "for", "not"}
    counts = Counter(w for _, text in docs
                     for ident in re.findall(r"\b[a-z_][a-z0-9_]{2,}\b", text)
                     for w in ident.split("_") if 3 <= len(w) <= 10 and w.isalpha())
    return sorted(w for w, n in counts.items() if n >= min_count and w not in skip)


def renamed(examples, rng: random.Random, words: List[str], copies: int):
    """Each example `copies` more times under a new name (the def's or class's
    name replaced everywhere in it by 1-3 random words: snake_case for a
    function, CamelCase for a class), so the model learns to write what the
    prompt names, not the name it remembers for that body."""
    out = []
    for sig, src in examples:
        m = re.match(r"(?:async\s+)?(def|class)\s+([A-Za-z_]\w*)", sig)
        if m is None:
            continue
        kind, name = m.groups()
        for _ in range(copies):
            parts = rng.sample(words, rng.randint(1, 3))
            new = ("".join(w.capitalize() for w in parts) if kind == "class"
                   else "_".join(parts))
            pattern = re.compile(r"\b" + re.escape(name) + r"\b")
            out.append((pattern.sub(new, sig), pattern.sub(new, src)))
    return out


def rename_identifiers(source: str, rng: random.Random, words: List[str]) -> Optional[str]:
    """`source` with every name it binds or uses renamed, consistently, to 1-3
    random words (snake_case; CamelCase for a capitalised name): the function
    or class, its parameters, its locals. Kept: keywords, builtins, `self` /
    `cls`, dunder names, the standard library's module names, attributes
    (after a dot, whose owner may live elsewhere), strings and comments.
    Predicting a renamed name's second use needs what came before it in the
    window: the model learns to copy names from its context (the prompt's
    signature into its answer, parameters into the body), which memorised
    bodies never teach. None when the source does not tokenize."""
    import builtins
    import io
    import keyword
    import tokenize

    keep = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"} | set(
        getattr(sys, "stdlib_module_names", ()))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    mapping, edits, previous = {}, [], None
    # new names differ from each other and from every name the source keeps
    taken = keep | {t.string for t in tokens if t.type == tokenize.NAME}
    for tok in tokens:
        if (tok.type == tokenize.NAME and tok.string not in keep
                and not (tok.string.startswith("__") and tok.string.endswith("__"))
                and not (previous is not None and previous.string == ".")):
            new = mapping.get(tok.string)
            if new is None:
                while new is None or new in taken:  # two names never become one
                    parts = rng.sample(words, rng.randint(1, 3))
                    new = ("".join(w.capitalize() for w in parts) if tok.string[:1].isupper()
                           else "_".join(parts))
                mapping[tok.string] = new
                taken.add(new)
            edits.append((tok.start, tok.end, new))
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT,
                            tokenize.DEDENT):
            previous = tok
    lines = source.split("\n")
    for (row, c0), (_, c1), new in reversed(edits):
        line = lines[row - 1]
        lines[row - 1] = line[:c0] + new + line[c1:]
    return "\n".join(lines)


def renamed_everywhere(examples, rng: random.Random, words: List[str], copies: int):
    """Each example `copies` more times with its names renamed
    (`rename_identifiers`); the signature follows its source's first line."""
    out = []
    for sig, src in examples:
        for _ in range(copies):
            new = rename_identifiers(src, rng, words)
            if new is not None:
                out.append((new.split("\n", 1)[0].strip(), new))
    return out


def chat_text(signature: str, source: str) -> str:
    return (f"<|im_start|>user\n{signature}<|im_end|>\n"
            f"<|im_start|>assistant\n{source}<|im_end|>\n")


def build_documents(train_docs, seed: int, chat_fraction: float, renames: int = 0,
                    identifier_renames: int = 0, **examples):
    """Training documents: files plus chat examples (`function_examples`'
    options in `examples`; each also `renames` times under a new name, and
    `identifier_renames` times with all its names renamed), shuffled with
    `seed`."""
    rng = random.Random(seed)
    docs = [t for _, t in train_docs]
    n_chars = sum(map(len, docs))
    ex = function_examples(train_docs, **examples)
    words = name_words(train_docs) if renames or identifier_renames else []
    extra = renamed(ex, rng, words, renames) if renames else []
    if identifier_renames:
        extra += renamed_everywhere(ex, rng, words, identifier_renames)
    ex += extra
    rng.shuffle(ex)
    chat, chars = [], 0
    budget = chat_fraction * n_chars / (1 - chat_fraction)
    for sig, src in ex:
        if chars >= budget:
            break
        t = chat_text(sig, src)
        chat.append(t)
        chars += len(t)
    docs = docs + chat
    rng.shuffle(docs)
    return docs, len(chat)


def train_tokenizer(docs: List[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def encode_stream(tok, texts: List[str]):
    """The documents' token ids as one int32 stream, each ended by <|endoftext|>."""
    import numpy as np

    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.array(ids, dtype=np.int32)


def save_tokenizer(tok, path: Path):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": 1048576,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
