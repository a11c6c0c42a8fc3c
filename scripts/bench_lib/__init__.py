"""The benchmark suite behind ``scripts/bench.py``: one module per scenario, plus the shared parts.

common.py    JSON lines, machine description, medians and spread, page cache, peak RSS
state.py     the transformer-shaped state (parameters, Adam moments, Python objects)
systems.py   the save systems compared: stock DCP and ours, each timed the same way
limits.py    disk write+fsync, cold/warm read, memcpy (and pinned device->host) bandwidth
disk_limit.py  the disk's write limit as the best of a sweep of write patterns; durable targets
save.py      the save scenario: one subprocess per system and round
load.py      stock FileSystemReader vs DataStatesReader, cold and warm page cache
train.py     a small transformer trained with a checkpoint every K steps
timeline.py  the PNG timeline of the training runs
scaling.py   cost against state size and tensor count
ranks.py     the save scenario on two gloo ranks
report.py    summary tables, ratios and targets (met / MISSED / limited)
objstore.py  S3 on loopback (moto): stock Fsspec vs ours, and the tiered save (named only)
coop.py      four gloo ranks load a replicated state: bytes read and time, cooperative or not
             (named only: coopload)
"""
