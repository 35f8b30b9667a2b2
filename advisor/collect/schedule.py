"""Which calls get profiled: `wait` calls run unprofiled, then `warmup` calls are profiled and left out of
the steady state, then `active` calls are profiled and analysed; the rest of the script runs unprofiled.

As `torch.profiler.schedule(wait, warmup, active)`, with one step per completed call of the outermost
nn.Module (no `prof.step()` to add to the script). Why bound it: stacks, shapes and the execution trace
make every profiled op slower, so a training script traced whole spends most of its time being profiled
for nothing; the analyzer wants a warm-up call and a few steady ones (bench/profile_overhead.py).
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from advisor.collect.native_log import without_profiler_chatter
from advisor.errors import AdvisorError


# Calls profiled by default after the warm-up one: the analyzer wants a few steady calls, and a script of many
# small calls profiled whole (20,000 calls, 5 s alone) took 835 s and 12.6 GB. `--calls` / `--schedule` ask for more.
DEFAULT_ACTIVE = 10


@dataclass(frozen=True)
class Schedule:
    wait: int = 0
    warmup: int = 1  # with fewer than two calls recorded nothing is dropped (steady.steady_state)
    active: Optional[int] = None  # None: until the script ends

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """`WAIT,WARMUP,ACTIVE`, e.g. `5,1,3`."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise AdvisorError(f"--schedule takes WAIT,WARMUP,ACTIVE: three whole numbers, e.g. 5,1,3 (got {text!r})")
        wait, warmup, active = map(int, parts)
        if active < 1:
            raise AdvisorError(f"--schedule {text}: ACTIVE must be at least 1")
        return cls(wait, warmup, active)

    @classmethod
    def default(cls) -> "Schedule":
        """What `profile` records when not told: the first call as warm-up, then `DEFAULT_ACTIVE` calls."""
        return cls(0, 1, DEFAULT_ACTIVE)

    @classmethod
    def first_calls(cls, n: int) -> "Schedule":
        """`--calls N`: the first N calls, the first of them warm-up (when there are two or more)."""
        if n < 1:
            raise AdvisorError(f"--calls must be at least 1 (got {n})")
        warmup = 1 if n >= 2 else 0
        return cls(0, warmup, n - warmup)

    @property
    def last_call(self) -> Optional[int]:
        return None if self.active is None else self.wait + self.warmup + self.active

    def as_meta(self) -> dict:
        return asdict(self)


class ProfilerWindow:
    """Starts and stops `prof` as the schedule says, counting outermost nn.Module calls with global hooks.

    The hooks go in after module_scopes' ones, so the last profiled call's scope is closed before the stop.
    """

    def __init__(self, prof, schedule: Schedule, before_stop: Optional[Callable[[], None]] = None):
        self.prof, self.schedule, self.before_stop = prof, schedule, before_stop
        self.running = self.started = False
        self.calls = 0
        self._local = threading.local()
        self._hooks: list = []

    def start(self) -> None:
        with without_profiler_chatter():
            self.prof.start()
        self.running = self.started = True

    def stop(self) -> None:
        """Stop if running; `before_stop` (a CUDA synchronize) runs first, and what it raises is raised."""
        if not self.running:
            return
        self.running = False
        try:
            if self.before_stop is not None:
                self.before_stop()
        finally:
            with without_profiler_chatter():
                self.prof.stop()

    def __enter__(self) -> "ProfilerWindow":
        s = self.schedule
        if s.wait or s.last_call is not None:
            from torch.nn.modules import module as nn_module

            self._hooks = [nn_module.register_module_forward_pre_hook(self._enter),
                           nn_module.register_module_forward_hook(self._leave, always_call=True)]
        if s.wait == 0:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _enter(self, mod, args) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._local.depth == 1 and self.calls == self.schedule.wait and not self.started:
            self.start()  # as the call begins: started after the previous one ended, the trace held a stub of it

    def _leave(self, mod, args, out) -> None:
        self._local.depth = getattr(self._local, "depth", 1) - 1
        if self._local.depth:
            return
        self.calls += 1
        if self.calls == self.schedule.last_call:
            self.stop()
