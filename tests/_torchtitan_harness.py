"""Runs TorchTitan 0.3.0's trainer on CPU as one rank under ``_dist_workers.launch``.

``python _torchtitan_harness.py run RANK WORLD PORT DIR``: TorchTitan's command-line arguments
come from ``TT_ARGS`` (a JSON list); ``TT_STOP_AFTER`` ends training after that step (an
interrupted run). The rank's report (``DIR/rank{RANK}.json``) holds the global loss of each step
(full precision) and a digest of this rank's model shards.

Every CPU adaptation lives here, not in the integration:
- ``triton`` must be installed (TorchTitan imports it unconditionally);
- the device is reported as CPU (TorchTitan falls back to "cuda" when no accelerator is found);
- dense SDPA instead of FlexAttention (no CPU backward for FlexAttention): ``attn_backend="sdpa"``;
- barriers without a device id (gloo has none);
- ``--parallelism.spmd-backend partial_dtensor`` for two ranks (passed by the tests);
- a plain SUM instead of PREMUL_SUM for gradient reductions (gloo has no PREMUL_SUM);
- no pinned memory (no CUDA);
- the test tokenizer and the ``c4_test`` dataset are not in the wheel: generated here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch._utils

TEXT_LINES = 400


def make_assets(root: Path) -> None:
    """``tests/assets/tokenizer`` (a byte-level BPE) and ``tests/assets/c4_test`` under root."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    data = root / "tests" / "assets" / "c4_test"
    tok_dir = root / "tests" / "assets" / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        return
    data.mkdir(parents=True, exist_ok=True)
    tok_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "model", "token", "state", "save", "load", "step"]
    lines = []
    for _ in range(TEXT_LINES):
        idx = torch.randint(
            0, len(words), (int(torch.randint(20, 60, (1,), generator=g)),), generator=g
        )
        lines.append(" ".join(words[i] for i in idx.tolist()))
    with open(data / "train.json", "w") as f:  # the file name gives the split
        for line in lines:
            f.write(json.dumps({"text": line}) + "\n")
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True})
    )


def _patch_torch_for_cpu() -> None:
    """Before TorchTitan is imported: CPU is the device, and gloo gets what it supports."""
    torch._utils._get_available_device_type = lambda: "cpu"  # TorchTitan would pick "cuda"
    # ...and its memory monitor asks the device module what torch.cpu does not answer.
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu_answers = {
        "get_device_name": lambda *a: "cpu",
        "get_device_properties": lambda *a: type("Props", (), {"total_memory": total})(),
        "memory_stats": lambda *a: {},
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda *a: None,
    }
    for name, fn in cpu_answers.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    import torch.distributed as dist

    real_barrier = dist.barrier

    def barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        return real_barrier(*args, **kwargs)  # gloo barriers take no device id

    dist.barrier = barrier
    if not hasattr(
        dist, "set_timeout"
    ):  # TorchTitan 0.3.0 calls it; torch 2.13 has the private one
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout


def _patch_torchtitan_for_cpu() -> None:
    from torch.distributed.fsdp import FSDPModule

    # TorchTitan sets a gradient divide factor of 1.0, which FSDP2 turns into PREMUL_SUM(1.0):
    # gloo has no PREMUL_SUM, so reduce with a plain SUM (the same thing for a factor of 1).
    real_divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: Any, factor: float) -> None:
        real_divide(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor
    # Dense SDPA instead of FlexAttention (no CPU backward): the block mask made dense.
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def dense_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, **_):
        assert score_mod is None and not return_aux.lse, "the CPU stand-in covers llama3 only"
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], "cpu")
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, None

    FlexAttention.compiled_flex_attn = staticmethod(dense_attention)


def _digest(trainer: Any) -> str:
    h = hashlib.sha256()
    for model in trainer.model_parts:
        for name, t in sorted(model.state_dict().items()):
            local = t.to_local() if hasattr(t, "to_local") else t
            h.update(
                name.encode() + local.detach().contiguous().view(torch.uint8).numpy().tobytes()
            )
    return h.hexdigest()[:16]


def main(scenario: str, rank: int, world: int, port: int, workdir: Path) -> None:
    assert scenario == "run", scenario
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(workdir.parent / "assets" / "hf_home"),  # no shared cache
    )
    assets = workdir.parent / "assets"
    os.chdir(assets)  # TorchTitan's test config finds tests/assets/... relative to the cwd
    _patch_torch_for_cpu()
    _patch_torchtitan_for_cpu()
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    report: dict[str, Any] = {"losses": {}, "ok": False}
    real_log = MetricsProcessor.log

    def log(self: Any, step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        report["losses"][step] = float(global_avg_loss)
        return real_log(self, step, global_avg_loss, *args, **kwargs)

    MetricsProcessor.log = log
    stop_after = int(os.environ.get("TT_STOP_AFTER", "0"))
    if stop_after:
        Trainer.should_continue_training = lambda self: self.step < stop_after

    config = ConfigManager().parse_args(json.loads(os.environ["TT_ARGS"]))
    trainer = config.build()
    try:
        trainer.train()
        report["manager"] = type(trainer.checkpointer).__name__
        report["stager"] = type(getattr(trainer.checkpointer, "stager", None)).__name__
        report["step"] = trainer.step
        report["digest"] = _digest(trainer)
        report["ok"] = True
    finally:
        trainer.close()
        (workdir / f"rank{rank}.json").write_text(json.dumps(report))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
