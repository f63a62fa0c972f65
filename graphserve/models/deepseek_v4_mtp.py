"""DeepSeek-V4's multi-token-prediction layers (``num_nextn_predict_layers``), loaded and kept.

As DeepSeek ships them (``mtp.0.*``; transformers builds none and drops them as it loads): a decoder layer of the
main model's kind — sliding-window attention only (the MTP entry of DeepSeek's ``compress_ratios`` is 0) and a
score-routed MoE — whose input mixes the next token's normed embedding (``enorm``, ``e_proj``) with the main
model's normed hidden state (``hnorm``, ``h_proj``), and its own hyper-connection head (``hc_head_*``) and final
``norm``; the embedding and the lm_head are the main model's. Speculative decoding will run it; until then nothing
does, so it has no cache and its ``forward`` refuses. Its names load as DeepSeek writes them (``mtp.0.attn.wq_a``,
``mtp.0.hc_head_fn``) or in transformers' module names (``mtp.0.self_attn.q_a_proj``, ``mtp.0.hc_head.hc_fn``), with
or without ``model.``, into ``mtp.{i}.*`` of the model (models/deepseek_v4.py V4MTPLayer).
"""

from __future__ import annotations

import dataclasses
import re

from graphserve.models.deepseek_v4_names import module_name
from graphserve.models.deepseek_v4_shape import SLIDING, V4Shape

_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
_HC_HEAD = re.compile(r"^hc_head_(fn|base|scale)$")
OWN = ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head")  # the MTP layer's modules beside its decoder layer


def mtp_shape(s: V4Shape) -> V4Shape:
    """``s`` with the MTP layers' types after the main layers' (sliding window, score-routed MoE)."""
    k = s.num_nextn_predict_layers
    return dataclasses.replace(s, layer_types=s.layer_types + (SLIDING,) * k,
                               mlp_layer_types=s.mlp_layer_types + ("moe",) * k)


def mtp_module_name(name: str) -> str | None:
    """The model's name (``mtp.{i}.…``) of an MTP checkpoint tensor, in DeepSeek's names or transformers'; None for
    a tensor of the main model."""
    hit = _MTP.match(name)
    if hit is None:
        return None
    i, rest = hit.groups()
    head = _HC_HEAD.match(rest)
    if head is not None:
        return f"mtp.{i}.hc_head.hc_{head.group(1)}"
    if rest.split(".")[0] in OWN:
        return f"mtp.{i}.{rest}"
    # the decoder layer's tensors are named as a main layer's are: renamed as layer 0's would be
    return f"mtp.{i}." + module_name(f"layers.0.{rest}").removeprefix("model.layers.0.")
