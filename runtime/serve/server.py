"""``mambatrt serve``'s engine process, from its configuration to its exit: the port, the bundle, the runner, the
engine and its captures, the HTTP front ends (:mod:`.host`), until Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from mambatrt.errors import InputError

from ..bundle import load_bundle
from ..engine import Engine, EngineConfig
from ..memory import memory_bound, resident_bytes
from ..runners import DEVICES, open_runner
from ..tokenizer import Tokenizer, eos_id

DEFAULT_PORT = 8000
API_SERVERS_CUDA = 2  # HTTP front ends by default on a GPU (one on the CPU, which the engine's threads need)
# The engine thread and the router thread share the engine process's GIL, which Python hands over every 5 ms by
# default: an engine thread back from a decode launch could wait that long (a whole inter-token gap at high
# concurrency). `serve` shortens it: 4-5 % more tokens/s at concurrency 1 and 64 on the H200 when the HTTP loop
# still shared the process (within what runs vary by).
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ServeConfig:
    """What `serve` serves, where, and how: built once from the command line, checked here.

    ``device``: as :data:`~mambatrt.runtime.runners.DEVICES`; ``threads``: onnxruntime's intra-op threads (0: one
    per core); ``api_server_count``: HTTP front-end processes (None: two on a GPU, one on the CPU);
    ``served_model_name``: the model name clients use (None: the bundle's folder); ``api_key``: the bearer key
    requests must carry (None: none); ``chat_template``: a Jinja file for /v1/chat/completions (None: the
    tokenizer's, if it has one); ``engine``: the engine's
    (:meth:`EngineConfig.serving` fills its device defaults once the device is known).
    """

    bundle: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    device: str = "auto"
    threads: int = 0
    api_server_count: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None
    engine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise InputError(f"--port must be in 1..65535, got {self.port}")
        if self.device not in DEVICES:
            raise InputError(f"unknown device '{self.device}'; choose one of {', '.join(DEVICES)}")
        if self.threads < 0:
            raise InputError(f"--threads must be >= 0, got {self.threads}")
        if self.api_server_count is not None and self.api_server_count < 1:
            raise InputError(f"--api-server-count must be >= 1, got {self.api_server_count}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable() or " " in self.api_key):
            raise InputError("the API key must be printable characters without spaces")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise InputError(f"--chat-template {self.chat_template}: no such file")
        EngineConfig(**self.engine)  # its own checks, before anything loads


def serve(config: ServeConfig) -> int:
    """Serve until Ctrl-C or SIGTERM (exit 0) or until an HTTP front end fails (exit 1)."""
    try:
        from .frontend import frontend_main
        from .host import FrontEndFailed, ServingHost, listening_socket
        from .metrics import Metrics
    except ImportError as exc:
        raise InputError(
            f"serving needs fastapi, uvicorn and prometheus-client ({exc}); pip install 'mambatrt[serve]'"
        ) from None
    sock = listening_socket(config.host, config.port)  # a taken port is said before the engine loads
    try:
        engine, name = _open_engine(config)
    except BaseException:
        sock.close()
        raise
    api_servers = config.api_server_count or (API_SERVERS_CUDA if engine.runner.device == "cuda" else 1)
    _say(_summary(config, engine, name, api_servers))
    stop = threading.Event()
    # Ctrl-C or SIGTERM: the front ends stop accepting and finish their requests while the engine still runs them
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    host = ServingHost(engine, Metrics(engine))
    failed = None
    try:
        shapes, seconds = engine.warm()
        if shapes:
            _say(f"captured {shapes} launch shapes in {seconds:.1f} s")
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        engine.start()
        for note in engine.runner.notes:  # e.g. why prefill launches keep the whole GPU, a graph not captured
            _say(note)
        if not stop.is_set():
            sock.listen(2048)
            frontend = dict(bundle_dir=str(engine.runner.bundle.path), model_name=name, api_key=config.api_key)
            frontend["chat_template"] = config.chat_template
            host.start(sock, api_servers, frontend_main, frontend, stop)
            if not stop.is_set():
                _say(_measure_memory(host, engine, api_servers))
                _say("ready")
            host.wait(stop)
    except FrontEndFailed as exc:
        failed = str(exc)
    finally:
        host.shutdown()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.stop()
        engine.runner.close()
    if failed is not None:
        _say(failed)
        return 1
    return 0


def _open_engine(config: ServeConfig) -> tuple[Engine, str]:
    """The engine of ``config``'s bundle on its device, and the model name clients use."""
    from .chat import ChatTemplate

    bundle = load_bundle(config.bundle)
    tokenizer = Tokenizer(bundle) if bundle.tokenizer_path else None
    if ChatTemplate.load(config.chat_template, bundle) is not None and tokenizer is None:
        raise InputError(f"{bundle.path} has no tokenizer, which chat needs; serve it without --chat-template")
    runner = open_runner(bundle, config.device, config.threads, prefill_beside_decode=True)
    try:
        engine_config = EngineConfig.serving(runner.device, **config.engine)
        decode_text = tokenizer.stream if tokenizer is not None else None
        engine = Engine(runner, engine_config, eos_id=eos_id(bundle), decode_text=decode_text)
    except BaseException:
        runner.close()
        raise
    return engine, config.served_model_name or bundle.path.resolve().name


def _summary(config: ServeConfig, engine: Engine, name: str, api_servers: int) -> str:
    """The line `serve` starts with: what it serves, on what, with how much memory for states."""
    runner, pool, mib = engine.runner, engine.pool, 2**-20
    bundle, cache = runner.bundle, engine.cache
    buffers = f" x {pool.state_buffers} buffers" if pool.state_buffers > 1 else ""
    gather = engine.scheduler.ratio
    where = f"{runner.name} on {runner.device}"
    if runner.device == "cuda" and engine.pipelined:
        sms = getattr(runner, "prefill_sms", 0)
        where += f", prefill beside decode{f' on {sms} SMs' if sms else ''}"
    return (
        f"{name} ({bundle.layout}, {bundle.precision}, {runner.flavour} graphs), {where}: "
        f"{engine.max_batch} slots of {pool.slot_bytes * mib:.2f} MiB{buffers} = {pool.slots_bytes * mib:.1f} MiB "
        f"of states, {pool.staging_rows} prompt(s) per prefill launch ({pool.staging_bytes * mib:.1f} MiB of "
        f"staging), {engine.scheduler.prefill_rows} prompt rows per iteration, state cache "
        f"{cache.max_bytes * mib:g} MiB ({cache.capacity} states), "
        f"{f'prompts gather to {gather:g} x running, ' if gather else ''}"
        f"{api_servers} HTTP front end(s); http://{config.host}:{config.port}/v1"
        f"{' (API key required)' if config.api_key else ''}"
    )


def _measure_memory(host, engine: Engine, api_servers: int) -> str:
    """The resident memory of every process now (idle) and the bound at the limits, into /metrics; the line that
    says them."""
    from .protocol import MAX_LOGPROB_ENTRIES, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS

    memory = host.metrics.memory
    memory.pids = {"engine": os.getpid(), **{f"frontend{f.index}": f.process.pid for f in host.frontends}}
    memory.idle = sum(resident_bytes(pid) for pid in memory.pids.values())
    limits = {"prompt_tokens": MAX_PROMPT_TOKENS, "new_tokens": MAX_NEW_TOKENS, "logprobs": MAX_LOGPROB_ENTRIES}
    max_queue = engine.config.max_queue
    memory.bound = memory_bound(memory.idle, engine.max_batch, max_queue, api_servers, limits)
    return (
        f"{memory.idle / 2**20:.0f} MiB resident at idle; at most {memory.bound / 2**30:.1f} GiB with "
        f"{engine.max_batch} running and {max_queue} waiting requests at the request limits (docs/serving.md)"
    )


def _say(message: str) -> None:
    print(f"mambatrt serve: {message}", file=sys.stderr, flush=True)
