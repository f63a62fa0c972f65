"""``load_model``: a model source (HF folder, ``builtin:``, ``dummy:``) -> model, tokenizer, facts."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from graphserve.config import EngineConfig
from graphserve.errors import ConfigError, ModelLoadError
from graphserve.layers.kv_layout import KVLayout, with_block_size, with_cache_dtype
from graphserve.layers.moe import FusedMoE
from graphserve.layers.quant.config import (
    Fp8Config,
    IgnoreList,
    online_config,
    parse_quantization_config,
    quantized_description,
    resolve_quantization,
)
from graphserve.layers.quant.fp4 import prepare_fp4_linears, quantize_fp4_linears
from graphserve.layers.quant.fp4_config import Fp4Config, check_fp4_device, fp4_ignore_list, modelopt_file_config
from graphserve.layers.quant.fp4_moe import quantize_fp4_experts
from graphserve.layers.quant.fp4_to_fp8 import check_fp4_load_as, convert_fp4_model, fp8_description
from graphserve.layers.quant.fp8 import quantize_linears
from graphserve.layers.quant.fp8_moe import quantize_experts
from graphserve.models.builtin import ensure_builtin
from graphserve.models.description import ModelDescription
from graphserve.models.gguf_checkpoint import GGUFFile, gguf_tokenizer, is_gguf
from graphserve.models.llama import sliding_window_of
from graphserve.models.presets import get_preset_config, get_preset_tokenizer_spec
from graphserve.models.registry import resolve_model_class
from graphserve.models.synthetic_tokenizer import CHAT_TEMPLATES, build_synthetic_tokenizer
from graphserve.models.trained import resolve_source
from graphserve.models.weights import iter_safetensors, safetensors_files

logger = logging.getLogger("graphserve.models")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model the engine reads; its cache and footprint come from the family's
    ``describe`` (models/description.py), never from a Llama-shaped assumption."""

    architecture: str
    num_layers: int
    num_heads: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: list[int]
    tie_word_embeddings: bool
    num_params: int
    description: ModelDescription

    @property
    def kv(self) -> KVLayout:
        return self.description.kv

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer's cache for one token (K and V heads, or one latent)."""
        return self.kv.bytes_per_token

    @property
    def num_kv_heads(self) -> int:
        return self.kv.num_heads

    @property
    def head_dim(self) -> int:
        return self.kv.head_dim


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: PretrainedConfig
    tokenizer: Any
    info: ModelInfo
    chat_template: str | None


def resolve_dtype(requested: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU; on CUDA the checkpoint's bf16/fp16, else bfloat16."""
    if requested != "auto":
        return _DTYPES[requested]
    if device.type != "cuda":
        return torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


def load_model(config: EngineConfig, device: torch.device) -> LoadedModel:
    device = torch.device(device)
    source = resolve_source(config.model)
    if source.startswith("dummy:"):
        return _load_dummy(config, source.removeprefix("dummy:"), device)
    if is_gguf(source):
        return _load_gguf(config, GGUFFile(source), device)
    if source.startswith("builtin:"):
        return _load_folder(config, ensure_builtin(source.removeprefix("builtin:")), device)
    return _load_folder(config, Path(source).expanduser(), device)


def meta_model(config: EngineConfig) -> nn.Module:
    """The model ``load_model`` would build for a CPU, on the meta device: its sizes, with no weight allocated
    or read (host_memory.py checks them against the machine before a load)."""
    source = resolve_source(config.model)
    quant = online_config(config.quantization)
    if source.startswith("dummy:"):
        raw = get_preset_config(source.removeprefix("dummy:"))
        hf_config = AutoConfig.for_model(**raw)
    elif is_gguf(source):  # the file's metadata is its config; its tensors are not read
        raw = GGUFFile(source).hf_config()
        hf_config = AutoConfig.for_model(**raw)
    else:
        folder = ensure_builtin(source.removeprefix("builtin:")) if source.startswith("builtin:") else \
            Path(source).expanduser()
        _check_folder(folder)
        raw = json.loads((folder / "config.json").read_text())
        try:
            hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"model folder {folder} cannot be read by transformers: {e}", param="model") from e
        quant = resolve_quantization(parse_quantization_config(raw.get("quantization_config")), config.quantization)
    model, _ = _build(resolve_model_class(raw.get("architectures")), hf_config, config, torch.device("meta"), quant)
    if check_fp4_load_as(config.fp4_load_as, quant, source):
        convert_fp4_model(model, quant)  # the FP8 it will hold
    return model


def load_tokenizer(source: str) -> Any:
    """The tokenizer ``load_model`` would pair with ``source`` (an HF folder, ``builtin:NAME`` or
    ``dummy:PRESET``), without building the model or reading any weights.

    A server that runs the engine in another process, and the bench client, tokenize with this.
    """
    source = resolve_source(source)
    if source.startswith("dummy:"):
        preset = source.removeprefix("dummy:")
        return _dummy_tokenizer(preset, AutoConfig.for_model(**get_preset_config(preset)))
    if is_gguf(source):
        return gguf_tokenizer(source)
    folder = ensure_builtin(source.removeprefix("builtin:")) if source.startswith("builtin:") else \
        Path(source).expanduser()
    _check_folder(folder, config=False)  # a tokenizer-only folder (what /get_model_info hands out) is enough
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"model folder {folder} cannot be read by transformers: {e}", param="model") from e


def _dummy_tokenizer(preset: str, hf_config: PretrainedConfig) -> Any:
    spec = get_preset_tokenizer_spec(preset)
    return build_synthetic_tokenizer(
        hf_config.vocab_size, spec["specials"], spec["bos"], spec["eos"], CHAT_TEMPLATES[spec["chat"]]
    )


def _check_folder(folder: Path, config: bool = True) -> None:
    """A model folder: config.json (unless ``config`` is False, as for a tokenizer-only folder), then a
    tokenizer file."""
    if not folder.is_dir():
        raise ModelLoadError(f"model={str(folder)!r} is not a folder (nor builtin:<name> or dummy:<preset>)", param="model")
    if config and not (folder / "config.json").is_file():
        raise ModelLoadError(f"config.json is missing from model folder {folder}", param="model")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"tokenizer.json (or another tokenizer file) is missing from model folder {folder}",
                             param="model")


def _load_folder(config: EngineConfig, folder: Path, device: torch.device) -> LoadedModel:
    _check_folder(folder)
    raw = json.loads((folder / "config.json").read_text())
    model_cls = resolve_model_class(raw.get("architectures"))
    files = safetensors_files(folder)
    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"model folder {folder} cannot be read by transformers: {e}", param="model") from e
    # ModelOpt writes its quantization beside config.json (hf_quant_config.json) where config.json has none; the
    # family reads it from its config as it would config.json's (DeepSeek's kv_b_proj, dequantized at load)
    raw_quant = raw.get("quantization_config") or modelopt_file_config(folder)
    if raw_quant is not None and getattr(hf_config, "quantization_config", None) is None:
        hf_config.quantization_config = raw_quant
    quant = resolve_quantization(parse_quantization_config(raw_quant), config.quantization)
    as_fp8 = check_fp4_load_as(config.fp4_load_as, quant, str(folder))
    model, dtype = _build(model_cls, hf_config, config, device, quant)
    loaded = model.load_weights(iter_safetensors(files))
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint in {folder} lacks {len(missing)} tensors: {shown}", param="model")
    if as_fp8:
        convert_fp4_model(model, quant)
    eos = _eos_ids(hf_config, tokenizer, _generation_eos(folder))
    return _finish(model, hf_config, tokenizer, dtype, eos, quant, config.kv_cache_dtype, config.block_size, as_fp8)


def _load_gguf(config: EngineConfig, file: GGUFFile, device: torch.device) -> LoadedModel:
    """A GGUF file: its metadata is the config, its tensors are dequantized to the model dtype as they load."""
    raw = file.hf_config()
    model_cls = resolve_model_class(raw["architectures"])
    hf_config = AutoConfig.for_model(**raw)
    tokenizer = file.tokenizer()
    quant = online_config(config.quantization)
    as_fp8 = check_fp4_load_as(config.fp4_load_as, quant, str(file.path))
    model, dtype = _build(model_cls, hf_config, config, device, quant)
    loaded = model.load_weights(file.tensors(dtype))
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"GGUF file {file.path} lacks {len(missing)} tensors: {shown}", param="model")
    if as_fp8:
        convert_fp4_model(model, quant)
    return _finish(model, hf_config, tokenizer, dtype, _eos_ids(hf_config, tokenizer, None), quant,
                   config.kv_cache_dtype, config.block_size, as_fp8)


def _load_dummy(config: EngineConfig, preset: str, device: torch.device) -> LoadedModel:
    raw = get_preset_config(preset)
    model_cls = resolve_model_class(raw["architectures"])
    hf_config = AutoConfig.for_model(**raw)
    tokenizer = _dummy_tokenizer(preset, hf_config)
    # a preset of a checkpoint that ships quantized (gpt-oss's MXFP4 experts) is quantized so: random weights
    # drawn in the model dtype and quantized at load
    shipped = parse_quantization_config(raw.get("quantization_config"))
    quant = online_config(config.quantization) if shipped is None else \
        resolve_quantization(dataclasses.replace(shipped, serialized=False), config.quantization)
    as_fp8 = check_fp4_load_as(config.fp4_load_as, quant, f"dummy:{preset}")
    model, dtype = _build(model_cls, hf_config, config, device, quant)
    if device.type != "meta":
        _init_random(model, config.seed, device, dtype)
        if as_fp8:
            convert_fp4_model(model, quant)
    if config.moe_routing != "model":
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        if not experts:
            raise ConfigError(f"--moe-routing={config.moe_routing} needs a mixture-of-experts model; "
                              f"dummy:{preset} is dense", param="moe_routing")
        for m in experts:
            m.routing_override = config.moe_routing
    return _finish(model, hf_config, tokenizer, dtype, _eos_ids(hf_config, tokenizer, None), quant,
                   config.kv_cache_dtype, config.block_size, as_fp8)


def _build(model_cls: type, hf_config: PretrainedConfig, config: EngineConfig, device: torch.device,
           quant: Fp8Config | None = None):
    """Assemble on the meta device, then allocate on ``device`` uninitialised: no CPU pass over 8B weights."""
    max_pos = hf_config.max_position_embeddings
    max_len = config.max_model_len or max_pos
    if max_len > max_pos:
        raise ConfigError(
            f"--max-model-len={max_len} is invalid: the model supports at most {max_pos} positions", param="max_model_len"
        )
    check_block_size = getattr(model_cls, "check_block_size", None)  # a family whose kernels take some pages only
    if check_block_size is not None:
        check_block_size(config.block_size)
    check_device = getattr(model_cls, "check_device", None)  # a family whose layers have no kernels on some devices
    if check_device is not None:
        check_device(device)
    window = sliding_window_of(hf_config)
    if window is not None and max_len > window and not getattr(model_cls, "builds_windows", False):
        raise ConfigError(
            f"--max-model-len={max_len} exceeds the model's sliding_window={window}, which graphserve does not "
            f"implement for {model_cls.__name__}: set --max-model-len <= {window}",
            param="max_model_len",
        )
    dtype = resolve_dtype(config.dtype, hf_config, device)
    with torch.device("meta"):
        model = model_cls(hf_config, max_len)
    model = model.to(dtype=dtype)
    if quant is not None:  # after the dtype cast, which would widen fp8 storage back to ``dtype``
        if isinstance(quant, Fp4Config):
            check_fp4_device(quant, device)
        _quantize(model, quant, dtype)
    model = model.to_empty(device=device)
    model.finish_materialize(device)
    return model.eval().requires_grad_(False), dtype


def _quantize(model: nn.Module, quant: Fp8Config | Fp4Config, dtype: torch.dtype) -> None:
    fp4 = isinstance(quant, Fp4Config)
    try:
        count = (quantize_fp4_linears if fp4 else quantize_linears)(model, quant)
        experts = (quantize_fp4_experts if fp4 else quantize_experts)(model, quant)
        for module in model.modules():  # a layer whose use of its quantized weights has limits of its own
            check = getattr(module, "check_quantized", None)
            if check is not None:
                check()
    except ValueError as e:
        raise ModelLoadError(f"{quant.name}: {e}", param="model") from e
    logger.info("quantization: %s on %d linear layers and %d routed-expert layers", quant.name, count, experts)


@torch.no_grad()
def _init_random(model: nn.Module, seed: int, device: torch.device, dtype: torch.dtype) -> None:
    """normal(0, 0.02) matrices, unit norm weights, zero biases, generated on ``device``. An FP8 layer
    draws its weight in ``dtype`` from the same generator position and quantizes it, so the FP8 model
    is the quantization of the unquantized one with the same seed (benchmarks compare the two)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        method = getattr(model.get_submodule(owner_name), "quant_method", None) if owner_name else None
        if method is not None and leaf == "weight":
            method.init_random(model.get_submodule(owner_name), dtype, gen)
            continue
        if method is not None and leaf in ("w13_weight", "w2_weight"):  # fp8 routed experts
            method.init_random(model.get_submodule(owner_name), leaf, dtype, gen)
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=gen)


def _generation_eos(folder: Path) -> Any:
    gen_file = folder / "generation_config.json"
    if not gen_file.is_file():
        return None
    return json.loads(gen_file.read_text()).get("eos_token_id")


def _eos_ids(hf_config: PretrainedConfig, tokenizer: Any, generation_eos: Any) -> list[int]:
    ids: list[int] = []
    for value in (generation_eos, hf_config.eos_token_id, tokenizer.eos_token_id):
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


def _finish(model: nn.Module, hf_config: PretrainedConfig, tokenizer: Any, dtype: torch.dtype, eos: list[int],
            quant: Fp8Config | None = None, kv_dtype: str = "auto", block_size: int = 16,
            fp4_as_fp8: bool = False):
    from graphserve.distributed.state import get_parallel

    parallel = get_parallel()  # this rank's share: its KV heads size the pool, its weights the plan
    prepare_fp4_linears(model)  # the weights are loaded: each FP4 projection's FP8 row scales, once
    description = model.describe(hf_config, dtype, tp=parallel.tp_size, ep=parallel.ep_size)
    if fp4_as_fp8:  # --fp4-load-as fp8: the FP4 layers now hold FP8 (layers/quant/fp4_to_fp8.py)
        description = fp8_description(description, quant, dtype, fp4_ignore_list(quant, model))
    else:
        # priced by the ignore list the layers were quantized by (layers/quant/fp8.py quantize_linears)
        ignore = None if quant is None else fp4_ignore_list(quant, model) if isinstance(quant, Fp4Config) else \
            IgnoreList(quant, model.map_weight_name, model.stacked_params)
        description = quantized_description(description, quant, dtype, ignore)
    if kv_dtype != "auto":  # a paged K/V cache or a latent one (MLA) alike: layers/kv_layout.py
        kv = with_cache_dtype(description.kv, kv_dtype)
        description = dataclasses.replace(description, kv=kv)
    # compact pages (compressed attention) are counted per block: their bytes a token depend on --block-size
    description = dataclasses.replace(description, kv=with_block_size(description.kv, block_size))
    info = ModelInfo(
        architecture=type(model).__name__,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        dtype=dtype,
        eos_token_ids=eos,
        tie_word_embeddings=model.tied,
        num_params=sum(p.numel() for p in model.parameters()),
        description=description,
    )
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return LoadedModel(model=model, hf_config=hf_config, tokenizer=tokenizer, info=info, chat_template=template)
