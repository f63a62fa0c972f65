"""Server-side view of a run: /metrics scraped before, every second during, and after, with
graphserve, vLLM and SGLang names mapped onto one vocabulary; and graphserve's step telemetry.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# canonical key -> metric sample names (without the engine prefix) that mean it, per engine.
_NAMES = {
    "running": {"graphserve": ("num_running_reqs", "num_requests_running"),
                "vllm": ("num_requests_running",), "sglang": ("num_running_reqs",)},
    "waiting": {"graphserve": ("num_waiting_reqs", "num_queue_reqs", "num_requests_waiting"),
                "vllm": ("num_requests_waiting",), "sglang": ("num_queue_reqs",)},
    "kv_usage": {"graphserve": ("kv_usage", "token_usage", "kv_cache_usage_perc"),
                 "vllm": ("kv_cache_usage_perc", "gpu_cache_usage_perc"), "sglang": ("token_usage",)},
    "prompt_tokens_total": {e: ("prompt_tokens_total",) for e in ("graphserve", "vllm", "sglang")},
    "generation_tokens_total": {e: ("generation_tokens_total",) for e in ("graphserve", "vllm", "sglang")},
    "step_seconds_sum": {"graphserve": ("step_duration_seconds_sum", "step_time_seconds_sum"),
                         "vllm": ("iteration_time_seconds_sum", "time_per_output_token_seconds_sum"),
                         "sglang": ("time_per_output_token_seconds_sum",)},
    "step_seconds_count": {"graphserve": ("step_duration_seconds_count", "step_time_seconds_count"),
                           "vllm": ("iteration_time_seconds_count", "time_per_output_token_seconds_count"),
                           "sglang": ("time_per_output_token_seconds_count",)},
    # DeepSeek-V4's latent pages, a resource beside the KV blocks (graphserve only)
    "latent_pages_used": {"graphserve": ("latent_pages_used",)},
    "latent_pages_idle": {"graphserve": ("latent_pages_idle",)},
    "latent_pages_total": {"graphserve": ("latent_pages_total",)},
    "preemptions_for_latent_pages": {"graphserve": ("num_preemptions_latent_pages_total",)},
}
_LOOKUP = {f"{eng}:{n}": key for key, per in _NAMES.items() for eng, names in per.items() for n in names}


def normalize(text: str) -> tuple[dict, str | None]:
    """Prometheus text -> ({canonical key: value summed over label sets}, engine name or None)."""
    out: dict[str, float] = {}
    engine = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = _LOOKUP.get(s.name)
            if key is None:
                continue
            engine = engine or s.name.split(":")[0]
            # The first name found wins per key, so two synonyms from one server are not added up.
            src = out.setdefault("_src_" + key, s.name)
            if src == s.name:
                out[key] = out.get(key, 0.0) + float(s.value)
    return {k: v for k, v in out.items() if not k.startswith("_src_")}, engine


class MetricsScraper:
    def __init__(self, session: aiohttp.ClientSession, url: str | None, t0: float, interval_s: float = 1.0):
        self.session, self.url, self.t0, self.interval_s = session, url, t0, interval_s
        self.series: list[dict] = []
        self.before: dict | None = None
        self.after: dict | None = None
        self.engine: str | None = None
        self.error: str | None = None
        self._task: asyncio.Task | None = None

    async def scrape(self) -> dict | None:
        if not self.url or self.error:
            return None
        try:
            async with self.session.get(self.url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    self.error = f"GET {self.url} -> HTTP {resp.status}"
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.error = f"GET {self.url} failed: {type(e).__name__}"
            return None
        values, engine = normalize(text)
        self.engine = self.engine or engine
        values["t"] = round(time.perf_counter() - self.t0, 3)
        return values

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            snap = await self.scrape()
            if snap is not None:
                self.series.append(snap)
            elif self.error:
                return

    async def start(self) -> None:
        self.before = await self.scrape()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.after = await self.scrape() if not self.error else None
        deltas = {}
        if self.before and self.after:
            for k in ("prompt_tokens_total", "generation_tokens_total", "step_seconds_sum", "step_seconds_count"):
                if k in self.before and k in self.after:
                    deltas[k] = self.after[k] - self.before[k]
            if deltas.get("step_seconds_count"):
                deltas["mean_step_ms"] = 1000.0 * deltas.get("step_seconds_sum", 0.0) / deltas["step_seconds_count"]
        return {"url": self.url, "engine": self.engine, "error": self.error, "before": self.before,
                "after": self.after, "deltas": deltas, "series": self.series}


def fetch_telemetry(base_url: str, since: int = 0, timeout_s: float = 5.0) -> list[dict] | None:
    """graphserve's step records after step ``since``; None when the server has no such endpoint."""
    url = f"{base_url.rstrip('/')}/v1/telemetry?since={since}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return list(json.loads(resp.read()).get("records", []))
    except (urllib.error.URLError, OSError, ValueError):
        return None  # 404, connection refused, not JSON: a server without telemetry


def healthy(base_url: str, timeout_s: float = 5.0) -> bool:
    """One GET /health: True on 200."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False
