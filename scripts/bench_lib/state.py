"""A transformer-shaped training state: parameters, Adam moments and a few Python objects.

The layout follows a decoder block stack (embedding, per layer qkv/proj/fc1/fc2 matrices and two
norm vectors, a final norm), with each parameter's ``exp_avg`` and ``exp_avg_sq`` beside it, so
the mix of big matrices and small vectors is the one real checkpoints have. The width is chosen
so the whole state comes to the requested size; the depth so the tensor count does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: Embedding rows per unit of width (a vocabulary of 8 x d).
_VOCAB_FACTOR = 8
_BYTES = 4  # float32


def _shapes(width: int, layers: int, extra_vectors: int) -> list[tuple[str, tuple[int, ...]]]:
    d = width
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (_VOCAB_FACTOR * d, d))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.proj.weight", (d, d)),
            (p + "mlp.fc1.weight", (4 * d, d)),
            (p + "mlp.fc2.weight", (d, 4 * d)),
            (p + "norm1.weight", (d,)),
            (p + "norm2.weight", (d,)),
        ]
    shapes += [(f"layers.{i}.attn.proj.bias", (d,)) for i in range(extra_vectors)]
    shapes.append(("norm.weight", (d,)))
    return shapes


def layout(total_bytes: float, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes so that parameters + 2 moments are about ``total_bytes`` in
    ``tensors`` tensors (rounded down to a multiple of 3)."""
    params = max(3, tensors // 3)
    layers = max(0, (params - 2) // 6)
    extra = max(0, params - 2 - 6 * layers)
    # bytes ~= 3 moments x 4 bytes x (8 d^2 + 12 d^2 per layer), vectors neglected
    width = int(math.sqrt(total_bytes / (3 * _BYTES * (_VOCAB_FACTOR + 12 * layers))))
    return _shapes(max(width, 1), layers, min(extra, layers) if layers else 0)


def build(total_bytes: float, tensors: int, *, seed: int = 0) -> dict[str, Any]:
    """The state to save; every tensor holds a distinct constant so loads can be checked."""
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(layout(total_bytes, tensors)):
        base = seed * 1000.0 + 3 * i
        model[name] = torch.empty(shape).fill_(base + 0.5)
        moments[name] = {
            "exp_avg": torch.empty(shape).fill_(base + 1.5),
            "exp_avg_sq": torch.empty(shape).fill_(base + 2.5),
        }
    return {
        "model": model,
        "optim": {
            "state": moments,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(model)}],
        },
        "step": 1000,
        "rng": {"seed": 1234 + seed, "epoch": 3},
        "config": {"width": next(iter(model.values())).shape[1], "tensors": 3 * len(model)},
    }


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def empty_like(state: Any) -> Any:
    """A load target with the same structure; tensors uninitialised, objects placeholders."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like(v) for v in state]
    return state


def poison(target: Any) -> None:
    """Overwrite a few values of a load target, so a load that reads nothing is caught."""
    for t in _samples(target):
        t.view(-1)[0] = -1.0
        t.view(-1)[-1] = -1.0


def check_loaded(source: Any, target: Any) -> None:
    """Raise if the sampled tensors of ``target`` differ from ``source`` (a wrong load)."""
    for s, t in zip(_samples(source), _samples(target), strict=True):
        if not (
            torch.equal(s.view(-1)[:1], t.view(-1)[:1])
            and torch.equal(s.view(-1)[-1:], t.view(-1)[-1:])
        ):
            raise AssertionError("the load benchmark read back wrong values")


def _samples(state: Any) -> list[torch.Tensor]:
    ts = tensors_of(state)
    return [ts[0], ts[len(ts) // 2], ts[-1]] if ts else []


def layout_bytes(total_bytes: float, tensors: int) -> int:
    """Bytes of the tensors ``build(total_bytes, tensors)`` makes, without making them."""
    return sum(3 * _BYTES * math.prod(shape) for _, shape in layout(total_bytes, tensors))


def objects(count: int, *, seed: int = 0) -> dict[str, Any]:
    """A state of ``count`` small Python objects (what training keeps beside the model: per-step
    metrics, dataloader positions, RNG states, config strings) and a few small tensors.

    Each object is one DCP item; a dict value counts as one object per key (DCP flattens dicts).
    """
    per_kind = max(1, count // 5)
    metrics = {f"step_{i}": {"loss": 1.0 / (i + 1), "step": i} for i in range(per_kind // 2)}
    loader = {f"worker_{i}": [i, 7 * i, 3, 14, seed] for i in range(per_kind)}
    rng = {f"stream_{i}": (3, tuple(range(i % 7, i % 7 + 5)), None) for i in range(per_kind)}
    config = {f"key_{i}": f"value {i} of the run config" for i in range(per_kind)}
    counters = {f"counter_{i}": i * 1000 + seed for i in range(count - 4 * per_kind)}
    return {
        "metrics": metrics,
        "loader": loader,
        "rng": rng,
        "config": config,
        "counters": counters,
        "weights": {f"w{i}": torch.full((64, 64), float(i + seed)) for i in range(4)},
    }


def blank(state: Any) -> Any:
    """A load target with the structure of ``state``: tensors uninitialised, other values None
    (so a load that reads nothing is caught by :func:`check_same`)."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank(v) for v in state]
    return None


def check_same(source: Any, target: Any) -> None:
    """Raise unless every value of ``target`` equals ``source``'s (tensors bit for bit)."""
    if isinstance(source, torch.Tensor):
        if not torch.equal(source, target):
            raise AssertionError("the load benchmark read back a wrong tensor")
    elif isinstance(source, dict):
        for k, v in source.items():
            check_same(v, target[k])
    elif isinstance(source, list):
        for s, t in zip(source, target, strict=True):
            check_same(s, t)
    elif source != target:
        raise AssertionError(f"the load benchmark read back {target!r}, not {source!r}")
