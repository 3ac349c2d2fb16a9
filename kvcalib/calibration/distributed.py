"""Data-parallel calibration over torch.distributed (`torchrun --nproc-per-node N -m kvcalib calibrate ...`).

Ranks get whole batches of the single process's batching; one all_gather of a status and two all_reduces (absmax:
MAX, counts: SUM) make the scales one process's bit for bit, and the objective's terms are summed exactly. Only
rank 0 writes; a failing rank still joins the status exchange, then all raise; COLLECTIVE_TIMEOUT bounds waits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from kvcalib.calibration.engine import EngineInputs, Observation
from kvcalib.calibration.ranks import Ranks
from kvcalib.core.errors import CalibrationError, KvcalibError, UsageError
from kvcalib.hf.data import batched

__all__ = ["COLLECTIVE_TIMEOUT", "RanksFailed", "batch_shares", "observe_across_ranks"]

COLLECTIVE_TIMEOUT = timedelta(
    minutes=60
)  # ranks finish at about the same time: bounds a wait on a hung one


def batch_shares(
    sequences: tuple[tuple[int, ...], ...], batch_size: int, world_size: int
) -> list[tuple[tuple[int, ...], ...]]:
    """Each rank's sequences: whole batches of the single-process batching, about equal in padded tokens."""
    global_batches = batched(sequences, batch_size)
    if len(global_batches) < world_size:
        raise UsageError(
            f"{len(global_batches)} batch(es) of {batch_size} cannot be split across {world_size} processes",
            hint="launch fewer processes, pass a smaller --batch-size, or calibrate on more samples",
        )
    loads = [0] * world_size
    shares: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]
    for chunk in global_batches:  # longest first: greedy balancing of padded tokens
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].extend(chunk)
        loads[rank] += len(chunk) * max(len(s) for s in chunk)
    return [tuple(share) for share in shares]


def observe_across_ranks(
    engine: Callable[[EngineInputs], Observation],
    inputs: EngineInputs,
    ranks: Ranks,
    finish: Callable[[Observation, Callable[[list[Any]], list[Any]]], Any],
) -> tuple[Observation, Any]:
    """Run `engine` on this rank's share and combine every rank's observation; then `finish(observation, gather)`
    (the scale objective), where `gather(local_list)` returns every rank's lists concatenated in rank order."""
    share = batch_shares(inputs.data.sequences, inputs.options.batch_size, ranks.world_size)[
        ranks.rank
    ]
    local_inputs = dataclasses.replace(
        inputs, data=dataclasses.replace(inputs.data, sequences=share)
    )
    with _process_group(ranks, inputs.device) as collective_device:
        observation = failure = None
        try:
            observation = engine(local_inputs)
        except Exception as exc:  # joins the status exchange below, then is raised again
            failure = exc
        status = (  # what the other ranks report of this one's failure
            None
            if failure is None
            else failure.message
            if isinstance(failure, KvcalibError)
            else f"{type(failure).__name__}: {failure}"
            if str(failure)
            else type(failure).__name__
        )
        try:
            statuses = _all_gather(status)
        except RuntimeError as exc:  # a peer vanished (killed, crashed) mid-exchange
            raise CalibrationError(
                f"rank {ranks.rank}: lost the other processes ({exc})",
                hint="see the first failing rank's output; torchrun names it",
            ) from failure
        failed = {r: s for r, s in enumerate(statuses) if s is not None}
        if failure is not None:
            raise failure
        if failed or observation is None:
            raise RanksFailed(failed, ranks.world_size)
        reduced = _reduce(observation, collective_device)

        def gather(local: list[Any]) -> list[Any]:
            return [item for part in _all_gather(local) for item in part]

        return reduced, finish(reduced, gather)


class RanksFailed(CalibrationError):
    """Raised on the ranks that did not fail, from each failed rank's error ("rank R: ERROR")."""

    def __init__(self, failures: dict[int, str], world_size: int):
        detail = "; ".join(f"rank {r}: {message}" for r, message in sorted(failures.items()))
        super().__init__(
            f"{len(failures)} of {world_size} processes failed during calibration ({detail}); "
            "nothing was written",
            hint="fix what the failing rank reports and run again",
        )


@contextmanager
def _process_group(ranks: Ranks, device: torch.device) -> Iterator[torch.device]:
    """gloo on CPU, nccl on CUDA; torchrun's env:// rendezvous. Reuses a group the caller started."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if owned:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend,
            rank=ranks.rank,
            world_size=ranks.world_size,
            timeout=COLLECTIVE_TIMEOUT,
            **kwargs,
        )
    try:
        yield device if dist.get_backend() == "nccl" else torch.device("cpu")
    finally:
        if owned:
            dist.destroy_process_group()


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _reduce(local: Observation, device: torch.device) -> Observation:
    """absmax per head and observe time: MAX (exact in float64); forward counts: SUM."""
    import torch.distributed as dist

    groups = [*local.k_heads, *local.v_heads, *local.q_heads, torch.tensor([local.seconds])]
    packed = torch.cat([g.reshape(-1).double() for g in groups]).to(device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    counts = torch.tensor([*local.observed, *local.q_observed], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    parts, counts = torch.split(packed.cpu(), [g.numel() for g in groups]), counts.cpu().tolist()
    n = len(local.k_heads)
    return dataclasses.replace(
        local,
        k_heads=tuple(p.float() for p in parts[:n]),
        v_heads=tuple(p.float() for p in parts[n : 2 * n]),
        q_heads=tuple(p.float() for p in parts[2 * n : -1]),
        observed=tuple(counts[:n]),
        q_observed=tuple(counts[n:]),
        seconds=float(parts[-1]),
    )
