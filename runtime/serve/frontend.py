"""A front-end process of ``mambatrt serve`` (the ``multiprocessing`` spawn target): uvicorn serving the HTTP API
(:mod:`.http`) on the engine process's listening socket, until it has drained after SIGTERM or SIGINT, or until the
engine process goes away."""

from __future__ import annotations

import signal

from ..bundle import load_bundle
from ..tokenizer import Tokenizer, eos_id
from .chat import ChatTemplate
from .client import SERVE_KEEP_ALIVE_S, SHUTDOWN_GRACE_S, EngineClient
from .http import FrontEnd, create_app


def frontend_main(
    index: int,
    count: int,
    sock,
    commands,
    events,
    bundle_dir: str,
    model_name: str,
    api_key: str | None = None,
    chat_template: str | None = None,
) -> None:
    """Serve until drained: SIGTERM or SIGINT make new requests get 503 while those in flight finish (those still
    running after SHUTDOWN_ABORT_S end aborted); then uvicorn closes the listener and exits."""
    import uvicorn

    bundle = load_bundle(bundle_dir, verify=False)  # the engine process verified it
    tokenizer = Tokenizer(bundle) if bundle.tokenizer_path else None
    client = EngineClient(index, count, commands, events, tokenizer)
    template = ChatTemplate.load(chat_template, bundle)
    front = FrontEnd(client, tokenizer, model_name, bundle.config.vocab_size, eos_id(bundle), api_key, template)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # uvicorn's handler of SIGINT and SIGTERM while it runs
            if front.draining and sig == signal.SIGINT:  # a second Ctrl-C: now
                self.should_exit = self.force_exit = True
            front.draining = True  # new requests get 503; _drain then ends the server

    server: DrainingServer | None = None

    def drained() -> None:
        server.should_exit = True

    config = uvicorn.Config(
        create_app(front, drained),
        log_level="warning",
        timeout_keep_alive=SERVE_KEEP_ALIVE_S,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        lifespan="on",
    )
    server = DrainingServer(config)
    client.on_lost = lambda: setattr(server, "should_exit", True)
    # A stop asked before uvicorn takes the signals (while it starts) drains it as soon as it runs. (SIGINT was
    # ignored from this process's start, as the engine process spawned it: Ctrl-C during the imports above prints
    # no traceback; the engine process answers it by sending SIGTERM.)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(front, "draining", True))
    server.run(sockets=[sock])
