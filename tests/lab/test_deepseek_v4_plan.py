"""``graphserve plan`` answers the first story's question for DeepSeek-V4-Flash in words, from the family's
description: does C=64 fit on 4 x 96 GB at --mem-fraction-static 0.70 with --cuda-graph-max-bs 64?"""

from __future__ import annotations

import dataclasses
import json

import torch

from graphserve.cli import main
from graphserve.engine.memory import gib
from graphserve.layers.quant.config import parse_quantization_config, quantized_description
from graphserve.models.deepseek_v4 import DeepseekV4ForCausalLM
from graphserve.models.presets import get_preset_config
from graphserve.models.registry import describe_model, ignore_list

STORY = ["plan", "dummy:deepseek-v4-flash", "--tp", "4", "--gpu-memory-gb", "96", "--concurrency", "64",
         "--mem-fraction-static", "0.70", "--cuda-graph-max-bs", "64"]


def _plan(capsys, *flags: str) -> tuple[str, dict]:  # noqa: ANN001
    main([*STORY, *flags])
    text = capsys.readouterr().out
    main([*STORY, *flags, "--json"])
    return text, json.loads(capsys.readouterr().out)


def _description():
    hf = get_preset_config("deepseek-v4-flash")
    quant = parse_quantization_config(hf["quantization_config"])
    return quantized_description(describe_model(hf, torch.bfloat16, tp=4), quant, torch.bfloat16, ignore_list(hf, quant))


def _answer_of(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("C=64 at 2048 tokens a request"))


def test_the_story_question_is_answered_with_the_description_s_numbers(capsys):
    d = _description()
    text, p = _plan(capsys)
    line, m = _answer_of(text), p["memory"]
    # what one GPU holds and what a token costs are the description's, MTP layer and tp-4 split included
    assert m["weights_bytes"] == d.weights_bytes and d.kept_unused is not None
    assert f"Weights {gib(d.weights_bytes):.2f} GiB" in line
    # the latents paged apart: the blocks at what a token keeps for the whole context, the windows' pages beside
    kv = d.kv
    assert m["latent_pages"] == kv.latent_pages_wanted(16, 64, 2048) and m["latent_bytes_per_token"] == 43 * 1024
    assert f"at {kv.bytes_per_token - kv.latent_bytes_per_token} B/token held for the whole context" in line
    assert f"beside {m['latent_pages']} latent pages of 16 tokens at {kv.latent_bytes_per_token} B/token" in line
    assert f"cuda graph pool {gib(m['graph_pool_bytes']):.2f} GiB (sizes up to 64)" in line
    assert "on 4 x 96 GB" in line and "--mem-fraction-static 0.7)" in line
    need = 64 * 2048
    assert f"64 x 2048 = {need} KV tokens" in line and f"{m['kv_tokens']} tokens at" in line
    fits = m["fits"] and need <= m["kv_tokens"]
    assert line.split(": ")[1].startswith("FITS." if fits else "DOES NOT FIT.")
    assert p["answers"] == [{"concurrency": 64, "fits": fits, "text": line}]
    if not m["fits"]:  # the default --max-model-len is the preset's 1M positions: the engine's own refusal, named
        assert "refuses to start at --max-model-len 1048576" in line


def test_the_verdict_follows_the_description(capsys, monkeypatch):
    """The same question, at a context the pool admits, over descriptions whose tokens cost less and more than
    V4's: a latent alone (43 x 1 KiB a token) fits 64 requests of 2048 tokens, a latent 16 times as wide does not;
    each sentence carries its description's bytes per token and the tokens its pool holds."""
    describe = DeepseekV4ForCausalLM.describe.__func__
    answers = []
    for widen in (1, 16):

        def latent_only(cls, config, dtype, tp=1, ep=1, widen=widen):  # noqa: ANN001
            d = describe(cls, config, dtype, tp, ep)
            kv = dataclasses.replace(d.kv, head_dim=d.kv.head_dim * widen, compact=())
            return dataclasses.replace(d, kv=kv)

        monkeypatch.setattr(DeepseekV4ForCausalLM, "describe", classmethod(latent_only))
        text, p = _plan(capsys, "--context-length", "65536")
        per_token = describe_model(get_preset_config("deepseek-v4-flash"), torch.bfloat16, tp=4).kv.bytes_per_token
        m, a = p["memory"], p["answers"][0]
        assert per_token == 43 * 512 * 2 * widen == p["kv_bytes_per_token"]
        assert m["kv_tokens"] == m["kv_pool_bytes"] // per_token // 16 * 16  # whole blocks of 16
        assert a["fits"] == (m["fits"] and 64 * 2048 <= m["kv_tokens"])
        assert f"{m['kv_tokens']} tokens at {per_token} B/token" in _answer_of(text)
        answers.append(a["fits"])
    assert answers == [True, False]
