"""The messages between ``mambatrt serve``'s engine process and its HTTP front-end processes, declared once.

Why two kinds of process: the HTTP loop costs ~50-80 us of Python per streamed token (JSON, server-sent events, the
socket write). In one process it took the GIL from the engine thread: at 11k tokens/s most of a core, and a decode
iteration of 128 sequences took 5.9 ms against 2.73 ms for its launch. So the engine (with
the state slots, the GPU, the state cache) keeps the main process and the HTTP front ends run in processes of their
own (``serve --api-server-count``), each with its own GIL and core.

Each front end has two one-way pipes (``multiprocessing`` Connections, pickled tuples):

front end -> engine (commands)::

    (SUBMIT, rid, prompt ids, Sampling, stop strings, detokenize, score_from, logprobs)
                                                        answered by ACCEPTED or REJECTED; prompt ids: an int32
                                                        array; detokenize: the engine decodes the text (a request
                                                        with stop strings), else its events carry "" and the front
                                                        end decodes; score_from, logprobs: as the engine's Request
    (CANCEL, rid)                                       the client went away: free its slot
    (OBSERVED, ttft seconds, inter-token seconds)       latencies the front end measured (for /metrics)
    (SCRAPE, token, ttft seconds, inter-token seconds)  a /metrics request: answered by SCRAPED
    (READY,)                                            the front end serves

engine -> front end (events)::

    (EVENTS, [event tuple, ...])                        one message per engine iteration, fields as EVENT_FIELDS
    (ACCEPTED, rid)
    (REJECTED, rid, HTTP status, error type, message, param)
    (SCRAPED, token, Prometheus text)
    (STOPPED, message)                                  the engine has stopped (a bug ended its loop)

Request ids are unique across front ends: front end i of n numbers its requests i, i + n, i + 2n, ...
"""

from __future__ import annotations

from typing import NamedTuple

SUBMIT, CANCEL, OBSERVED, SCRAPE, READY = "submit", "cancel", "observed", "scrape", "ready"
EVENTS, ACCEPTED, REJECTED, SCRAPED, STOPPED = "events", "accepted", "rejected", "scraped", "stopped"


class WireEvent(NamedTuple):
    """One engine event as it crosses the pipe: a plain tuple on the wire, without the last two fields where both
    are None (``WireEvent(*fields)`` on arrival)."""

    id: int  # the request
    token: int | None  # None only on a final event without a new token (cancelled, or a stop string hit)
    text: str  # the text this token completes
    finish_reason: str | None  # "stop", "length", "abort"; None while the request goes on
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprob: tuple | None = None  # the token's TokenLogprob, where the request asks for logprobs
    scores: list | None = None  # the scored prompt tokens' TokenLogprobs, once (a request with score_from)


EVENT_FIELDS = WireEvent._fields
