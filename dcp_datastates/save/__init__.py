"""The save path: DCP's ``StorageWriter`` contract, planning, the session runtime, flush and commit.

One save, top-down: ``writer`` (the DCP calls) -> ``planner`` (items to providers) ->
``runtime`` (one snapshot session on the pool; the snapshot itself is ``snapshot/``) ->
``flush`` (each piece to storage as it lands) -> ``commit`` (manifest, then ``.metadata``).
``api.async_save`` returns both futures; ``process_staging`` serves DCP's PROCESS executor.
May import: ``snapshot``, ``providers``, ``storage`` and the leaves. Never ``load`` or
``checkpointers``.
"""
