"""Where this process stands in a torchrun launch (read by the CLI from torchrun's variables)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvcalib.core.errors import UsageError

__all__ = ["Ranks"]


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Ranks | None:
        """The ranks torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); None outside torchrun."""
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local_rank, local_world = (
                int(env.get("LOCAL_RANK", rank)),
                int(env.get("LOCAL_WORLD_SIZE", world)),
            )
        except ValueError:
            raise UsageError(
                f"RANK={env.get('RANK')!r} WORLD_SIZE={env.get('WORLD_SIZE')!r} LOCAL_RANK={env.get('LOCAL_RANK')!r} "
                "are not integers",
                hint="launch with torchrun, which sets them",
            ) from None
        if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
            raise UsageError(
                f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world} "
                "do not describe a valid launch",
                hint="launch with torchrun, which sets them",
            )
        return cls(rank, world, local_rank, local_world)
