"""The save path: DCP's ``StorageWriter`` contract, planning, the session runtime, flush and commit.

One save, top-down:

- ``writer``: ``DataStatesWriter``, the DCP calls (``stage`` dispatches; ``reset`` .. ``finish``);
  ``calls`` (which call a ``stage()`` belongs to, cross-rank guards), ``records`` (one save's
  state and stats);
- ``staging``: the caller's part of ``stage()`` and the planning thread's part; ``planner`` maps
  items to providers; ``incremental`` swaps in links for records an older checkpoint holds
  (``incremental=True``); ``process_staging`` serves DCP's PROCESS executor;
- ``runtime``: a writer's sessions from ``stage()`` to release, with ``resources`` (pool and
  threads), ``deferred`` (the planning thread), ``handoff`` (stage -> save thread) and
  ``sessions`` (those not yet retired); the copies themselves are ``snapshot/``;
- ``flush`` (each piece to storage as it lands) -> ``commit`` (manifest, then ``.metadata``);
- ``api.async_save`` returns both futures; ``compat`` maps stock arguments; ``path_turns``
  orders saves to one directory.

May import: ``snapshot``, ``providers``, ``storage`` and the leaves. Never ``load`` or
``checkpointers``.
"""
