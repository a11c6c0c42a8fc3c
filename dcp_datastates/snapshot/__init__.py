"""The lazy snapshot: copying each item's bytes into the reused host pool while training goes on.

Owns: ``capture`` / ``replay`` (what the caller's thread records at the call, and replaying a
learnt layout), ``pieces`` / ``session`` / ``scheduler`` (the pieces and their layout, their
state machine, and the thread that admits and copies them), ``pool`` and ``hostmem`` (the
bounded host pool), ``device`` / ``device_fake`` / ``device_fake_ops`` (the copy device: CPU,
CUDA, and a simulated GPU that runs behind the host), ``guard`` (the optimizer step waits),
``cow`` (an operator's write copies its tensor first) and ``forward_gate`` (a forward copies the
buffers it may update; the index of tensors in flight that ``cow`` reads).
May import: ``providers``, ``_concurrency``, ``_platform`` and the leaves. Never ``storage``,
``save`` or ``load``: the flush that drains a session lives in ``save``.
"""
