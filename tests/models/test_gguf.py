"""GGUF checkpoints: small files written here by the gguf package's writer, loaded by graphserve and by transformers
(``gguf_file=``); greedy tokens, tokenizer and chat template agree, and bad files are refused naming file and field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="GGUF checkpoints need the gguf package (requirements-cpu.txt)")

import httpx  # noqa: E402
from gguf_utils import CHATML, write_gguf  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402
from graphserve.errors import ModelLoadError  # noqa: E402
from graphserve.models.gguf_checkpoint import SUPPORTED_TYPES, GGUFFile  # noqa: E402
from graphserve.models.loader import load_tokenizer  # noqa: E402

PROMPTS = [[5, 40, 70, 100, 200, 33], [260, 7, 7, 150]]
# qwen3's GGUF metadata reaches transformers without head_dim (its map has no key_length), so the file keeps
# Qwen3Config's default of 128
SHAPES = {"llama": {}, "qwen2": {}, "qwen3": {"heads": 2, "kv_heads": 1, "tied": True}}


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_greedy_tokens_match_transformers_on_the_same_file(tmp_path, arch):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch=arch, seed=len(arch), **SHAPES[arch])
    types = {t.tensor_type.name for t in GGUFFile(path).reader.tensors}
    assert types == set(SUPPORTED_TYPES)  # every accepted type is dequantized in this file
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.token_ids == ref[0, len(ids):].tolist()


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = load_tokenizer(str(path))
    text = "the weather in the north"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.chat_template == CHATML
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")  # ids 1 and 2 of the file
    llm = LLM(str(path))
    assert llm.engine.info.eos_token_ids == [2]
    text = llm.engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_corrupt_and_truncated_files_are_refused_naming_the_file(tmp_path):
    good = write_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"XXXX" + data[4:])
    with pytest.raises(ModelLoadError, match=r"magic\.gguf is corrupt or truncated"):
        LLM(str(bad_magic))
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match=r"header\.gguf is corrupt or truncated"):
        LLM(str(header_cut))
    data_cut = tmp_path / "cut.gguf"
    data_cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf (is corrupt or truncated|is truncated: tensor blk\.1\.)"):
        LLM(str(data_cut))
    with pytest.raises(ModelLoadError, match=r"nope\.gguf does not exist"):
        LLM(str(tmp_path / "nope.gguf"))


def test_unsupported_type_architecture_and_missing_fields_are_refused(tmp_path):
    q5 = write_gguf(tmp_path / "q5.gguf", types=["Q5_0", "Q8_0"])
    with pytest.raises(ModelLoadError, match=r"q5\.gguf: tensor blk\.0\.attn_q\.weight has quantization type Q5_0"):
        LLM(str(q5))
    phi = write_gguf(tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(ModelLoadError, match=r"phi\.gguf: general\.architecture='phi3' is not supported"):
        LLM(str(phi))
    no_layers = write_gguf(tmp_path / "nolayers.gguf", metadata={"llama.block_count": None})
    with pytest.raises(ModelLoadError, match=r"nolayers\.gguf lacks the metadata field llama\.block_count"):
        LLM(str(no_layers))
    scaled = write_gguf(tmp_path / "yarn.gguf", metadata={"llama.rope.scaling.type": ("string", "yarn")})
    with pytest.raises(ModelLoadError, match=r"yarn\.gguf: llama\.rope\.scaling\.type='yarn'"):
        LLM(str(scaled))
    llama31 = write_gguf(tmp_path / "l31.gguf", extra={"rope_freqs.weight": np.ones(32, np.float32)})
    with pytest.raises(ModelLoadError, match=r"l31\.gguf: tensor rope_freqs\.weight \(Llama 3\.1-style rope scaling\)"):
        LLM(str(llama31))
    missing = write_gguf(tmp_path / "missing.gguf", skip_tensor="blk.1.ffn_down.weight")
    with pytest.raises(ModelLoadError, match=r"missing\.gguf lacks 1 tensors: model\.layers\.1\.mlp\.down_proj"):
        LLM(str(missing))


def test_serve_a_gguf_file(tmp_path):
    """``graphserve serve model.gguf``: completions, and the tokenizer folder SGLang's bench loads."""
    path = write_gguf(tmp_path / "served.gguf")
    srv = ServerProcess(tmp_path, model=str(path)).start()
    try:
        info = httpx.get(srv.base_url + "/get_model_info", timeout=10).json()
        tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
        assert tok.encode("the weather", add_special_tokens=False) == \
            load_tokenizer(str(path)).encode("the weather", add_special_tokens=False)
        body = {"model": info["model_path"], "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["text"]
        offline = LLM(str(path)).generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0,
                                                                        ignore_eos=True), use_tqdm=False)
        assert served == offline[0].text and r.json()["usage"]["completion_tokens"] == 8
    finally:
        srv.stop()


def test_tp_is_checked_against_the_files_metadata(tmp_path):
    from graphserve.config import EngineConfig
    from graphserve.errors import ConfigError
    from graphserve.models.parallel_check import check_parallel

    path = write_gguf(tmp_path / "tp.gguf")  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError) as e:
        check_parallel(EngineConfig(model=str(path), tp=3, device="cpu"))
    assert e.value.param == "tp" and "num_attention_heads=4" in e.value.message
