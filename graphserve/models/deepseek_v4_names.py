"""DeepSeek-V4's checkpoint names, as DeepSeek ships them (``layers.0.attn.wq_a.weight``, ``embed.weight``,
``hc_head_fn``, experts one by one as ``ffn.experts.3.w1.weight``), mapped to transformers' module names, which the
model (models/deepseek_v4.py) uses: transformers' ``conversion_mapping`` entry "deepseek_v4", rule for rule."""

from __future__ import annotations

import re

# DeepSeek's checkpoint names -> transformers' module names (transformers' conversion_mapping "deepseek_v4"), in
# its order: the mid-name renames first, so ".indexer.compressor." has become ".compressor.indexer." before
# ".norm." turns into ".kv_norm."
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"), (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
))  # fmt: skip


def module_name(name: str) -> str:
    """A checkpoint tensor's name in the model: DeepSeek's names (``layers.0.attn.wq_a.weight``, with or without
    ``model.``) renamed as transformers renames them; transformers' own names unchanged. A name with a leading dot
    (a fragment: quantization ignore lists map their entries so) keeps it, and gains no ``model.``."""
    lead = "." if name.startswith(".") else ""
    n = name[len(lead):]
    prefixed = n.startswith("model.")
    n = n.removeprefix("model.")
    for pattern, repl in _RENAMES:
        n = pattern.sub(repl, n)
    if n == "lm_head.weight" or (lead and not prefixed):
        return lead + n
    return f"{lead}model.{n}"
