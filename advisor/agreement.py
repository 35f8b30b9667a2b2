"""One state on every rank of a torch.distributed job.

`optimize` called on every rank of a job (a DDP or FSDP2 model) steers itself by what each rank finds alone: the
patterns its profile shows, whether its outputs match the unpatched model's, how long its calls take. Left to each
rank, timing noise and rank-local data could patch different kernels on different ranks, and where the model's
calls are collective (FSDP2 all-gathers parameters in every forward) a rank that makes one more call than another
waits forever. So each such value is rank 0's, broadcast (`agreed`): every rank then takes the same branches, makes
the same number of calls and keeps the same state, decided once. Outside a job (no process group, or one rank)
every value is the rank's own and nothing is sent.

Below every stage (the clocks, the output checks and the workflows all agree their values), beside
`advisor.stopwatch`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

DECIDING_RANK = 0


@dataclass(frozen=True)
class Job:
    """The torch.distributed job this process is a rank of."""

    rank: int
    world_size: int
    backend: str


@dataclass(frozen=True)
class Agreement:
    """What a job agreed during one `optimize` (apply.json `distributed`): the names of the values rank 0 decided
    and broadcast, with how many times each was."""

    rank: int
    world_size: int
    backend: str
    decided_by: int
    agreed: dict  # what -> times broadcast

    def to_json(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "decided_by": self.decided_by, "agreed": dict(self.agreed)}


def job() -> Job | None:
    """This process's job, or None outside one (torch.distributed not initialised, or a world of one)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return Job(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


_recording: list[dict] = []  # the counts of the `recorded` blocks open, innermost last


def agreed(value, what: str):
    """`value` as the deciding rank has it, on every rank of the job; `value` itself outside one. Every rank calls
    this at the same point of the same code path (it is a collective): values that steer the path are agreed
    before the path forks on them. `what` names the value in apply.json's `distributed.agreed`."""
    current = job()
    if current is None:
        return value
    import torch.distributed as dist

    box = [value if current.rank == DECIDING_RANK else None]
    dist.broadcast_object_list(box, src=DECIDING_RANK)
    for counts in _recording:
        counts[what] = counts.get(what, 0) + 1
    return box[0]


def everywhere(flag: bool, what: str) -> bool:
    """Whether `flag` holds on every rank of the job (`flag` itself outside one): for what each rank must have to
    go on (a stored plan in its own cache), where rank 0 having it is not enough."""
    current = job()
    if current is None:
        return flag
    import torch.distributed as dist

    flags: list = [None] * current.world_size
    dist.all_gather_object(flags, bool(flag))
    for counts in _recording:
        counts[what] = counts.get(what, 0) + 1
    return all(flags)


@contextlib.contextmanager
def recorded():
    """Inside the block, what is agreed is counted; yields a function returning the `Agreement` so far (None
    outside a job)."""
    counts: dict = {}
    _recording.append(counts)
    current = job()
    try:
        yield lambda: None if current is None else Agreement(current.rank, current.world_size, current.backend,
                                                             DECIDING_RANK, dict(sorted(counts.items())))
    finally:
        _recording[:] = [c for c in _recording if c is not counts]
