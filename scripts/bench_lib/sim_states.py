"""Simulated states for the simulate scenario: transformer layouts described by shapes, and the
local ``SavePlan`` each rank of a sharded job would send to DCP's coordinator, built from them
without a tensor, a process group or a device.

A rank's plan is made of DCP's own dataclasses (``WriteItem``, ``MetadataIndex``,
``TensorWriteData``, ``ChunkStorageMetadata``, ``TensorProperties``), one new object each per
rank, as the coordinator holds them after unpickling the gathered plans. Sharding follows FSDP2
(``Shard(0)`` over the data-parallel ranks, chunks of ``ceil(n / ranks)`` rows, trailing ranks
empty), HSDP (the shard group repeated ``replicas`` times: every item on ``replicas`` ranks, which
DCP's dedup keeps once) and 2-D FSDP + tensor parallel (``Shard(1)`` over ``tp`` ranks for 2-D
weights, 1-D ones replicated over them).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)


@dataclass(frozen=True, kw_only=True)
class Model:
    """A Llama-like decoder: its parameters' names and global shapes.

    Attributes:
        name: What tables call it ("7B", "70B").
        layers, hidden, ffn, vocab, kv: Depth, width, MLP width, vocabulary, and the width of
            the key/value projections (smaller than ``hidden`` with grouped-query attention).
        optimizer: Whether the state holds Adam's ``exp_avg`` and ``exp_avg_sq`` (sharded like
            their parameter) and ``step`` (a replicated scalar) per parameter.
    """

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int
    kv: int
    optimizer: bool = False

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        h, f, kv = self.hidden, self.ffn, self.kv
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]

    def tensors(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """``(fqn, global shape, sharded)`` of every tensor of the state."""
        out = [(fqn, shape, True) for fqn, shape in self.params()]
        if self.optimizer:
            for fqn, shape in self.params():
                out += [
                    (f"optim.state.{fqn}.exp_avg", shape, True),
                    (f"optim.state.{fqn}.exp_avg_sq", shape, True),
                    (f"optim.state.{fqn}.step", (), False),
                ]
        return out

    def nbytes(self) -> int:
        """Bytes of the whole state (fp32 parameters and moments)."""
        return sum(4 * math.prod(shape) for _, shape, _ in self.tensors())


MODELS = {
    "7B": Model(name="7B", layers=32, hidden=4096, ffn=11008, vocab=32000, kv=4096),
    "70B": Model(name="70B", layers=80, hidden=8192, ffn=28672, vocab=32000, kv=1024),
}
#: Objects of the optimizer's param_groups (lr, betas, ...) as DCP flattens them: on every rank.
OPTIMIZER_OBJECTS = [f"optim.param_groups.0.{k}" for k in ("lr", "betas", "eps", "params")]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a job places a model on ``world`` ranks.

    Attributes:
        kind: "fsdp" (FSDP2 over all ranks), "hsdp" (FSDP2 within groups of ``world /
            replicas`` ranks, replicated across groups) or "fsdp+tp" (FSDP2 over ``world / tp``
            ranks, tensor parallel over ``tp``).
        world: Ranks.
        replicas: HSDP's replica groups.
        tp: Tensor-parallel degree.
    """

    kind: str
    world: int
    replicas: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("fsdp", "hsdp", "fsdp+tp"):
            raise ValueError(f"layout kind {self.kind!r} is not fsdp, hsdp or fsdp+tp")
        if self.world % (self.replicas * self.tp):
            raise ValueError(
                f"world {self.world} is not a multiple of replicas {self.replicas} x tp {self.tp}"
            )

    @property
    def shard_ranks(self) -> int:
        return self.world // (self.replicas * self.tp)

    def place(self, rank: int) -> tuple[int, int]:
        """``(fsdp shard index, tp index)`` of ``rank`` (tp innermost, replicas outermost)."""
        within = rank % (self.shard_ranks * self.tp)
        return within // self.tp, within % self.tp


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of part ``index`` of ``n`` rows split as FSDP2 does (torch.chunk)."""
    step = -(-n // parts) if n else 0
    start = min(n, index * step)
    return start, min(n, start + step) - start


def local_chunk(
    shape: tuple[int, ...], sharded: bool, layout: Layout, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of ``rank``'s piece of a tensor of ``shape``."""
    if not sharded or not shape:
        return (0,) * len(shape), shape
    shard, tp = layout.place(rank)
    offsets, sizes = [0] * len(shape), list(shape)
    if layout.tp > 1 and len(shape) == 2:
        offsets[1], sizes[1] = _split(shape[1], layout.tp, tp)
    offsets[0], sizes[0] = _split(shape[0], layout.shard_ranks, shard)
    return tuple(offsets), tuple(sizes)


def local_plan(
    model: Model, layout: Layout, rank: int, tensors: list[tuple[str, tuple[int, ...], bool]]
) -> SavePlan:
    """The local plan DCP's ``create_default_local_save_plan`` makes on ``rank``: a ``SHARD``
    item per sharded tensor (a DTensor), a ``TENSOR`` item per replicated one, a ``BYTE_IO``
    item per object; ``planner_data`` the flattening's mapping (``fqn -> path``)."""
    items = []
    dtype = torch.float32
    for fqn, shape, sharded in tensors:
        offsets, sizes = local_chunk(shape, sharded, layout, rank)
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD if sharded else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(offsets), sizes=torch.Size(sizes)
                    ),
                    properties=TensorProperties(dtype=dtype),
                    size=torch.Size(shape),
                ),
            )
        )
    if model.optimizer:
        items += [
            WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
            for fqn in OPTIMIZER_OBJECTS
        ]
    mappings = {item.index.fqn: tuple(item.index.fqn.split(".")) for item in items}
    return SavePlan(items, planner_data=mappings)


def local_plans(model: Model, layout: Layout) -> list[SavePlan]:
    """Every rank's local plan, as the coordinator receives them (the cyclic GC paused while
    millions of objects are made: it would scan them again and again)."""
    tensors = model.tensors()
    paused = gc.isenabled()
    gc.disable()
    try:
        return [local_plan(model, layout, rank, tensors) for rank in range(layout.world)]
    finally:
        if paused:
            gc.enable()


def load_chunks(
    model: Model, layout: Layout, rank: int
) -> Iterator[tuple[str, tuple[int, ...], ChunkStorageMetadata | None]]:
    """``(fqn, global shape, chunk)`` of each tensor ``rank`` loads under ``layout`` (chunk
    None for an object)."""
    for fqn, shape, sharded in model.tensors():
        offsets, sizes = local_chunk(shape, sharded, layout, rank)
        yield fqn, shape, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    if model.optimizer:
        for fqn in OPTIMIZER_OBJECTS:
            yield fqn, (), None
