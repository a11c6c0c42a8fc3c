"""What sits on a training loop: ``Checkpointer`` (periodic saves, preemption, retention) and
``TieredCheckpointer`` (a fast local tier uploaded to a slower one).

May import: ``save``, ``load``, ``storage`` and the leaves.
"""
