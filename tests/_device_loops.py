"""Training loops the CUDA path is checked with, on the simulated GPU (``test_device_fake.py``)
and on a real one (``test_gpu.py``): several steps and optimizers, gradient accumulation, steps
a ``GradScaler`` skips, the host guard. ``train`` runs one and calls ``on_save(state, i)`` where
the loop saves; ``reference`` runs it on the host without saves (what each checkpoint holds)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

_g = torch.Generator().manual_seed(1)
#: (input, target) of each pass, on the host
DATA = [(torch.randn(32, 64, generator=_g), torch.randn(32, 64, generator=_g)) for _ in range(9)]


@dataclass(frozen=True, kw_only=True)
class Loop:
    """A training loop and where it saves.

    Attributes:
        optimizers: "one" (AdamW), or "two" (SGD with momentum on the first layers, AdamW on the
            rest, as GAN or Muon + AdamW setups step two optimizers).
        iterations: forward/backward passes.
        accumulate: passes per optimizer step (gradient accumulation).
        save_at: passes after which the state is saved (async; the next save waits for it).
        scaler: a GradScaler steps the optimizers; ``inf_at`` passes put an inf in a gradient
            (the scaler skips that step).
        guard_on_device: fence the step on the device (else the host waits).
    """

    optimizers: str = "one"
    iterations: int = 6
    accumulate: int = 1
    save_at: tuple[int, ...] = (1, 3)
    scaler: bool = False
    inf_at: tuple[int, ...] = ()
    guard_on_device: bool = True

    def __post_init__(self) -> None:
        if self.optimizers not in ("one", "two"):
            raise ValueError(f"optimizers must be 'one' or 'two', not {self.optimizers!r}")
        if self.iterations > len(DATA):
            raise ValueError(f"at most {len(DATA)} iterations, not {self.iterations}")


LOOPS = {
    "two optimizers": Loop(optimizers="two"),
    "steps while copies run": Loop(iterations=7, save_at=(0,)),
    "gradient accumulation": Loop(iterations=9, accumulate=3, save_at=(1, 5)),
    "skipped steps": Loop(optimizers="two", scaler=True, inf_at=(2, 3), save_at=(1, 2)),
    "host guard": Loop(optimizers="two", guard_on_device=False),
}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96),  # 24 KiB of weights: copied live; biases copied in stage()
        torch.nn.BatchNorm1d(96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 64),
    )


def optimizers_for(net: torch.nn.Module, which: str) -> list[torch.optim.Optimizer]:
    params = list(net.parameters())
    if which == "one":
        return [torch.optim.AdamW(params, lr=1e-2)]
    return [
        torch.optim.SGD(params[:4], lr=0.05, momentum=0.9),
        torch.optim.AdamW(params[4:], lr=1e-2),
    ]


def state_of(net: torch.nn.Module, optimizers: list[torch.optim.Optimizer], i: int) -> dict:
    """The state a loop saves: the module's, every optimizer's tensors, the pass (live
    references, not copies)."""
    state: dict = {"model": dict(net.state_dict()), "iteration": i}
    for k, opt in enumerate(optimizers):
        for j, param in enumerate(p for g in opt.param_groups for p in g["params"]):
            for name, value in opt.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"opt{k}.{j}.{name}"] = value
    return state


def flat(state: dict) -> dict:
    """``state`` with the module's entries at the top level (for comparisons)."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    out.update((k, v) for k, v in state.items() if k != "model")
    return out


def train(
    net: torch.nn.Module,
    loop: Loop,
    to_device: Callable[[torch.Tensor], torch.Tensor],
    on_save: Callable[[dict, int], None],
    *,
    scaler_device: str = "cpu",
) -> list[torch.optim.Optimizer]:
    """Run ``loop`` on ``net`` (already on its device); returns its optimizers."""
    optimizers = optimizers_for(net, loop.optimizers)
    scaler = torch.amp.GradScaler(scaler_device, init_scale=2.0**4) if loop.scaler else None
    for i in range(loop.iterations):
        x, y = (to_device(t) for t in DATA[i])
        loss = torch.nn.functional.mse_loss(net(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if i in loop.inf_at:
            with torch.no_grad():
                net[0].weight.grad[0, 0] = float("inf")
        if (i + 1) % loop.accumulate == 0:
            step(optimizers, scaler)
            for opt in optimizers:
                opt.zero_grad()
        if i in loop.save_at:
            on_save(state_of(net, optimizers, i), i)
    return optimizers


def step(optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler | None) -> None:
    if scaler is None:
        for opt in optimizers:
            opt.step()
        return
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()


def reference(loop: Loop) -> tuple[dict[int, dict], dict]:
    """What each checkpoint must hold, and the final state: the loop on the host, no saves."""
    saved: dict[int, dict] = {}

    def on_save(state: dict, i: int) -> None:
        saved[i] = copy.deepcopy(state)

    net = model()
    optimizers = train(net, loop, lambda t: t, on_save)
    return saved, copy.deepcopy(state_of(net, optimizers, loop.iterations))
