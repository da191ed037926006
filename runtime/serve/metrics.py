"""The Prometheus metrics of ``mambatrt serve``, rendered by the engine process: request and token counters, the
latencies each HTTP front end measured (as its clients see them), and the engine's own totals (where its time goes,
what its launches carried)."""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ..engine import Engine, Event
from ..memory import peak_resident_bytes, resident_bytes

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)  # seconds


class _Histogram:
    """A Prometheus histogram fed in bulk: the front ends send their latencies in batches (thousands per second at
    high concurrency), added here with one ``searchsorted`` per batch rather than one ``observe`` call each."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # the last: above every bound
        self.sum = 0.0
        self.lock = threading.Lock()

    def add(self, values: list[float]) -> None:
        if not values:
            return
        v = np.asarray(values, dtype=np.float64)
        where = np.searchsorted(self.bounds, v, side="left")  # bucket i: value <= bounds[i]
        with self.lock:
            self.counts += np.bincount(where, minlength=len(self.counts))
            self.sum += float(v.sum())

    def collect(self):
        with self.lock:
            cumulative, total = np.cumsum(self.counts), self.sum
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        buckets = [(le, float(c)) for le, c in zip(les, cumulative, strict=True)]
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class Metrics:
    """The Prometheus metrics of one server (a registry of its own). Counts come from the engine's events here;
    latencies from the front ends, measured where the client sees them."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("mambatrt_num_requests_running", "Sequences in decode slots", registry=r)
        self.waiting = Gauge("mambatrt_num_requests_waiting", "Requests queued or prefilling", registry=r)
        self.prompt_tokens = Counter("mambatrt_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter(
            "mambatrt_cached_prompt_tokens", "Prompt tokens served from the state cache", registry=r
        )
        self.generation_tokens = Counter("mambatrt_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("mambatrt_requests", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = _Histogram("mambatrt_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = _Histogram("mambatrt_inter_token_latency_seconds", "Time between tokens", LATENCY_BUCKETS)
        r.register(self.ttft)
        r.register(self.itl)
        self.engine = engine
        r.register(_EngineTotals(engine))
        self.memory = _Memory()
        r.register(self.memory)

    def finished(self, event: Event) -> None:
        self.generation_tokens.inc(event.completion_tokens)
        self.cached_tokens.inc(event.cached_tokens)
        self.requests.labels(event.finish_reason or "abort").inc()

    def observed(self, ttft: list[float], itl: list[float]) -> None:
        self.ttft.add(ttft)
        self.itl.add(itl)

    def render(self) -> bytes:
        stats = self.engine.stats()
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        return generate_latest(self.registry)


class _EngineTotals:
    """The engine's counters since its start, read at each scrape: where its time goes (prefill against decode: the
    GPU's share of each, with their host work) and how many prompt rows each prefill launch carried."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        t = self.engine.stats()
        busy = CounterMetricFamily(
            "mambatrt_engine_busy_seconds", "Engine time in prefill and decode (launches, host work)", labels=["phase"]
        )
        busy.add_metric(["prefill"], t["prefill_seconds"])
        busy.add_metric(["decode"], t["decode_seconds"])
        yield busy
        yield CounterMetricFamily("mambatrt_engine_iterations", "Engine iterations", value=t["iterations"])
        yield CounterMetricFamily("mambatrt_prefill_launches", "Prefill launches", value=t["prefill_launches"])
        yield CounterMetricFamily("mambatrt_prefill_rows", "Prompt rows prefilled", value=t["prefill_rows"])
        picked = CounterMetricFamily(
            "mambatrt_pool_sampled_tokens",
            "Tokens picked for a whole launch at once (the GPU's sampler, a greedy argmax), not by the host's sampler",
            labels=["token"],
        )
        picked.add_metric(["first"], t["pool_first_tokens"])
        picked.add_metric(["next"], t["pool_next_tokens"])
        yield picked
        launches = CounterMetricFamily(
            "mambatrt_decode_launches",
            "Decode launches, by where their token ids came from: the host, or the launch before's picks on the device",
            labels=["ids"],
        )
        launches.add_metric(["host"], t["decode_launches"] - t["fed_launches"])
        launches.add_metric(["device"], t["fed_launches"])
        yield launches


class _Memory:
    """Resident memory of the server's processes, read at each scrape, and the bound they stay within
    (:func:`~mambatrt.runtime.memory.memory_bound`, set once the server is ready)."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}  # process name -> pid ("engine" is this one)
        self.idle = 0
        self.bound = 0

    def collect(self):
        resident = GaugeMetricFamily(
            "mambatrt_resident_memory_bytes", "Resident memory of each process of the server", labels=["process"]
        )
        peak = GaugeMetricFamily(
            "mambatrt_peak_resident_memory_bytes", "Largest resident memory of each process so far", labels=["process"]
        )
        for name, pid in self.pids.items():
            resident.add_metric([name], resident_bytes(pid))
            peak.add_metric([name], peak_resident_bytes(pid))
        yield resident
        yield peak
        yield GaugeMetricFamily(
            "mambatrt_idle_resident_memory_bytes", "Resident memory of all processes when the server became ready",
            value=self.idle,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "mambatrt_memory_bound_bytes",
            "Resident memory the server stays within at its limits (docs/serving.md, Memory)",
            value=self.bound,
        )
