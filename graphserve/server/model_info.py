"""What SGLang's and vLLM's clients ask the server about its model: cards for /v1/models, model and tokenizer
paths for /get_model_info, settings for /get_server_info.

Clients load a tokenizer from what these say (guidellm from the served name, SGLang's bench from
``tokenizer_path``), so every source has a folder to point at: an HF folder is itself, ``builtin:NAME`` is
its unpacked folder, and a ``dummy:`` preset's synthetic tokenizer is saved once under the cache folder.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from graphserve import env
from graphserve.server.state import ServerState

STARTED = int(time.time())


def cache_dir() -> Path:
    return env.path("GRAPHSERVE_CACHE")


def tokenizer_folder(source: str) -> str:
    """Where the tokenizer of a model source lies on disk (a dummy: preset's once tokenizer_path saved it; a GGUF
    file's, converted from its metadata, once the model loaded)."""
    from graphserve.models.gguf_checkpoint import is_gguf, tokenizer_cache
    from graphserve.models.trained import resolve_source

    source = resolve_source(source)
    if is_gguf(source):
        return str(tokenizer_cache(Path(source).expanduser()))
    if source.startswith("builtin:"):
        from graphserve.models.builtin import ensure_builtin

        return str(ensure_builtin(source.removeprefix("builtin:")))
    if source.startswith("dummy:"):
        return str(cache_dir() / "tokenizers" / source.replace(":", "-"))
    return str(Path(source).expanduser().resolve())


def default_served_name(source: str) -> str:
    """The name /v1/models gives a model served without --served-model-name. Benchmark tools (guidellm, SGLang's
    bench_serving) load their tokenizer from it, and ``builtin:NAME`` is no path they can load: built-in and
    dummy models are named by their tokenizer folder (requests may still say ``builtin:NAME``)."""
    if source.startswith(("builtin:", "dummy:")):
        return tokenizer_folder(source)
    return source


def tokenizer_path(state: ServerState) -> str:
    """A folder AutoTokenizer.from_pretrained loads this server's tokenizer from."""
    source = state.engine.config.model
    if source.startswith("dummy:"):
        folder = Path(tokenizer_folder(source))
        if not folder.exists():  # written aside, then renamed: two servers starting together never mix files
            staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
            staging.parent.mkdir(parents=True, exist_ok=True)
            state.engine.tokenizer.save_pretrained(str(staging))
            try:
                staging.rename(folder)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)  # the other server got there first
        return str(folder)
    return tokenizer_folder(source)


def max_model_len(state: ServerState) -> int | None:
    processor = state.engine.input_processor
    return None if processor is None else processor.max_model_len


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models entries in vLLM's shape: every name a request may use, the response name first."""
    names = [state.model_name, *sorted(state.accepted_names - {state.model_name})]
    return [{"id": name, "object": "model", "created": STARTED, "owned_by": "graphserve",
             "root": state.engine.config.model, "parent": None, "max_model_len": max_model_len(state)}
            for name in names]


def version() -> str:
    try:
        return metadata.version("graphserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def model_info(state: ServerState) -> dict[str, Any]:
    return {"model_path": state.engine.config.model, "tokenizer_path": tokenizer_path(state),
            "served_model_name": state.model_name, "is_generation": True, "max_model_len": max_model_len(state)}


def server_info(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(engine.config).items()}
    stats = engine.stats
    return {
        **config, **model_info(state), "version": version(),
        "max_total_num_tokens": engine.kv_capacity_tokens(),
        "internal_states": [{
            "num_running_reqs": int(getattr(stats, "running", 0)),
            "num_waiting_reqs": int(getattr(stats, "waiting", 0)),
            "kv_cache_usage": float(getattr(stats, "kv_usage", 0.0)),
        }],
    }
