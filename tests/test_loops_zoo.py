"""The loops zoo: training loops as users write them, each saving six times with one reused
writer and a host pool of a quarter of its state, must commit every save with the state at its
call, as stock DCP does.

Each loop does something right after the save call returns, while the snapshot is still being
copied: the next forward and step, an evaluation with the EMA weights swapped in, a rollback, an
SWA update, a resize. Stock's ``dcp.async_save`` copies the whole state during the call, so
every one of its saves commits that state; ours copies lazily, and keeps the guarantee only if no
write reaches a tensor before its copy (README, "Safety: what is guaranteed"). Every loop
runs through ``dcp.async_save`` and ``dcp_datastates.async_save`` (a few also with a writer per
save) and with stock; each committed checkpoint is read back with stock's reader and ours and
compared bit for bit with a copy of the state taken at the call (``_loops.py``).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from _loops import ENTRIES, STOCK, Loop, Run, run_loop
from torch import nn
from torch.optim.swa_utils import AveragedModel

# -- the loops -------------------------------------------------------------------------------------


class EmbeddingMaxNorm(Loop):
    """``nn.Embedding(max_norm=)``: forward renormalizes the looked-up rows of the weight in
    place (``embedding_renorm_``), a parameter written outside ``step()``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Embedding(2048, 256, max_norm=1.0), nn.Linear(256, 16))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def train(self) -> None:
        self.opt.zero_grad()
        self.model(self.randint(2048, 512)).square().mean().backward()
        self.opt.step()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def _mlp(features: int, hidden: int, norm: bool) -> nn.Sequential:
    """Two linears of ``2 * features * hidden`` weights, with a BatchNorm between if ``norm``."""
    norms = [nn.BatchNorm1d(hidden)] if norm else []
    return nn.Sequential(
        nn.Linear(features, hidden), *norms, nn.ReLU(), nn.Linear(hidden, features)
    )


class _Mlp(Loop):
    """An MLP of 2 MiB of weights with Adam (6 MiB of state), the base of several loops. With
    ``norm``, its BatchNorm's statistics are 8 KiB each: more than ``eager_copy_bytes`` (4 KiB),
    so the call does not copy them, the first forward after it must."""

    features: int = 256

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        if norm:
            self.features = 128
        self.model = _mlp(self.features, 512 * 1024 // self.features, norm)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def loss(self) -> torch.Tensor:
        return self.model(self.randn(64, self.features)).square().mean()

    def train(self) -> None:
        self.opt.zero_grad()
        self.loss().backward()
        self.opt.step()

    def evaluate(self) -> None:
        self.model.eval()
        with torch.no_grad():
            for _ in range(8):  # longer than a snapshot here, as validation is anywhere
                self.model(self.randn(128, self.features))
        self.model.train()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


class _Ema(_Mlp):
    """An EMA of the weights, updated after every step (when the step guard has let the
    snapshot finish), and saved with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.shadow = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def train(self) -> None:
        super().train()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                self.shadow[name].lerp_(p, 0.1)


class EmaEvalSwappingData(_Ema):
    """Evaluation with the EMA weights right after a save, swapped in by ``p.data = shadow`` and
    back; the state holds the Parameters themselves (``state_dict(keep_vars=True)``)."""

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(keep_vars=True),
            "ema": self.shadow,
            "optim": self.opt.state_dict(),
        }

    def after_save(self) -> None:
        params = dict(self.model.named_parameters())
        backup = {name: p.data for name, p in params.items()}
        for name, p in params.items():
            p.data = self.shadow[name]
        self.evaluate()
        for name, p in params.items():
            p.data = backup[name]


class EmaEvalCopying(_Ema):
    """torch_ema's ``store`` / ``copy_to`` / ``restore`` around an evaluation right after a save:
    the EMA weights are copied into the parameters through ``p.data.copy_`` and copied back."""

    def after_save(self) -> None:
        params = list(self.model.named_parameters())
        stored = [p.detach().clone() for _, p in params]
        for name, p in params:
            p.data.copy_(self.shadow[name])
        self.evaluate()
        for (_, p), saved in zip(params, stored, strict=True):
            p.data.copy_(saved)

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "ema": self.shadow,
            "optim": self.opt.state_dict(),
        }


class GrowingEmbedding(Loop):
    """A vocabulary grown right after each save, its table kept in a buffer with room to grow
    (as a vector reserves capacity): growing is swapping a longer view of it into the
    Parameter (``weight.data = table[:rows]``). 3.5 MiB at the first save, past 4 MiB from the
    third, in a state of the same keys each time (the writer replays the layout it learnt);
    the state holds the Parameters (``keep_vars=True``)."""

    ROWS, GROWTH, WIDTH = 3584, 256, 256

    def __init__(self) -> None:
        super().__init__()
        self.rows = self.ROWS
        self.table = torch.randn(self.ROWS + self.GROWTH * self.saves, self.WIDTH)
        self.embedding = nn.Embedding(self.ROWS, self.WIDTH, _weight=self.table[: self.ROWS])
        self.model = nn.Sequential(self.embedding, nn.Linear(self.WIDTH, 16))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train(self) -> None:
        self.opt.zero_grad()
        self.model(self.randint(self.rows, 512)).square().mean().backward()
        self.opt.step()

    def state(self) -> dict:
        return {"model": self.model.state_dict(keep_vars=True), "optim": self.opt.state_dict()}

    def after_save(self) -> None:
        self.rows += self.GROWTH
        self.embedding.weight.data = self.table[: self.rows]
        self.embedding.num_embeddings = self.rows
        self.train()


class DecoupledWeightDecay(_Mlp):
    """Hand-written decoupled weight decay: ``p.mul_(1 - lr * wd)`` under ``no_grad`` at the top
    of each iteration, before forward (and so right after a save)."""

    def train(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1 - 1e-3 * 0.1)
        super().train()


class RollbackToBest(_Mlp):
    """Rolling back to the best weights seen so far right after a save, as validation got worse:
    ``model.load_state_dict(best)``."""

    def __init__(self) -> None:
        super().__init__()
        self.best = copy.deepcopy(self.model.state_dict())

    def after_save(self) -> None:
        self.model.load_state_dict(self.best)
        self.train()
        self.best = copy.deepcopy(self.model.state_dict())


class StochasticWeightAveraging(_Mlp):
    """SWA: ``AveragedModel(model)``, whose ``update_parameters(model)`` runs right after the
    save; both models are saved."""

    def __init__(self) -> None:
        super().__init__()
        self.swa = AveragedModel(self.model)

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "swa": self.swa.state_dict(),
            "optim": self.opt.state_dict(),
        }

    def after_save(self) -> None:
        self.swa.update_parameters(self.model)
        self.train()


class BatchNorm(_Mlp):
    """BatchNorm between the linears: forward updates its running statistics in place."""

    def __init__(self) -> None:
        super().__init__(norm=True)


class TiedWeights(Loop):
    """Weight tying: the output projection's weight is the embedding's (one tensor under two
    keys of the state)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(2048, 256)
        self.mix = nn.Linear(256, 256)
        self.decoder = nn.Linear(256, 2048, bias=False)
        self.decoder.weight = self.encoder.weight
        self.model = nn.ModuleDict(
            {"encoder": self.encoder, "mix": self.mix, "decoder": self.decoder}
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def train(self) -> None:
        self.opt.zero_grad()
        tokens = self.randint(2048, 64)
        logits = self.decoder(torch.relu(self.mix(self.encoder(tokens))))
        nn.functional.cross_entropy(logits, self.randint(2048, 64)).backward()
        self.opt.step()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


class SpectralNorm(_Mlp):
    """``parametrizations.spectral_norm``: every forward in training mode updates the power
    iteration's ``_u`` / ``_v`` buffers in place (``_v`` is 8 KiB: not copied by the call)."""

    features = 2048

    def __init__(self) -> None:
        super().__init__()
        spectral_norm = nn.utils.parametrizations.spectral_norm
        self.model = nn.Sequential(
            spectral_norm(nn.Linear(self.features, 256)), nn.ReLU(), nn.Linear(256, 1)
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)


class TwoOptimizers(Loop):
    """A GAN: a generator and a discriminator, each with its own Adam, stepped in turn."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1024))
        self.disc = nn.Sequential(nn.Linear(1024, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))
        self.opt_gen = torch.optim.Adam(self.gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.opt_disc = torch.optim.Adam(self.disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.bce = nn.BCEWithLogitsLoss()

    def train(self) -> None:
        real, noise = self.randn(32, 1024), self.randn(32, 64)
        fake = self.gen(noise)
        self.opt_disc.zero_grad()
        real_score, fake_score = self.disc(real), self.disc(fake.detach())
        loss = self.bce(real_score, torch.ones_like(real_score))
        (loss + self.bce(fake_score, torch.zeros_like(fake_score))).backward()
        self.opt_disc.step()
        self.opt_gen.zero_grad()
        score = self.disc(fake)
        self.bce(score, torch.ones_like(score)).backward()
        self.opt_gen.step()

    def state(self) -> dict:
        return {
            "gen": self.gen.state_dict(),
            "disc": self.disc.state_dict(),
            "opt_gen": self.opt_gen.state_dict(),
            "opt_disc": self.opt_disc.state_dict(),
        }


class LrSchedule(_Mlp):
    """AdamW with a warm-up then cosine schedule (``SequentialLR``), stepped every iteration;
    the scheduler's state is saved too."""

    def __init__(self) -> None:
        super().__init__()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler
        warmup = sched.LinearLR(self.opt, start_factor=0.1, total_iters=4)
        cosine = sched.CosineAnnealingLR(self.opt, T_max=20)
        self.schedule = sched.SequentialLR(self.opt, [warmup, cosine], milestones=[4])

    def train(self) -> None:
        super().train()
        self.schedule.step()

    def state(self) -> dict:
        return {**super().state(), "schedule": self.schedule.state_dict()}


class GradientAccumulation(_Mlp):
    """Gradient accumulation: a step every fourth micro-batch, saves after a step, so four
    forwards and backwards (BatchNorm's statistics among them) run before the next step."""

    MICRO_BATCHES = 4

    def __init__(self) -> None:
        super().__init__(norm=True)

    def train(self) -> None:
        self.opt.zero_grad()
        for _ in range(self.MICRO_BATCHES):
            (self.loss() / self.MICRO_BATCHES).backward()
        self.opt.step()


@functools.cache
def _compiled_model() -> tuple[nn.Module, nn.Module, dict]:
    """One compiled model for every run (compiling takes seconds), with its initial state."""
    torch.manual_seed(0)
    model = _mlp(Compiled.features, 512 * 1024 // Compiled.features, norm=True)
    return model, torch.compile(model), copy.deepcopy(model.state_dict())


class Compiled(_Mlp):
    """A ``torch.compile``d model (inductor) with BatchNorm; the original module's state is
    saved. Every run starts from the same initial state, loaded into the one compiled model."""

    features = 128

    def __init__(self) -> None:
        super().__init__()
        self.model, self.compiled, initial = _compiled_model()
        self.model.load_state_dict(initial)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def loss(self) -> torch.Tensor:
        return self.compiled(self.randn(64, self.features)).square().mean()


LOOPS = {
    "embedding max_norm": EmbeddingMaxNorm,
    "EMA eval, p.data = shadow": EmaEvalSwappingData,
    "EMA eval, p.data.copy_": EmaEvalCopying,
    "embedding grown past 4 MiB by a .data swap": GrowingEmbedding,
    "decoupled weight decay": DecoupledWeightDecay,
    "rollback to best": RollbackToBest,
    "SWA": StochasticWeightAveraging,
    "BatchNorm": BatchNorm,
    "tied weights": TiedWeights,
    "spectral norm": SpectralNorm,
    "two optimizers": TwoOptimizers,
    "LR schedule": LrSchedule,
    "gradient accumulation": GradientAccumulation,
    "torch.compile": Compiled,
}

#: Loops also run with a new writer for each save (``dcp.async_save`` with a writer made there).
PER_SAVE_WRITER_LOOPS = ("embedding max_norm", "EMA eval, p.data.copy_", "BatchNorm")

#: Compiling takes seconds (2.5 s with inductor's cache warm on 2 cores, 4-8 s cold), paid once.
_SLOW = {"torch.compile": [pytest.mark.slow]}

_REUSED_WRITER, _WRITER_PER_SAVE = ENTRIES[1:3], ENTRIES[3]

CASES = [
    pytest.param(loop, entry, id=f"{loop}-{entry}", marks=_SLOW.get(loop, []))
    for loop in LOOPS
    for entry in _REUSED_WRITER
] + [
    pytest.param(loop, _WRITER_PER_SAVE, id=f"{loop}-a writer per save")
    for loop in PER_SAVE_WRITER_LOOPS
]


@pytest.fixture(scope="module", autouse=True)
def one_compute_thread():
    """Training computes on one thread here, as the writer's copies and flush run beside it.

    With torch's two OpenMP threads on 2 shared cores, each op's barrier spun while a core ran
    a copy, a flush or another process: the module took 70-80 s of CPU against 18 s with
    OMP_WAIT_POLICY=PASSIVE (2 cores, load 3-5). The loops and what they write are the same.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory: pytest.TempPathFactory):
    """``stock_run(loop)``: the loop saved by stock DCP, run once per module."""
    runs: dict[str, Run] = {}

    def run(loop: str) -> Run:
        if loop not in runs:
            root = tmp_path_factory.mktemp("stock")
            runs[loop] = run_loop(LOOPS[loop], STOCK, root)
        return runs[loop]

    return run


@pytest.mark.parametrize(("loop", "entry"), CASES)
def test_every_save_of_the_loop_commits_the_state_at_its_call(
    tmp_path: Path, stock_run, loop: str, entry: str
) -> None:
    stock = stock_run(loop)
    # The harness's own check: stock copies the state during the call, so a difference in its
    # checkpoints means the copy of "the state at the call" was taken wrongly here.
    assert not stock.wrong, stock.summary()

    ours = run_loop(LOOPS[loop], entry, tmp_path)

    report = f"{ours.summary()}\n{stock.summary().splitlines()[0]}"
    wrong, committed = len(ours.wrong), ours.committed
    assert wrong == 0, f"committed a state other than the call's: {report}"
    # Stock commits every save of every loop here, so this asks for every save to commit.
    assert committed >= stock.committed, f"fewer saves committed than stock: {report}"
