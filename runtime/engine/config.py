"""The engine's configuration: built once (from the command line by `serve`, or by `run`, `bench` and `eval`),
validated here, never changed afterwards."""

from __future__ import annotations

from dataclasses import dataclass

from mambatrt.errors import InputError

DEFAULT_MAX_QUEUE = 256  # requests waiting beyond which the server answers 429
# On a GPU new prompts gather to half the running sequences (at most one prefill launch's prompts) before a prefill
# round: lower ITL p50 at concurrency 64 on the H200 (fp16 and fp32), later first tokens. On the CPU the servers
# disagreed and first tokens came later in all: off there (docs/experiments.md).
GATHER_RATIO_CUDA = 0.5
DEFAULT_MAX_WAITING_TOKENS = 20


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules.

    ``max_batch``: sequences decoding at once (None: the bundle's); ``max_queue``: requests waiting before
    QueueFull; ``cache_bytes``: the prefix cache's budget (0: no cache); ``prefill_rows``: prompt rows prefilled per
    iteration (None: one full chunk, and where one launch prefills several prompts a chunk for each staging row on
    a GPU, four chunks on a CPU); ``waiting_served_ratio`` and ``max_waiting_tokens``: while sequences decode, new
    prompts gather until they number ratio x the running sequences or have waited that many decode iterations
    (0: prefill as soon as a prompt waits); ``token_by_token``: prompts go through the decode graph one token per
    launch even where a prefill graph exists (``bench``'s comparison); ``pipelined``: None lets the runner decide
    (prefill beside decode, host work beside the decode launch, launches begun ahead and fed on the device, where
    the slot pool runs its launches on streams of their own: CUDA with the kernels graphs); True or False choose
    (tests exercise both schedules on the CPU).
    """

    max_batch: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    cache_bytes: int = 0
    prefill_rows: int | None = None
    waiting_served_ratio: float = 0.0
    max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS
    token_by_token: bool = False
    pipelined: bool | None = None

    def __post_init__(self) -> None:
        if self.max_batch is not None and self.max_batch < 1:
            raise InputError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 1:
            raise InputError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.cache_bytes < 0:
            raise InputError(f"--state-cache-mib must be >= 0, got {self.cache_bytes / 2**20:g}")
        if self.prefill_rows is not None and self.prefill_rows < 1:
            raise InputError(f"--prefill-rows must be >= 1, got {self.prefill_rows}")
        if not self.waiting_served_ratio >= 0 or self.max_waiting_tokens < 0:  # NaN too
            raise InputError("the waiting-served ratio and max waiting tokens must be >= 0")

    @classmethod
    def serving(cls, device: str, **fields) -> EngineConfig:
        """The configuration `serve` runs with on ``device`` ("cpu" or "cuda"): prompts gather on a GPU."""
        gather = GATHER_RATIO_CUDA if device == "cuda" else 0.0
        return cls(**{"waiting_served_ratio": gather, **fields})
