"""Benchmarks, one stack:

* :mod:`.common` -- the torch-free library every benchmark uses (sizes, machine info, git
  commit, versions, page-cache eviction, per-operation meter, child-process runner, fio,
  interleaving, medians, tables, JSON), shared with the scripts in benchmarks/;
* :mod:`.state` -- the synthetic model + Adam state they save, and the torch.save / DCP
  contenders;
  (:mod:`.fio` and :mod:`.stats` are its parts for fio and for results);
* :mod:`.storage` -- ``fastckpt bench TARGET`` (the ranks' measurements), :mod:`.report` --
  its report, grace window and chart;
* :mod:`.record` -- the record it leaves in a root for the engine (:func:`read_bench`).

Importing this package imports neither torch nor the engine.
"""

from .record import read_bench

__all__ = ["read_bench"]
