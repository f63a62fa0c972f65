"""What every model family shares: logits, materialisation after ``to_empty``, and loading.

Loading goes through the parameters' owners: a checkpoint tensor is renamed by the family
(``map_weight_name``: fused q/k/v, gate/up, an expert index in the name) and handed to the module
that owns the target parameter. A module that stores several checkpoint tensors in one parameter
(a merged projection, a stack of experts) or only a slice of one (a tensor-parallel shard)
declares it with two methods, so the model needs no knowledge of the layout:

- ``weight_shards(param_name) -> list | None``: the shard ids a complete checkpoint fills
  (None: the parameter is one tensor);
- ``load_weight(param_name, param, tensor, shard)``: copy ``tensor`` into its place, raising
  ValueError with the expected and actual shapes when it does not fit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from graphserve.distributed.state import get_parallel
from graphserve.errors import ModelLoadError
from graphserve.layers.embedding import LMHead
from graphserve.layers.quant.config import scale_has_no_place


def _default_load(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


class DecoderStack(nn.Module):
    """Embedding, decoder layers and the final norm; subclasses build ``embed_tokens``, ``layers`` and
    ``norm``. Each layer maps (positions, hidden, residual, batch) to (hidden, residual), the residual
    add riding on the next norm."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """Base of every family. Subclasses set ``self.model`` (a ``DecoderStack``), then ``self.lm_head`` and
    ``self.tied`` (``add_lm_head``), and implement ``describe``."""

    tied: bool = False
    # checkpoint name fragment -> (parameter fragment, shard id): tensors fused into one parameter
    stacked_params: dict[str, tuple[str, Any]] = {}

    @classmethod
    def describe(cls, config: Any, dtype: torch.dtype, tp: int = 1, ep: int = 1):
        raise NotImplementedError(f"{cls.__name__} does not describe itself")

    def needs_row_mask(self) -> bool:
        """Whether some layer reads ``batch.num_valid_tokens`` as a row mask (routed experts skip padding rows)."""
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        # A padded (CUDA-graph) batch carries its real row count on the device. Layers that mask padding
        # rows get it as a bool mask built once per step here (two small launches), not in each layer; on a
        # shallow copy, since the graph runner refills the caller's count every replay.
        count = getattr(batch, "num_valid_tokens", None)
        if count is not None and count.dtype != torch.bool and self.needs_row_mask():
            batch = copy.copy(batch)
            batch.num_valid_tokens = torch.arange(input_ids.shape[0], device=count.device) < count.reshape(())
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def add_lm_head(self, hidden_size: int, vocab_size: int, tie_word_embeddings: bool) -> None:
        """``self.lm_head`` over this rank's vocabulary rows (``--tp``), tied to ``self.model.embed_tokens`` where
        the config ties them; ``self.model`` is built first."""
        ps = get_parallel()
        self.lm_head = LMHead(hidden_size, vocab_size, ps.tp_rank, ps.tp_size)
        self.tied = tie_word_embeddings
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    def moe_layers(self) -> list[nn.Module]:
        """The routed-expert layers (empty for a dense model)."""
        from graphserve.layers.moe import FusedMoE

        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def finish_materialize(self, device: torch.device) -> None:
        """After ``to_empty``: recompute tables that are not parameters, and re-share the tied head."""
        for module in self.modules():
            if module is not self and hasattr(module, "rebuild"):
                module.rebuild(device)
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    # ---- loading -------------------------------------------------------------------------------
    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id or None) for a checkpoint tensor, or None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None  # old checkpoints store it; it is recomputed from the config
        if name == "lm_head.weight" and self.tied:
            return None  # tied: the embedding is the head
        for fragment, (fused, shard) in self.stacked_params.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        owner_name, _, leaf = name.rpartition(".")
        return self.get_submodule(owner_name), leaf

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; return the ``name#shard`` keys that were filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            mapped = self.map_weight_name(ckpt_name)
            if mapped is None:
                continue
            name, shard = mapped
            param = params.get(name)
            if param is None:  # a scale graphserve does not load is named as such
                module = dict(self.named_modules()).get(name.rpartition(".")[0])
                raise ModelLoadError(scale_has_no_place(ckpt_name, module)
                                     or f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}",
                                     param="model")
            owner, leaf = self._owner(name)
            try:
                with torch.no_grad():
                    if hasattr(owner, "load_weight"):
                        placed = owner.load_weight(leaf, param, tensor, shard)
                        if placed is False:  # another rank's slice (an expert this rank does not hold)
                            continue
                    elif shard is not None:
                        raise ValueError(f"{type(owner).__name__} takes no shard {shard!r}")
                    else:
                        _default_load(param, tensor)
            except ValueError as e:
                raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} does not fit {name}: {e}") from e
            loaded.add(name if shard is None else f"{name}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        """The keys ``load_weights`` must report for a complete checkpoint."""
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            owner, leaf = self._owner(name)
            shards = owner.weight_shards(leaf) if hasattr(owner, "weight_shards") else None
            if shards is None:
                expected.add(name)
            else:
                expected.update(f"{name}#{s}" for s in shards)
        return expected
