"""MTP decoding on a model sharded over `mx.distributed` ranks (`mlx.launch`).

`sharded_load` is mlx_lm's `sharded_load` for a model with its MTP head: the
trunk is sharded by mlx_lm's own `shard()` (tensor parallel) or
`model.pipeline()` (pipeline parallel); the head is replicated on every rank
(one decoder layer: drafting then costs no collective at all). Every rank
runs the same decode loop in lockstep; the decisions that steer it — the
first token, the drafts, the accepted count and the emitted tokens — come
from rank 0 through one `all_sum` each (`share`), so ranks never depend on
computing equal floats, and the adaptive depth controller's switches are
agreed the same way (`agree`). See docs/distributed.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream

from .cache import cache_length
from .checkpoint import (WEIGHT_INDEX, CheckpointError, read_weight_map, safetensors_header,
                         text_config, weight_files)
from .loader import DOWNLOAD_PATTERNS, load, read_config, resolve_model_path

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def world() -> Optional[mx.distributed.Group]:
    """The launch's group when there is more than one rank, else None."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def share(x: mx.array, group: Optional[mx.distributed.Group], src: int = 0) -> mx.array:
    """Rank `src`'s value of `x` on every rank (one all_sum; identity alone)."""
    if group is None:
        return x
    # computed from x on every rank: a graph's collectives then run in the same
    # order on all ranks (an input-free all_sum could be scheduled first)
    mine = mx.where(mx.array(group.rank() == src), x, mx.zeros_like(x))
    return mx.distributed.all_sum(mine, group=group).astype(x.dtype)


def first_stage(model) -> Optional[int]:
    """The rank that embeds the tokens when the model is split into pipeline
    stages (mlx_lm gives the first layers to the last rank), else None."""
    tm = model.text_model
    size = getattr(tm, "pipeline_size", 1)
    return size - 1 if size > 1 else None


def agree(value: int, group: Optional[mx.distributed.Group]) -> int:
    """Rank 0's host-side integer on every rank (a blocking all_sum)."""
    if group is None:
        return value
    return int(share(mx.array(value, dtype=mx.int32), group).item())


def trunk_length(prompt_cache: list, model) -> int:
    """Tokens in a prompt cache's trunk, the same on every rank. A pipeline
    stage holding only GDN layers has no KV offset to read it from (a GDN
    state does not count its tokens), so on a model with such a stage
    (`model.length_group`, set by `sharded_load`) the stages take the largest
    of their counts: every stage's cache has seen the same tokens, and each
    stage with an attention layer counts them (one blocking all_max)."""
    length = cache_length(prompt_cache, model.is_linear)
    if model.length_group is None:
        return length
    # on the generation stream, after the loop's queued collectives: one order on all ranks
    with mx.stream(generation_stream):
        agreed = mx.distributed.all_max(mx.array(length, dtype=mx.int32),
                                        group=model.length_group)
        return int(agreed.item())


def kept_on_every_stage(hiddens: list, model) -> list:
    """Trunk hiddens kept in prompt caches (`cache.last_hidden`, one per
    cache), each dropped on every rank where one rank dropped it. A stage
    holding only GDN layers cannot tell that mlx_lm decoded on a cache since
    its hidden was kept (it counts no tokens); the stages with attention
    layers can. The heads must stay alike on all ranks: rank 0 accepts the
    first stage's drafts by its own head's probabilities. Every rank calls it
    at the same point (one all_min)."""
    if model.length_group is None:
        return hiddens
    with mx.stream(generation_stream):  # (see trunk_length)
        kept = mx.array([h is not None for h in hiddens], dtype=mx.int32)
        kept = mx.distributed.all_min(kept, group=model.length_group).tolist()
    return [h if k else None for h, k in zip(hiddens, kept)]


def stage_layers(num_layers: int, group) -> tuple:
    """The layers [start, end) this rank runs as a pipeline stage, by mlx_lm's
    own split (`PipelineMixin.pipeline`), before any model is built."""
    from .mlx_lm_compat import PipelineMixin

    stage = PipelineMixin()
    stage.layers = [None] * num_layers
    stage.pipeline(group)
    return stage.start_idx, stage.end_idx


def _stage_tensors(weight_map: Dict[str, str], start: int, end: int) -> Dict[str, list]:
    """The tensors pipeline stage [start, end) reads, by file: its layers',
    the embeddings / norm / lm_head, and the MTP head's (`mtp.*`, which every
    rank keeps). Layers are matched by number, as mlx_lm's sharded_load
    does: sanitize may rename tensors, never renumber a layer."""
    files: Dict[str, list] = {}
    for name, file in weight_map.items():
        m = None if name.startswith("mtp.") else _LAYER.search(name)
        if m is None or start <= int(m.group(1)) < end:
            files.setdefault(file, []).append(name)
    return files


def _local_files(model_path: Path, start: int, end: int) -> Optional[set]:
    """The safetensors files pipeline stage [start, end) needs (see
    _stage_tensors). None when the checkpoint has no index (one file)."""
    weight_map = read_weight_map(model_path)
    if weight_map is None:
        return None
    return set(_stage_tensors(weight_map, start, end))


def _num_layers(model_path: Path) -> int:
    """The trunk's layer count from a model folder's config."""
    config = read_config(model_path)
    n = text_config(config).get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise CheckpointError(f"{model_path / 'config.json'}: num_hidden_layers must be a "
                              f"positive integer, not {n!r}")
    return n


def check_files(model_path: Path, start: int, end: int, share: str) -> None:
    """Before a lenient load: every file of the checkpoint's index that this
    rank's share (layers [start, end)) reads is there, whole, and holds the
    tensors the index puts in it. Raises one line naming the file and a
    tensor (FileNotFoundError, or CheckpointError as `load` does)."""
    weight_map = read_weight_map(model_path)
    if weight_map is None:  # one file: `load` requires it (its glob finds none otherwise)
        return
    for file, names in sorted(_stage_tensors(weight_map, start, end).items()):
        path = model_path / file
        if not path.exists():
            raise FileNotFoundError(f"{path} (listed in {WEIGHT_INDEX}) is missing: this "
                                    f"rank's {share} needs its tensor {sorted(names)[0]}")
        header = safetensors_header(path)  # truncated: names the file and the tensor
        absent = sorted(set(names) - header.keys())
        if absent:
            raise CheckpointError(f"{path}: tensor {absent[0]} (listed in {WEIGHT_INDEX}) is "
                                  "missing from the file")


def check_loaded(model, model_path: Path, share: str) -> None:
    """After a lenient load and the split: every parameter this rank keeps was
    set from the checkpoint with its shape (`model.unset_weights`); one that
    kept its random init raises one line naming it (and the file, when the
    checkpoint is one file)."""
    kept = tree_flatten(model.parameters(), destination={})
    unset = sorted(name for name in model.unset_weights or {} if name in kept)
    if unset:
        # the file when the checkpoint is one; with an index, the folder (sanitize
        # renames tensors, so which file held this weight is not known here)
        files = [] if read_weight_map(model_path) is not None else weight_files(model_path)
        where = files[0] if len(files) == 1 else model_path
        name = unset[0]
        raise CheckpointError(f"{where}: weight {name} {model.unset_weights[name]} (this "
                              f"rank's {share} needs it)")


def sharded_load(
    path_or_hf_repo,
    pipeline_group: Optional[mx.distributed.Group] = None,
    tensor_group: Optional[mx.distributed.Group] = None,
    return_config: bool = False,
    *,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    ngram_tables: str = "auto",
):
    """mlx_lm's `sharded_load` with the MTP head: load this rank's share of
    the model (tensor parallel by default, pipeline with `pipeline_group`),
    the head replicated. Weights load lazily, so a rank reads only the
    tensors it keeps (and, from the Hub, downloads only the files with them).
    Decode it with `mlx_mtp.stream_generate` / `generate` / `generate_step`
    on every rank. `ngram_tables`: as `mlx_mtp.load`'s, tensor parallel
    (each rank reads its block of rows from disk); a pipeline keeps them in
    memory ('disk' is refused)."""
    if pipeline_group is None and tensor_group is None:
        tensor_group = mx.distributed.init()
    model_path = _resolve_for(path_or_hf_repo, pipeline_group)
    pipelined = pipeline_group is not None and pipeline_group.size() > 1
    if pipelined and ngram_tables == "disk":
        # a stage's host read of its n-gram ids waits on the previous stage's
        # send, which the loop's lookahead may leave unsent: the ranks hang
        # (docs/distributed.md, "qwen4_exp")
        raise ValueError("n-gram tables on disk are not supported with pipeline parallelism "
                         "yet: use tensor parallelism or --ngram-tables memory")
    if pipelined:
        ngram_tables = "memory"  # ('auto' as well, for the same reason)
    # The load is lenient (a pipeline stage has only its own files from the
    # Hub), so this rank checks that its share is all there: the files it
    # reads before, and every parameter it keeps after (a missing one would
    # silently keep its random init).
    if pipelined:
        start, end = stage_layers(_num_layers(model_path), pipeline_group)
        share = f"pipeline stage (layers {start}-{end - 1})"
    else:
        start, end, share = 0, _num_layers(model_path), "tensor-parallel share"
    check_files(model_path, start, end, share)
    model, tokenizer, config = load(model_path, tokenizer_config, lazy=True, return_config=True,
                                    strict=False, quiet=mx.distributed.init().rank() != 0,
                                    ngram_tables=ngram_tables)
    if tensor_group is not None and tensor_group.size() > 1:
        if not hasattr(model, "shard"):
            raise ValueError(f"{config['model_type']} models have no tensor parallelism in "
                             "mlx_lm; launch with --pipeline")
        model.shard(tensor_group)
    if pipelined:
        model.text_model.pipeline(pipeline_group)
    check_loaded(model, model_path, share)  # before any collective: a failing rank stops alone
    if pipelined:
        # a stage holding only GDN layers keeps no count of its tokens (see
        # trunk_length); every rank learns whether any stage is such a one
        without_attention = mx.distributed.all_sum(
            mx.array(int(all(model.is_linear))), group=pipeline_group, stream=mx.cpu)
        if without_attention.item():
            model.length_group = pipeline_group
    model.distributed_group = world()
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # every rank loaded
    if return_config:
        return model, tokenizer, config
    return model, tokenizer


def _resolve_for(path_or_hf_repo, pipeline_group) -> Path:
    """A local folder as it is; a Hub repo downloaded without the weight
    files other pipeline stages keep."""
    local = Path(str(path_or_hf_repo)).expanduser()
    if path_or_hf_repo is None or local.exists() or pipeline_group is None:
        return resolve_model_path(path_or_hf_repo)
    from huggingface_hub import snapshot_download

    patterns = [p for p in DOWNLOAD_PATTERNS if p != "*.safetensors"]
    model_path = Path(snapshot_download(str(path_or_hf_repo), allow_patterns=patterns))
    files = _local_files(model_path, *stage_layers(_num_layers(model_path), pipeline_group))
    return Path(snapshot_download(str(path_or_hf_repo),
                                  allow_patterns=sorted(files) if files else ["*.safetensors"]))
