"""``dummy:<preset>``: real architectures' config.json values, for random-weight benchmark runs.

Each preset is the published config of the named checkpoint (the fields the engine reads) plus
the special tokens and chat format its tokenizer uses, so shapes, KV bytes per token and the
EOS ids are those of the real model.
"""

from __future__ import annotations

import copy
from typing import Any

from graphserve.errors import ModelLoadError

_LLAMA3_SPECIALS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>",
                    128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128009: "<|eot_id|>"}
_QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
# DeepSeek's tokenizers put bos/eos at these ids; the ChatML markers stand in for its chat format
_DEEPSEEK_SPECIALS = {100000: "<｜begin▁of▁sentence｜>", 100001: "<｜end▁of▁sentence｜>",
                      100002: "<|im_start|>", 100003: "<|im_end|>"}
_DEEPSEEK_V3_SPECIALS = {0: "<｜begin▁of▁sentence｜>", 1: "<｜end▁of▁sentence｜>", 2: "<|im_start|>", 3: "<|im_end|>"}
# o200k_harmony's special tokens (gpt-oss): <|return|> ends an assistant turn, <|call|> a tool call
_HARMONY_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                     200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
                     200008: "<|message|>", 200012: "<|call|>"}


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    """openai/gpt-oss-20b and -120b's config.json: they differ in depth and expert count only. Their experts are
    MXFP4 (as the checkpoints ship), so a ``dummy:`` run draws them in the model dtype and quantizes them at load."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": experts, "num_experts_per_tok": 4,
        "experts_per_token": 4, "vocab_size": 201088, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 4096},
        "sliding_window": 128, "initial_context_length": 4096,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16",
        # the routed experts ship as MXFP4, everything else in bf16
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }  # fmt: skip


def _deepseek_v4(layers: int, mtp: int = 1) -> dict[str, Any]:
    """deepseek-ai/DeepSeek-V4-Flash's shape as transformers' DeepseekV4Config defaults give it (43 layers, hidden
    4096, 64 heads of one shared 512-dim latent, 256 experts of 2048 top-6, vocab 129,280), cut to ``layers``: the
    layer types are the config's default schedule (two HCA, then CSA and HCA alternating), the first three MoE
    layers hash-routed; yarn (factor 16) on the compressed branches' rope; ``mtp`` MTP layers (kept, unused)."""
    hca, csa = "heavily_compressed_attention", "compressed_sparse_attention"
    types = [hca] * min(layers, 2) + [csa if i % 2 else hca for i in range(max(layers - 2, 0))]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
        "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "partial_rotary_factor": 0.125,
        "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "layer_types": types,
        "compress_rates": {csa: 4, hca: 128}, "mlp_layer_types": ["hash_moe"] * min(layers, 3) +
        ["moe"] * max(layers - 3, 0), "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0,
        "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "num_nextn_predict_layers": mtp, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                            "beta_fast": 32.0, "beta_slow": 1.0},
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip


# V4 as the first story serves it: NVFP4 routed experts (ModelOpt's form), everything else bf16
_V4_NVFP4_EXPERTS = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [
    "model.layers.*.self_attn.*", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts.*",
    "model.embed_tokens", "lm_head"]}

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

# name -> {"config": HF config.json dict, "specials"/"bos"/"eos"/"chat": the tokenizer to synthesise}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {  # Meta-Llama-3-8B-Instruct
        "config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": [128001, 128009],
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        },
        "specials": _LLAMA3_SPECIALS, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "chat": "llama3",
    },
    "llama3.1-8b": {  # Llama-3.1-8B-Instruct: llama3 rope scaling to 128k
        "config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE,
            "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        },
        "specials": {**_LLAMA3_SPECIALS, 128008: "<|eom_id|>"}, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
        "chat": "llama3",
    },
    "llama3.2-1b": {  # Llama-3.2-1B-Instruct: tied embeddings, head_dim 64
        "config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0},
            "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
        },
        "specials": {**_LLAMA3_SPECIALS, 128008: "<|eom_id|>"}, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
        "chat": "llama3",
    },
    "qwen3-0.6b": {  # Qwen3-0.6B: q/k norm, head_dim 128 != 1024/16
        "config": {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
        },
        "specials": _QWEN_SPECIALS, "bos": None, "eos": "<|im_end|>", "chat": "chatml",
    },
    "qwen3-8b": {  # Qwen3-8B
        "config": {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
        },
        "specials": _QWEN_SPECIALS, "bos": None, "eos": "<|im_end|>", "chat": "chatml",
    },
    "qwen2.5-7b": {  # Qwen2.5-7B-Instruct: q/k/v bias
        "config": {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
        },
        "specials": _QWEN_SPECIALS, "bos": None, "eos": "<|im_end|>", "chat": "chatml",
    },
    "qwen2.5-0.5b": {  # Qwen2.5-0.5B-Instruct: q/k/v bias, tied embeddings
        "config": {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
        },
        "specials": _QWEN_SPECIALS, "bos": None, "eos": "<|im_end|>", "chat": "chatml",
    },
    "mistral-7b": {  # Mistral-7B-Instruct-v0.2: no sliding window
        "config": {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu",
        },
        "specials": {0: "<unk>", 1: "<s>", 2: "</s>"}, "bos": "<s>", "eos": "</s>", "chat": "mistral",
    },
    "mistral-7b-v0.1": {  # Mistral-7B-v0.1: every layer attends through a 4096-token sliding window
        "config": {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu",
        },
        "specials": {0: "<unk>", 1: "<s>", 2: "</s>"}, "bos": "<s>", "eos": "</s>", "chat": "mistral",
    },
    # ---- mixture-of-experts ---------------------------------------------------------------------
    "qwen3-30b-a3b": {  # Qwen3-30B-A3B: 48 sparse layers, 128 experts of 768, top-8 renormalised
        "config": {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
        },
        "specials": _QWEN_SPECIALS, "bos": None, "eos": "<|im_end|>", "chat": "chatml",
    },
    "mixtral-8x7b": {  # Mixtral-8x7B-Instruct-v0.1: 8 experts of 14336, top-2
        "config": {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
            "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "hidden_act": "silu",
        },
        "specials": {0: "<unk>", 1: "<s>", 2: "</s>"}, "bos": "<s>", "eos": "</s>", "chat": "mistral",
    },
    "olmoe-1b-7b": {  # OLMoE-1B-7B-0924-Instruct: 64 experts of 1024, top-8, whole-projection q/k norm
        "config": {
            "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
            "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
            "vocab_size": 50304, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "clip_qkv": None, "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        },
        "specials": {1: "<|padding|>", 50279: "<|endoftext|>"}, "bos": None, "eos": "<|endoftext|>",
        "chat": "chatml",
    },
    "qwen1.5-moe-a2.7b": {  # Qwen1.5-MoE-A2.7B-Chat: 60 experts of 1408, top-4, a shared expert of 5632
        "config": {
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
            "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
            "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
            "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "vocab_size": 151936, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu", "qkv_bias": True, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 21,
        },
        "specials": _QWEN_SPECIALS, "bos": None, "eos": "<|im_end|>", "chat": "chatml",
    },
    "deepseek-v2-lite": {  # DeepSeek-V2-Lite(-Chat): MLA without q LoRA, 64 experts of 1408 top-6, 2 shared
        "config": {
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
            "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
            "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
            "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "topk_method": "greedy", "scoring_func": "softmax", "n_group": 1, "topk_group": 1,
            "norm_topk_prob": False, "routed_scaling_factor": 1.0, "vocab_size": 102400,
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
            "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
        },
        "specials": _DEEPSEEK_SPECIALS, "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "chat": "chatml",
    },
    "deepseek-v3-l4": {  # the first 4 layers of DeepSeek-V3 (1 dense + 3 MoE): its real kernel sizes on one GPU
        "config": {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 4,
            "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 8, "topk_group": 4,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 129280,
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
            "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu", "attention_bias": False, "rope_interleave": True,
        },
        "specials": _DEEPSEEK_V3_SPECIALS, "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "chat": "chatml",
    },
    "deepseek-v3.2-l4": {  # deepseek-v3-l4 with DeepSeek-V3.2's sparse attention: a 64-head x 128 indexer, top-2048
        "config": {
            "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 4,
            "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "n_group": 8, "topk_group": 4,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 129280,
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40, "beta_fast": 32,
                                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096},
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
            "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu", "attention_bias": False,
        },
        "specials": _DEEPSEEK_V3_SPECIALS, "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "chat": "chatml",
    },
    "glm-5-l5": {  # the first 5 layers of GLM-5 (3 dense + 2 MoE) as transformers' GlmMoeDsaConfig describes it
        "config": {
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
            "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 5,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
            "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "mlp_layer_types": ["dense", "dense", "dense", "sparse", "sparse"], "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 154880,
            "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "indexer_types": ["full"] * 5,
            "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu", "attention_bias": False,
        },
        "specials": _DEEPSEEK_V3_SPECIALS, "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "chat": "chatml",
    },
    # ---- DeepSeek-V4: compressed sparse / heavily compressed attention beside windows, hyper-connections ------
    "deepseek-v4-flash": {  # deepseek-ai/DeepSeek-V4-Flash: 43 layers (graphserve plan; --tp at load)
        "config": {**_deepseek_v4(43), "quantization_config": _V4_NVFP4_EXPERTS},
        "specials": _DEEPSEEK_V3_SPECIALS, "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "chat": "chatml",
    },
    "deepseek-v4-flash-l6": {  # its first 6 layers: 3 hash-MoE, HCA x3 then CSA/HCA alternating; no MTP layer
        "config": {**_deepseek_v4(6, mtp=0), "quantization_config": _V4_NVFP4_EXPERTS},
        "specials": _DEEPSEEK_V3_SPECIALS, "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "chat": "chatml",
    },
    # ---- gpt-oss: sinks, windows of 128 on alternate layers, biased clamped-SwiGLU experts ---------------------
    "gpt-oss-20b": {  # openai/gpt-oss-20b: 24 layers, 32 experts of 2880, top-4
        "config": _gpt_oss(24, 32),
        "specials": _HARMONY_SPECIALS, "bos": "<|startoftext|>", "eos": "<|return|>", "chat": "harmony",
    },
    "gpt-oss-120b": {  # openai/gpt-oss-120b: 36 layers, 128 experts of 2880, top-4
        "config": _gpt_oss(36, 128),
        "specials": _HARMONY_SPECIALS, "bos": "<|startoftext|>", "eos": "<|return|>", "chat": "harmony",
    },
    "gpt-oss-20b-bf16": {  # gpt-oss-20b with bf16 experts (the bf16 expert kernels; 42 GB of weights)
        "config": {k: v for k, v in _gpt_oss(24, 32).items() if k != "quantization_config"},
        "specials": _HARMONY_SPECIALS, "bos": "<|startoftext|>", "eos": "<|return|>", "chat": "harmony",
    },
}


def _check(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ModelLoadError(
            f"model='dummy:{name}' is unknown: choose one of {', '.join('dummy:' + p for p in sorted(PRESETS))}",
            param="model",
        )
    return PRESETS[name]


def get_preset_config(name: str) -> dict[str, Any]:
    """The preset's HF config.json as a dict (a fresh copy)."""
    return copy.deepcopy(_check(name)["config"])


def get_preset_tokenizer_spec(name: str) -> dict[str, Any]:
    """Special tokens ``{id: text}``, bos/eos texts and chat format (``llama3``, ``chatml`` or ``mistral``)."""
    p = _check(name)
    return {"specials": dict(p["specials"]), "bos": p["bos"], "eos": p["eos"], "chat": p["chat"]}
