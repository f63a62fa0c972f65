"""Helpers for model tests: tiny HF checkpoints on disk and a hand-built paged-KV forward harness."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from graphserve.kernels.fp8_quant import dequantize_blocks
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.layers.attention import TorchAttentionBackend
from graphserve.layers.forward_batch import ForwardBatch
from graphserve.models.synthetic_tokenizer import CHATML_TEMPLATE, build_synthetic_tokenizer


def make_hf_checkpoint(
    folder: Path, config: PretrainedConfig, seed: int = 0, max_shard_size: str | None = None
) -> torch.nn.Module:
    """Save a random float32 HF model (plus a synthetic tokenizer) to ``folder``; return the HF model.

    Every parameter is perturbed, not just the matrices, so biases and norm weights (which HF
    initialises to 0 and 1) are actually exercised by a logits comparison.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    specials = {0: "<s>", 1: "</s>", 2: "<|im_start|>", 3: "<|im_end|>"}
    build_synthetic_tokenizer(config.vocab_size, specials, "<s>", "</s>", CHATML_TEMPLATE).save_pretrained(folder)
    return model


def bias_routers(hf: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """Give the routers' ``e_score_correction_bias`` buffers (zeros from HF's init, and buffers, which
    ``make_hf_checkpoint`` leaves) random values large enough to change which experts win, and save ``hf`` to
    ``folder`` again where it has any; return ``hf``."""
    biased = False
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn_like(buf))
                biased = True
    if biased:
        hf.save_pretrained(folder)
    return hf


def make_hf_checkpoints(tmp_path_factory, makers: dict, seed: int = 0) -> dict[str, Path]:
    """One ``make_hf_checkpoint`` folder per name of ``makers`` (name -> a function returning the config), for a
    module-scoped fixture."""
    folders = {}
    for name, make in makers.items():
        folders[name] = tmp_path_factory.mktemp(name)
        make_hf_checkpoint(folders[name], make(), seed=seed)
    return folders


def dequantized_checkpoint(fp8: Path, dst: Path) -> None:
    """Write to ``dst`` the FP8 checkpoint ``fp8`` with every quantized weight dequantized to fp32 (block-wise
    ``weight_scale_inv`` or per-channel ``weight_scale``), its scale tensors dropped and no quantization_config;
    the other files are copied."""
    dst.mkdir()
    tensors = load_file(str(fp8 / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    block = config.pop("quantization_config").get("weight_block_size")
    out = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale_inv", "weight_scale", "input_scale")):
            continue
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale_inv" in tensors:
            t = dequantize_blocks(t, tensors[f"{module}.weight_scale_inv"], *block)
        elif f"{module}.weight_scale" in tensors:
            t = t.float() * tensors[f"{module}.weight_scale"][:, None]
        out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    for f in fp8.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())


def held_weight_bytes(model: torch.nn.Module) -> int:
    """What a loaded model holds as weights: its parameters (tied ones once) and the fp8 scales quantized at load,
    which are buffers; the other buffers (rotary tables, MoE counters) are no weights."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return held + sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                      if name.endswith(("_scale", "_scale_inv", "_scale_2")))


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[len, vocab]`` of a full, uncached HF forward over ``token_ids``."""
    return model(torch.tensor([token_ids])).logits[0].float()


def random_prompts(lengths: tuple[int, ...], seed: int = 5, vocab: int = 320) -> list[list[int]]:
    """One prompt of random token ids (none of the four special ones) per length, from a generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, token_ids: list[int], new_tokens: int) -> list[int]:
    """The ``new_tokens`` greedy tokens transformers' ``generate`` appends to ``token_ids`` (eos banned until then,
    as ``min_tokens`` bans it in the engine)."""
    out = model.generate(torch.tensor([token_ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(token_ids) :].tolist()


def engine_greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The engine's ``new_tokens`` greedy tokens for each prompt, all submitted together."""
    from graphserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


class PagedHarness:
    """Runs a graphserve model step by step over a paged KV cache, like the engine would.

    Blocks are handed out in a scrambled order so block-table indirection is really tested;
    block 0 stays the reserved dummy block.
    """

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 64, dtype=torch.float32,
                 device: torch.device | str = "cpu", backend=None):
        layout = type(model).describe(model.config, dtype).kv
        self.model, self.block_size, self.device = model, block_size, torch.device(device)
        self.kv_caches = layout.allocate(num_blocks, block_size, self.device)
        free = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1
        self.free_blocks = free.tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.backend = backend if backend is not None else TorchAttentionBackend()

    def build_batch(self, chunks: list[tuple[str, list[int]]]) -> ForwardBatch:
        ids, positions, slots, qlens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += tokens
            positions += range(start, end)
            qlens.append(len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        tables = [self.tables[seq] + [DUMMY_BLOCK] * (width - len(self.tables[seq])) for seq, _ in chunks]
        dev = self.device
        qsl = torch.tensor([0] + qlens, device=dev).cumsum(0)
        mode = "decode" if all(q == 1 for q in qlens) else "prefill"
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=qsl.to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            logits_indices=(qsl[1:] - 1).to(torch.int64),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            kv_caches=self.kv_caches,
            attn_backend=self.backend,
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
        )

    @torch.no_grad()
    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over the new tokens of each sequence; return each chunk's logits ``[len, vocab]``."""
        batch = self.build_batch(chunks)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(batch.query_lens_cpu))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` (Frobenius norms), computed in fp32 whatever the inputs' dtype."""
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def apply_sampled(scheduler, out, sampled: list[int]) -> list:
    """What the engine does once a step's ids are on the host: advance the scheduler, put each sampled
    token (``sampled[i]`` for ``out.scheduled[i]``) in place, commit filled blocks. Returns the
    (sequence, token) pairs appended."""
    appended = []
    for row, seq, index in scheduler.advance(out):
        seq.output_token_ids[index] = sampled[row]
        appended.append((seq, sampled[row]))
    scheduler.commit_full_blocks(out)
    return appended


def sample_and_finish(scheduler, out, token: int = 7) -> None:
    """Every scheduled sequence samples ``token``; those at max_tokens finish, as the engine does."""
    for seq, _ in apply_sampled(scheduler, out, [token] * len(out.scheduled)):
        if seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq, "length")


def schedule_and_sample(scheduler, token: int = 7):
    """One step of the scheduler with every sequence sampling ``token`` (``sample_and_finish``); its output."""
    out = scheduler.schedule()
    sample_and_finish(scheduler, out, token)
    return out


def check_paged_parity(model: torch.nn.Module, hf: torch.nn.Module, name: str, tol: float = 1e-4,
                       vocab: int = 320, decode_steps: int = 4, lengths: tuple[int, int, int] = (7, 19, 12),
                       prefix: int = 11, seed: int = 3, check_prefix: bool = True,
                       **harness_kwargs) -> None:  # fmt: skip
    """``model`` on a paged cache against ``hf``'s uncached forward: a prefill, then a batch mixing two
    whole prompts (``lengths[0]``, ``lengths[2]`` tokens) with the rest of a third (``lengths[1]``) on its cached
    ``prefix``-token prefix, then ``decode_steps`` decode steps of all three; every logit row within ``tol``
    relative error (the first prefill's too, unless ``check_prefix`` is off). ``harness_kwargs`` go to
    ``PagedHarness``: a GPU test names its device and backend there."""
    gen = torch.Generator().manual_seed(seed)
    seqs = {s: torch.randint(4, vocab, (n,), generator=gen).tolist() for s, n in zip("abc", lengths)}
    harness = PagedHarness(model, **harness_kwargs)
    first = harness.step([("b", seqs["b"][:prefix])])[0]
    if check_prefix:
        err = relative_error(first.cpu(), hf_logits(hf, seqs["b"][:prefix]))
        assert err < tol, f"{name} first prefill: relative error {err:.2e}"
    out = harness.step([("a", seqs["a"]), ("b", seqs["b"][prefix:]), ("c", seqs["c"])])
    for (seq, start), got in zip((("a", 0), ("b", prefix), ("c", 0)), out):
        err = relative_error(got.cpu(), hf_logits(hf, seqs[seq])[start:])
        assert err < tol, f"{name} prefill {seq}: relative error {err:.2e}"
    for step in range(decode_steps):
        for s in seqs:
            seqs[s].append(int(torch.randint(4, vocab, (1,), generator=gen)))
        got = torch.cat(harness.step([(s, [seqs[s][-1]]) for s in seqs])).cpu()
        want = torch.stack([hf_logits(hf, seqs[s])[-1] for s in seqs])
        err = relative_error(got, want)
        assert err < tol, f"{name} decode step {step}: relative error {err:.2e}"


def dummy_preset(monkeypatch, base: str, name: str, **config) -> str:
    """``dummy:<name>``: preset ``base`` with ``config``'s fields over its config.json (small sizes for a CPU test),
    registered for the test's duration."""
    from graphserve.models.presets import PRESETS

    spec = {**PRESETS[base]}
    spec["config"] = {**spec["config"], **config}
    monkeypatch.setitem(PRESETS, name, spec)
    return f"dummy:{name}"

