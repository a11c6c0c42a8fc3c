"""What sits on a training loop: ``Checkpointer`` (periodic saves, preemption, retention) and
``TieredCheckpointer`` (a fast local tier uploaded to a slower one).

``checkpointer`` and ``tiers`` are the two; ``retention`` is the one rule both use to delete old
committed steps; ``tier`` describes one tier and lists its steps; ``mirror`` copies a committed
checkpoint from one storage to another. The ``Checkpointer``'s own parts: ``options`` (its
validated arguments), ``steps`` (its root's step directories: listing, retention, replacing a
committed step), ``resume`` (loading on every rank, falling back past steps that do not load),
``summary`` (its line per save). ``peers`` copies each rank's files of a step to a rank on
another node in the background and gives them back at a restart that lost a node (``peer_ring``:
who keeps whose replica; ``peer_wire``: the transfer over gloo; ``peer_replicas``: the replica
directories and their completion marker).
May import: ``save``, ``load``, ``storage`` and the leaves.
"""
