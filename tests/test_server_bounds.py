"""The server's memory and latency bounds (server/lane.py, generation.py):
mlx_lm's warning about tools on a template without tool calling is said once
per process, not on every render."""

import logging
from types import SimpleNamespace

from mlx_mtp.mlx_lm_compat import CompletionRequest
from mlx_mtp.server.generation import ONCE_PER_PROCESS, MTPResponseGenerator

TOOLS_WARNING = "Received tools but model does not support tool calling"


def test_the_tools_warning_is_logged_once_per_process(caplog):
    """Every render of a request with tools on a template without tool
    calling (a client sends its tools with every turn) made mlx_lm log it;
    the tools still reach the template."""
    given = []
    tokenizer = SimpleNamespace(
        has_chat_template=True, has_tool_calling=False, has_thinking=False,
        response_initial_state=None,
        apply_chat_template=lambda messages, **kw: given.append(kw.get("tools")) or [1, 2, 3])
    gen = MTPResponseGenerator.__new__(MTPResponseGenerator)  # (no generation thread)
    gen.model_provider = SimpleNamespace(processor=None,
                                         cli_args=SimpleNamespace(chat_template_args={}))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = CompletionRequest("chat", "", [{"role": "user", "content": "hi"}], tools, None)
    ONCE_PER_PROCESS._seen.clear()  # (another test in this process may have said it)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            out = gen._tokenize(tokenizer, request, SimpleNamespace(chat_template_kwargs=None))
            assert out[0] == [1, 2, 3]
    assert caplog.text.count(TOOLS_WARNING) == 1, caplog.text
    assert given and all(t == tools for t in given)
