"""Many devices in one DiLoCo peer: torch.distributed inside a node, hivemind between nodes.

A multi-GPU peer is launched with ``torchrun --nproc_per_node K``. Its ranks run the inner loop data-parallel
(DDP: each rank takes 1/K of every batch, gradients are averaged, so all ranks stay identical). Rank 0 alone talks
to hivemind: it computes the pseudo-gradient, joins the all-reduce and applies the outer step, then broadcasts
θ_{r+1} to the other ranks. The same code runs on CPU with the gloo backend, and with one process (``world == 1``)
every operation here is a no-op.

On failure: a rank that dies makes the others fail in their next collective (torch.distributed's timeout,
``NodeGroup.timeout_s``); the node then exits and restarts from its checkpoint, as a single-process peer would.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class NodeGroup:
    """This process's place in its node: rank 0 is the leader that talks to the network."""

    rank: int = 0
    world: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def split(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of a batch (rows ``rank::world``); the whole batch when alone."""
        return batch[self.rank :: self.world] if self.distributed else batch

    def broadcast_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every rank with rank 0's values (in place)."""
        if not self.distributed:
            return
        for tensor in tensors:
            staged = tensor.detach().to("cpu", copy=True) if _needs_staging(tensor) else tensor.data
            dist.broadcast(staged, src=0)
            if staged is not tensor.data:
                tensor.data.copy_(staged)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (round numbers, go/stop flags)."""
        return self.broadcast_ints([value])[0]

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (the others pass placeholders of the same length)."""
        if not self.distributed:
            return values
        box = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(box, src=0)
        return [int(v) for v in box.tolist()]

    def hashes_agree(self, tensors: list[torch.Tensor]) -> bool:
        """True when every rank holds bit-identical ``tensors`` (compares a 63-bit digest, no pickle)."""
        if not self.distributed:
            return True
        digest = hashlib.sha256()
        for tensor in tensors:
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy())
        mine = torch.tensor([int.from_bytes(digest.digest()[:8], "little") >> 1], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        return all(int(other.item()) == int(mine.item()) for other in everyone)


def _needs_staging(tensor: torch.Tensor) -> bool:
    """gloo broadcasts CPU tensors only; NCCL needs CUDA ones: stage CUDA tensors through the CPU under gloo."""
    return tensor.device.type != "cpu" and dist.get_backend() == "gloo"


def init_node_group(timeout_s: float = 300.0) -> NodeGroup:
    """Join the torchrun process group when launched by torchrun (``WORLD_SIZE`` > 1), else a group of one.

    gloo on CPU, NCCL when CUDA is available; each rank binds its own GPU (``LOCAL_RANK``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return NodeGroup()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return NodeGroup(rank=dist.get_rank(), world=dist.get_world_size())


def close_node_group(group: NodeGroup) -> None:
    """Leave the process group; call it after the peer's ``shutdown`` (which drops its DDP wrapper).

    A ``DistributedDataParallel`` still alive when the group is destroyed keeps gloo's threads alive until the
    interpreter exits, where their destruction aborts the process ("terminate called without an active exception",
    SIGABRT). The wrapper sits in reference cycles, hence the collection. Measured on two-rank torchrun runs (gloo):
    6 of 20 aborted with the wrapper alive, 2 of 30 with it dropped but not collected, 0 of 60 dropped and collected.
    """
    if group.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
