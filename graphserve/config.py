"""Engine configuration: one frozen dataclass, validated once, at construction.

CLI flags (SGLang's names) are derived from these fields by ``add_engine_args``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from graphserve.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
OVERLAP_MODES = ("auto", "on", "off")
MOE_ROUTING_MODES = ("model", "uniform")
# "fp8": per-channel weight scales and per-token activations for dense projections, 128x128 blocks for
# routed experts (each the faster on an H200); "fp8-block": 128x128 block weight scales everywhere,
# per-token-group activations (as the shipped FP8 checkpoints); "fp8-channel": per-channel everywhere
# (layers/quant/config.py)
QUANTIZATIONS = ("none", "fp8", "fp8-block", "fp8-channel", "nvfp4", "mxfp4")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model dtype (layers/kv_layout.py)
# "fp8": FP4 weights (an NVFP4/MXFP4 checkpoint, --quantization nvfp4/mxfp4) widened to FP8 at load, twice the
# bytes, for the FP8 kernels (layers/quant/fp4_to_fp8.py)
FP4_LOAD_AS = ("none", "fp8")
# The string fields that take one of a fixed set: checked in __post_init__, offered as argparse choices.
_CHOICES = {"overlap_schedule": OVERLAP_MODES, "moe_routing": MOE_ROUTING_MODES, "quantization": QUANTIZATIONS,
            "kv_cache_dtype": KV_CACHE_DTYPES, "fp4_load_as": FP4_LOAD_AS}


def default_cuda_graph_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 12, 16, 24, 32, then every 8 to 256, every 16 to 512, capped at ``max_bs``."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32]
    sizes += list(range(40, 257, 8))
    sizes += list(range(272, 513, 16))
    capped = [s for s in sizes if s <= max_bs]
    if not capped or capped[-1] != max_bs:
        capped.append(max_bs)
    return capped


@dataclass(frozen=True)
class EngineConfig:
    model: str = "builtin:tiny-llama"
    dtype: str = "auto"
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_running_requests: int | None = None  # None: derived (GPU: largest captured size; CPU: 256)
    chunked_prefill_size: int = 2048  # per-step token budget for prefill chunks
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Record the prefix cache's block events for GET /v1/cache_events (a `graphserve router` reads them; --dp
    # replicas always record, their own routing reads them). Off, no step logs, ships or stores an event.
    kv_events: bool = False
    # KV capacity on CPU (GPU sizes the pool with the memory planner): GiB or a token count.
    kv_cache_gb: float | None = None
    num_kv_tokens: int | None = None
    mem_fraction_static: float = 0.88
    cuda_graph_max_bs: int = 256
    cuda_graph_bs: tuple[int, ...] | None = None
    disable_cuda_graph: bool = False
    # Prepare step N+1 on the host while the device runs step N: "auto" does so on CUDA (on CPU the
    # model runs on the host, so there is nothing to overlap with), "on"/"off" force it.
    overlap_schedule: str = "auto"
    tp: int = 1
    ep: int = 1  # expert parallelism: whole routed experts placed on ranks (MoE models)
    # data-parallel replicas: engines of max(tp, ep) ranks each, behind the one HTTP front-end (server/replicas.py)
    dp: int = 1
    # The one-shot all-reduce over peer memory for small messages (CUDA, tp > 1); NCCL does the rest.
    disable_custom_all_reduce: bool = False
    # ranks across machines (SGLang's names): node 0 runs the scheduler, the HTTP server and the first
    # world/nnodes ranks; node R runs the next world/nnodes ranks only. All meet at dist_init_addr
    # (HOST:PORT on node 0), each within dist_timeout seconds.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 300.0
    # "uniform" spreads (token, slot) pairs over the experts round-robin: random weights route
    # unevenly, so benchmarks on dummy: models can show the balanced case too. Refused elsewhere.
    moe_routing: str = "model"
    # weights quantized at load ("none": as the checkpoint stores them; an FP8 checkpoint is always
    # run in FP8, whatever this says)
    quantization: str = "none"
    fp4_load_as: str = "none"
    kv_cache_dtype: str = "auto"
    log_interval: int = 40
    max_queued_requests: int = 1024

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype={self.dtype!r} is invalid: choose one of {', '.join(DTYPES)}", param="dtype")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device={self.device!r} is invalid: choose auto, cpu or cuda[:N]", param="device")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size={self.block_size} is invalid: must be a power of two >= 1", param="block_size")
        if self.chunked_prefill_size < self.block_size:
            raise ConfigError(
                f"--chunked-prefill-size={self.chunked_prefill_size} is invalid: must be >= --block-size ({self.block_size})",
                param="chunked_prefill_size",
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len={self.max_model_len} is invalid: must be >= 1", param="max_model_len")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ConfigError(
                f"--max-running-requests={self.max_running_requests} is invalid: must be >= 1", param="max_running_requests"
            )
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(
                f"--mem-fraction-static={self.mem_fraction_static} is invalid: must be in (0, 1)", param="mem_fraction_static"
            )
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs={self.cuda_graph_max_bs} is invalid: must be >= 1", param="cuda_graph_max_bs")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ConfigError(f"--cuda-graph-bs={list(self.cuda_graph_bs)} is invalid: sizes must be >= 1", param="cuda_graph_bs")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ConfigError(f"--kv-cache-gb={self.kv_cache_gb} is invalid: must be > 0", param="kv_cache_gb")
        if self.num_kv_tokens is not None and self.num_kv_tokens < self.block_size:
            raise ConfigError(
                f"--num-kv-tokens={self.num_kv_tokens} is invalid: must be >= --block-size ({self.block_size})",
                param="num_kv_tokens",
            )
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"--{name.replace('_', '-')}={value!r} is invalid: choose one of {', '.join(choices)}",
                                  param=name)
        if self.moe_routing != "model" and not self.model.startswith("dummy:"):
            raise ConfigError(
                f"--moe-routing={self.moe_routing} is for dummy: models only (random weights); model={self.model!r} "
                "routes with its own trained router", param="moe_routing")
        if self.tp < 1:
            raise ConfigError(f"--tp={self.tp} is invalid: must be >= 1", param="tp")
        if self.ep < 1:
            raise ConfigError(f"--ep={self.ep} is invalid: must be >= 1", param="ep")
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise ConfigError(f"--ep={self.ep} with --tp={self.tp} is invalid: expert-parallel ranks are the "
                              f"tensor-parallel ranks, so use --ep {self.tp} (or --ep 1)", param="ep")
        if self.dp < 1:
            raise ConfigError(f"--dp={self.dp} is invalid: must be >= 1", param="dp")
        self._check_nodes()
        if self.log_interval < 1:
            raise ConfigError(f"--log-interval={self.log_interval} is invalid: must be >= 1", param="log_interval")
        if self.max_queued_requests < 1:
            raise ConfigError(
                f"--max-queued-requests={self.max_queued_requests} is invalid: must be >= 1", param="max_queued_requests"
            )

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes={self.nnodes} is invalid: must be >= 1", param="nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank={self.node_rank} is invalid: must be in [0, --nnodes={self.nnodes})",
                              param="node_rank")
        if not self.dist_timeout > 0:
            raise ConfigError(f"--dist-timeout={self.dist_timeout} is invalid: must be > 0 seconds", param="dist_timeout")
        if self.nnodes == 1:
            return
        if self.dp > 1:
            raise ConfigError(f"--dp={self.dp} with --nnodes={self.nnodes} is not supported: replicas run on one "
                              "node; put a `graphserve router` in front of one server per node instead", param="dp")
        addr = self.dist_init_addr or ""
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--dist-init-addr={self.dist_init_addr!r} is invalid: --nnodes={self.nnodes} needs "
                              "HOST:PORT of node 0, the same on every node", param="dist_init_addr")
        world = max(self.tp, self.ep)
        if world % self.nnodes or world < self.nnodes:
            raise ConfigError(f"--tp={self.tp} --ep={self.ep} runs {world} rank(s), which --nnodes={self.nnodes} "
                              f"cannot split evenly: use a --tp/--ep that is a multiple of {self.nnodes} "
                              "(nnodes x GPUs per node)", param="nnodes")

    def graph_sizes(self) -> list[int]:
        """The decode batch sizes to capture, ascending (empty when graphs are off)."""
        if self.disable_cuda_graph:
            return []
        if self.cuda_graph_bs is not None:
            return sorted(set(self.cuda_graph_bs))
        return default_cuda_graph_sizes(self.cuda_graph_max_bs)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


_HELP = {
    "dtype": "weights and activations dtype",
    "device": "auto, cpu or cuda[:N]",
    "max_model_len": "longest prompt + output in tokens (default: the model's)",
    "max_running_requests": "most requests decoded together",
    "chunked_prefill_size": "prefill tokens per step",
    "block_size": "tokens per KV block",
    "kv_events": "record the prefix cache's stored/evicted block hashes and serve them on GET /v1/cache_events, "
                 "for `graphserve router` (on by itself with --dp)",
    "kv_cache_gb": "KV pool size in GiB (CPU; on GPU an upper bound on the planned pool)",
    "num_kv_tokens": "KV pool size in tokens (CPU; on GPU an upper bound on the planned pool)",
    "mem_fraction_static": "fraction of GPU memory for weights, KV pool, graphs and activations",
    "cuda_graph_max_bs": "largest decode batch captured in a CUDA graph",
    "cuda_graph_bs": "exact list of decode batch sizes to capture",
    "disable_cuda_graph": "run decode eagerly (for A/B runs)",
    "overlap_schedule": "prepare the next step while the device runs this one: auto (on CUDA), on, off",
    "tp": "tensor-parallel size: ranks (one process and device each) that split every layer",
    "ep": "expert-parallel size (MoE): ranks that hold whole experts; equal to --tp when both are set",
    "dp": "data-parallel replicas: engines of --tp ranks each (replica r on GPUs r*tp ..), behind the one HTTP "
          "server, which sends a request to the replica holding its longest cached prefix, else the least loaded",
    "disable_custom_all_reduce": "all-reduce with NCCL only (no one-shot kernel over peer memory for small messages)",
    "nnodes": "machines the --tp/--ep ranks span (each runs --tp/--nnodes ranks, one per GPU)",
    "node_rank": "this machine's index among --nnodes: 0 runs the scheduler and the HTTP server, the others ranks only",
    "dist_init_addr": "HOST:PORT on node 0 where every node's ranks meet (torch.distributed), the same on every node",
    "dist_timeout": "seconds a node waits to reach --dist-init-addr and for the other nodes to join",
    "moe_routing": "MoE routing: model (the router's choice) or uniform (round-robin over experts; dummy: models only)",
    "quantization": "quantize weights at load: fp8 (dense projections per channel, routed experts in 128x128 "
                    "blocks), fp8-block (128x128 block scales), fp8-channel (per-channel scales), nvfp4 (E2M1 "
                    "with e4m3 scales per 16 and a global scale) or mxfp4 (E2M1 with E8M0 scales per 32)",
    "fp4_load_as": "fp8: convert FP4 weights (an NVFP4/MXFP4 checkpoint or --quantization nvfp4/mxfp4) to FP8 e4m3 "
                   "at load and run the FP8 kernels (twice the weight bytes); none: run FP4",
    "kv_cache_dtype": "KV cache dtype: auto (the model dtype) or fp8_e4m3 (half the bytes; scale 1.0)",
    "log_interval": "decode steps between step-log lines",
    "max_queued_requests": "bound of the waiting queue; past it requests get 429",
    "seed": "seed of a dummy: model's random weights and of the sampling of requests that give no seed",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per EngineConfig field (except ``model``, a positional)."""
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.name == "enable_prefix_caching":
            parser.add_argument("--disable-radix-cache", "--disable-prefix-caching", dest="enable_prefix_caching",
                                action="store_false", help="turn prefix caching off")
            continue
        if f.name in _CHOICES:
            parser.add_argument(flag, choices=_CHOICES[f.name], default=default, help=_HELP[f.name])
            if f.name == "overlap_schedule":
                parser.add_argument("--disable-overlap-schedule", dest=f.name, action="store_const", const="off",
                                    help="same as --overlap-schedule off")
            continue
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default, help=_HELP.get(f.name))
        elif f.name == "cuda_graph_bs":
            parser.add_argument(flag, type=int, nargs="+", default=None, help=_HELP.get(f.name))
        else:
            typ = {"int": int, "float": float, "str": str}
            t = f.type.split("|")[0].strip() if isinstance(f.type, str) else "str"
            parser.add_argument(flag, type=typ.get(t, str), default=default, help=_HELP.get(f.name))


def config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    kw = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        if hasattr(args, f.name):
            v = getattr(args, f.name)
            if f.name == "cuda_graph_bs" and v is not None:
                v = tuple(v)
            kw[f.name] = v
    return EngineConfig(model=model, **kw)


