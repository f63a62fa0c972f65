"""The plan's answer in words: does concurrency C fit this model on these GPUs at these flags?

The first story asked it of SGLang with a crash ("does C=64 fit at --mem-fraction-static 0.70 with
--cuda-graph-max-bs 64?"). The answer is read off the plan (analysis/plan.py), itself computed from the family's
description: what one GPU holds (weights, graph pool, activations, reserve), the KV pool that leaves and the tokens it
holds at the model's bytes per token, and for each concurrency the tokens its requests hold at the asked length.
Whether the engine starts at all (one request of --max-model-len in the pool) is said apart, with the knob, since
a request of the asked length may fit where one of --max-model-len does not.
"""

from __future__ import annotations

from typing import Any

from graphserve.engine.memory import gib


def answer(p: dict[str, Any], input_len: int, output_len: int) -> list[dict[str, Any]]:
    """One answer per concurrency level of plan ``p``: ``fits`` (bool) and ``text``, a sentence with the numbers."""
    m = p["memory"]
    gpus = f"{p['tp']} x {m['total_bytes'] / 1e9:g} GB" if p["tp"] > 1 else f"one {m['total_bytes'] / 1e9:g} GB GPU"
    sizes = p["captured_sizes"]
    largest = max(sizes, default=0)
    held = (f"weights {gib(m['weights_bytes']):.2f} GiB, cuda graph pool {gib(m['graph_pool_bytes']):.2f} GiB "
            f"(sizes up to {largest}), activations {gib(m['activation_bytes']):.2f} GiB and reserve "
            f"{gib(m['reserve_bytes']):.2f} GiB per GPU of a {gib(m['static_bytes']):.2f} GiB static budget "
            f"(--mem-fraction-static {m['mem_fraction_static']:g}) leave a KV pool of "
            f"{gib(max(m['kv_pool_bytes'], 0)):.2f} GiB: {m['kv_tokens']} tokens at {m['kv_bytes_per_token']} B/token")
    if m.get("latent_pages"):  # latents paged apart: the windows' pages first, the blocks the rest
        held = held.removesuffix(f"at {m['kv_bytes_per_token']} B/token") + (
            f"at {m['kv_bytes_per_token'] - m['latent_bytes_per_token']} B/token held for the whole context, beside "
            f"{m['latent_pages']} latent pages of {m['block_size']} tokens at {m['latent_bytes_per_token']} B/token "
            f"for the running windows of {m['latent_window']} tokens")
    out = []
    for v in p["verdicts"]:
        c, batch, need = v["concurrency"], v["batch"], v["kv_tokens_needed"]
        per_request = need // max(batch, 1)
        in_pool = need <= m["kv_tokens"]
        graphs = v.get("verdict") != "out of memory" or m["fits"]  # an eager oversize batch is the other OOM
        fits = bool(m["fits"] and in_pool and v["verdict"] == "fits")
        ask = (f"C={c} at {input_len + output_len} tokens a request (--input-len {input_len} + --output-len "
               f"{output_len}) on {gpus}")
        why = [f"{batch} running requests hold {batch} x {per_request} = {need} KV tokens, "
               + (f"within the pool's {m['kv_tokens']}" if in_pool else
                  f"more than the pool's {m['kv_tokens']} (it holds {m['kv_tokens'] // max(per_request, 1)} of them "
                  "at once; the rest wait or are preempted)")]  # fmt: skip
        if largest and batch <= largest:
            why.append(f"every decode step of {batch} replays a captured graph (largest {largest})")
        elif sizes:
            why.append(f"a decode batch of {batch} is above the largest captured size {largest}"
                       + ("" if graphs else " and runs eagerly, out of memory"))
        why += [n for n in v["notes"] if n.startswith("queues")]
        if not m["fits"]:
            why.append(f"but the engine refuses to start at --max-model-len {m['max_model_len']}: {m['refusal']}")
        text = f"{ask}: {'FITS' if fits else 'DOES NOT FIT'}. {held[0].upper()}{held[1:]}; " + "; ".join(why) + "."
        out.append({"concurrency": c, "fits": fits, "text": text})
    return out
