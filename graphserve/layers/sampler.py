"""Token sampling for a whole batch at once, on the logits' device.

Every per-request knob is a [B] tensor, so one step costs the same few kernels whatever the
mix of requests, and the only device->host copy is the final ids (+ logprobs).

Randomness is counter-based: the noise for (seed, output index, vocab id) is an integer hash
computed with int64 tensor ops, and a token is drawn by a Gumbel race
(argmax of logits/T + Gumbel noise, which samples softmax(logits/T) exactly). A request's
draws therefore depend only on its own seed and position, never on what else is in the batch,
and CPU and GPU produce the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphserve.kernels.argmax import greedy_argmax


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


# splitmix64 constants as signed int64 (tensor arithmetic wraps modulo 2**64)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
SEED_MASK = (1 << 63) - 1

# A sequence's knob rows (engine/sampling_inputs.py ``knob_row``): floats are temperature, top_p, min_p, presence,
# frequency, repetition; ints are the columns below; FLAG_* bits are OR-ed into INT_FLAGS.
NUM_FLOAT_KNOBS = 6
NUM_INT_KNOBS = 5
INT_TOP_K, INT_SEED, INT_MIN_TOKENS, INT_LOGPROBS, INT_FLAGS = range(NUM_INT_KNOBS)
FLAG_GREEDY, FLAG_TOP_P, FLAG_MIN_P, FLAG_PENALTY = 1, 2, 4, 8


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1), a pure function of (seed, step, vocab id)."""
    row = _mix(_mix(seeds + _GOLDEN) + steps * _GOLDEN)
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    # Top 23 bits, so bits + 0.5 (24 significant bits) is exact in float32 and u < 1 strictly. With 24
    # bits the largest value rounded to u = 1.0, a Gumbel noise of +inf, and -inf + inf = NaN wins the
    # argmax: a token masked by top-k/top-p or a grammar was drawn about once per 2**24 draws per token.
    bits = _shr(_mix(row[:, None] + vocab[None, :] * _GOLDEN), 41)
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row sampling knobs, already on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor  # [B] int64; vocab size when off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index of the token being sampled in the output
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32
    output_counts: torch.Tensor | None  # [B, V] float32 occurrences in the output; None without penalties
    prompt_mask: torch.Tensor | None  # [B, V] bool, token occurs in the prompt (repetition penalty)
    banned: torch.Tensor | None  # [B, V] bool: eos/stop ids blocked until min_tokens
    max_logprobs: int  # largest top-k asked for in the batch; -1: no row wants logprobs
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Structured output: xgrammar-layout bitmasks ([R, ceil(V/32)] int32, bit j of word i allows token
    # 32*i + j) for the rows in ``mask_rows`` ([R] int64; None: every row, in order). None: no row is constrained.
    token_mask: torch.Tensor | None = None
    mask_rows: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None  # logprob of each sampled token (raw distribution)
    top_ids: list[list[int]] | None = None  # [B][max_logprobs], best first
    top_logprobs: list[list[float]] | None = None


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.output_counts is None:
        return logits
    seen = t.output_counts > 0
    if t.prompt_mask is not None:
        seen = seen | t.prompt_mask
    rep = t.repetition[:, None].expand_as(logits)
    # Repetition penalty pushes seen tokens towards "less likely" whatever the logit's sign.
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - t.frequency[:, None] * t.output_counts
    return logits - t.presence[:, None] * (t.output_counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus."""
    if not (t.any_top_k or t.any_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if t.any_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= t.top_k[:, None], float("-inf"))
    if t.any_top_p:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token when the mass strictly before it is below top_p; the first always stays, even when top_p
        # rounds to 0 in float32 (a top_p of 1e-46 once masked every token and sampled id 0).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill((before >= t.top_p[:, None]) & (before > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def unpack_token_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] bool, True where the token is allowed, from a packed [R, ceil(V/32)] int32 bitmask.

    The int32 words are read as little-endian bytes (both x86 hosts and CUDA devices are), so byte b
    of a row holds the bits of tokens 8b..8b+7, lowest bit first."""
    rows = mask.shape[0]
    as_bytes = mask.contiguous().view(torch.uint8).view(rows, -1)
    shifts = torch.arange(8, device=mask.device, dtype=torch.uint8)
    bits = (as_bytes[:, :, None] >> shifts) & 1
    return bits.view(rows, -1)[:, :vocab_size].bool()


def apply_token_mask(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Disallowed tokens of the constrained rows to -inf (out of place: the raw logits feed logprobs)."""
    if t.token_mask is None:
        return logits
    allowed = unpack_token_mask(t.token_mask, logits.shape[-1])
    if t.mask_rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    rows = t.mask_rows
    return logits.index_copy(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def apply_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if not t.any_min_p:
        return logits
    probs = logits.softmax(dim=-1)
    floor = t.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


class PendingSample:
    """A step's sampled ids (and logprobs) on their way to the host.

    The device->host copy is queued at construction and waited for only in ``result``, so the host
    can prepare the next step meanwhile; ``ids`` stays on the device for the next step's inputs.
    """

    def __init__(self, ids: torch.Tensor, packed: torch.Tensor | None, num_top: int):
        self.ids = ids  # [B] int64 on the logits' device
        self._num_top = num_top
        src = ids if packed is None else packed
        self._event = None
        if src.is_cuda:
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = src
        self._packed = packed is not None

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        host = self._host
        if not self._packed:
            return SamplerOutput(token_ids=host.tolist())
        k = self._num_top
        return SamplerOutput(
            token_ids=host[:, 0].long().tolist(),
            logprobs=host[:, 1].tolist(),
            top_ids=host[:, 2 : 2 + k].long().tolist(),
            top_logprobs=host[:, 2 + k :].tolist(),
        )


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        return self.sample(logits, t).result()

    def sample(self, logits: torch.Tensor, t: SamplingTensors) -> PendingSample:
        """``logits``: [B, V] straight from the model (any float dtype; the math below runs in float32).
        Queues the copy of the ids to the host."""
        if t.all_greedy and t.output_counts is None and t.banned is None and t.token_mask is None:
            # nothing to adjust: the argmax is the same in any float dtype (on CUDA the split Triton argmax,
            # kernels/argmax.py: torch's reduction costs 21-35 us on an H200 where the read takes ~4)
            ids = greedy_argmax(logits)
        else:
            ids = self._draw(logits, t)
        if t.max_logprobs < 0:
            return PendingSample(ids, None, 0)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(-1, ids[:, None])
        k = t.max_logprobs
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], ids[:, None][:, :0])
        # One device->host copy: ids and logprobs packed in float64 (ids < 2**53 are exact).
        packed = torch.cat([ids[:, None].double(), chosen.double(), top_ids.double(), top_lp.double()], dim=1)
        return PendingSample(ids, packed, k)

    @staticmethod
    def _draw(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        logits = apply_penalties(logits.float(), t)
        if t.banned is not None:
            logits = logits.masked_fill(t.banned, float("-inf"))
        logits = apply_token_mask(logits, t)
        greedy_ids = greedy_argmax(logits)
        if t.all_greedy:
            return greedy_ids
        greedy = t.temperature == 0
        temp = torch.where(greedy, torch.ones_like(t.temperature), t.temperature)
        scaled = apply_min_p(apply_top_k_top_p(logits / temp[:, None], t), t)
        gumbel = -torch.log(-torch.log(uniform_noise(t.seeds, t.steps, logits.shape[-1])))
        return torch.where(greedy, greedy_ids, greedy_argmax(scaled + gumbel))
