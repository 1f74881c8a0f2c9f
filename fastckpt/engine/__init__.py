"""The engine (needs torch): planning, staging, writing and committing a save, and loading.

* :mod:`.core` -- ``Engine``: save and load for one root, and the narrow interface the
  preemption trigger uses;
* :mod:`.plan` -- the save plan agreed by every rank;
* :mod:`.state` -- walking the user's state (modules, optimizers, Stateful objects, tensors);
* :mod:`.staging` -- shard files (pieces) and the reusable staging pool;
* :mod:`.device` -- CUDA staging (pinned buffers, side stream, events);
* :mod:`.writer` -- the background writer and the commit's place in it;
* :mod:`.commit` -- the cross-rank commit protocol (one function, one deadline);
* :mod:`.load`, :mod:`.reader` -- loading through DCP's planner and a ``StorageReader``;
* :mod:`.dist` -- the only user of ``torch.distributed``.
"""
