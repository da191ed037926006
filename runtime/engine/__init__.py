"""The engine: continuous batching over a runner's slot pool (:mod:`.core`), with its scheduler, executor and
output processor; what goes in (:class:`Request`, :class:`Sampling`) and what comes out (:class:`Event`)."""

from .config import EngineConfig
from .core import Engine
from .request import EngineStopped, Event, QueueFull, Request
from .sampling import Sampling
from .state_cache import StateCache

__all__ = ["Engine", "EngineConfig", "EngineStopped", "Event", "QueueFull", "Request", "Sampling", "StateCache"]
