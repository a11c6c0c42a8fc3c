"""The load path: ``DataStatesReader``, a DCP ``StorageReader`` that verifies every checksum.

``reader`` (the DCP calls) -> ``fetch`` (raw data regions straight into the targets, in
parallel on ``read_pool``, through ``bounce`` buffers where the target cannot take them) ->
``checksum`` (crc32c as bytes arrive). ``locate`` finds data inside stock records,
``object_records`` loads small pickled records fast, ``decode`` decodes stock stream transforms
and sets loaded objects, ``safety`` refuses what it must not unpickle, ``step_dirs`` names the
step to open in a directory of checkpoints (the CLI's answer too).
May import: ``snapshot.cow`` (a load into a tensor whose save is in flight copies it first),
``storage`` and the leaves. Never ``save``.
"""
