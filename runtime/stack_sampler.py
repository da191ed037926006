"""A sampling profiler of one thread (`serve --profile`'s engine-samples.txt).

From Python 3.12 on, cProfile runs on ``sys.monitoring``, which sees every thread of the process: the engine
thread's statistics then mix in the prefill launches' thread (and its call counts and cumulative times go wrong),
so they cannot say where the engine thread's own time goes. Sampling that one thread's stack at a fixed interval
can, on every Python version, at the cost of a sampler thread that takes the GIL once per sample.
"""

from __future__ import annotations

import collections
import sys
import threading

Site = tuple[str, int, str]  # a function: file, first line, name


class StackSampler:
    """Samples thread ``ident``'s Python stack every ``interval`` seconds between :meth:`start` and :meth:`stop`;
    :meth:`report` gives each function's share of the samples, as the innermost frame (self) and anywhere on the
    stack (inclusive)."""

    def __init__(self, ident: int, interval: float = 0.002) -> None:
        self.ident, self.interval = ident, interval
        self.samples = 0  # samples that found the thread
        self.own: collections.Counter[Site] = collections.Counter()
        self.anywhere: collections.Counter[Site] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mambatrt-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.ident)
            if frame is None:
                continue
            self.samples += 1
            seen: set[Site] = set()
            innermost = True
            while frame is not None:
                code = frame.f_code
                site = (code.co_filename, code.co_firstlineno, code.co_name)
                if innermost:
                    self.own[site] += 1
                    innermost = False
                if site not in seen:  # a recursive function counts once per sample
                    seen.add(site)
                    self.anywhere[site] += 1
                frame = frame.f_back

    def report(self, top: int = 40) -> str:
        """The ``top`` functions by inclusive share, then by own share: one line each."""
        n = max(self.samples, 1)
        lines = [f"{self.samples} samples of thread {self.ident}, every {self.interval * 1e3:g} ms"]
        for title, counts in (("anywhere on the stack", self.anywhere), ("innermost (own time)", self.own)):
            lines.append(f"-- {title}: % of samples, function (file:line)")
            for (path, line, name), count in counts.most_common(top):
                lines.append(f"{count / n * 100:6.1f} %  {name} ({path}:{line})")
        return "\n".join(lines) + "\n"
