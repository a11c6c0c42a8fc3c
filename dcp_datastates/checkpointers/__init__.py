"""What sits on a training loop: ``Checkpointer`` (periodic saves, preemption, retention) and
``TieredCheckpointer`` (a fast local tier uploaded to a slower one).

``checkpointer`` and ``tiers`` are the two; ``retention`` is the one rule both use to delete old
committed steps; ``tier`` describes one tier and lists its steps; ``mirror`` copies a committed
checkpoint from one storage to another.
May import: ``save``, ``load``, ``storage`` and the leaves.
"""
