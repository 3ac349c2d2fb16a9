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

from kvcalib.calibration.engine import Engine, EngineInputs, Observation
from kvcalib.calibration.ranks import Ranks
from kvcalib.core.errors import CalibrationError, UsageError
from kvcalib.hf.data import batched

__all__ = ["COLLECTIVE_TIMEOUT", "batch_shares", "observe_across_ranks"]

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
        rank = min(range(world_size), key=loads.__getitem__)  # the first of the least loaded
        shares[rank].extend(chunk)
        loads[rank] += len(chunk) * max(len(s) for s in chunk)
    return [tuple(share) for share in shares]


def observe_across_ranks(
    engine: Engine,
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
    with _process_group(ranks, inputs.device):
        observation = failure = None
        try:
            observation = engine(local_inputs)
        except Exception as exc:  # joins the status exchange below, then is raised again
            failure = exc
        try:  # what the other ranks report of this one's failure
            statuses = _all_gather(
                None
                if failure is None
                else getattr(failure, "message", None)
                or f"{type(failure).__name__}: {failure}".removesuffix(": ")
            )
        except RuntimeError as exc:  # a peer vanished (killed, crashed) mid-exchange
            raise CalibrationError(
                f"rank {ranks.rank}: lost the other processes ({exc})",
                hint="see the first failing rank's output; torchrun names it",
            ) from failure
        failed = {r: s for r, s in enumerate(statuses) if s is not None}
        if failure is not None:
            raise failure
        if failed:  # raised on the ranks that did not fail, from each failed rank's error
            raise CalibrationError(
                f"{len(failed)} of {ranks.world_size} processes failed during calibration ("
                + "; ".join(f"rank {r}: {message}" for r, message in failed.items())
                + "); nothing was written",
                hint="fix what the failing rank reports and run again",
            )
        reduced = _reduce(observation)

        def gather(local: list[Any]) -> list[Any]:
            return [item for part in _all_gather(local) for item in part]

        return reduced, finish(reduced, gather)


@contextmanager
def _process_group(ranks: Ranks, device: torch.device) -> Iterator[None]:
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
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _reduce(local: Observation) -> Observation:
    """Every rank's observation: absmax per head and observe time their MAX (exact), forward counts their SUM."""
    k, v, q, observed, q_observed, seconds = zip(
        *_all_gather(
            (
                local.k_heads,
                local.v_heads,
                local.q_heads,
                local.observed,
                local.q_observed,
                local.seconds,
            )
        )
    )

    def most(ranks: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.stack(layer).amax(dim=0) for layer in zip(*ranks))

    def total(ranks: tuple[Any, ...]) -> tuple[int, ...]:
        return tuple(map(sum, zip(*ranks)))

    return dataclasses.replace(
        local,
        k_heads=most(k),
        v_heads=most(v),
        q_heads=most(q),
        observed=total(observed),
        q_observed=total(q_observed),
        seconds=max(seconds),
    )
