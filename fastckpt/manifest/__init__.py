"""The on-disk format, torch-free: what a step is, what its manifest says, and how to check it.

* :mod:`.schema` -- names and layout constants, the manifest's encoding, checksum and
  field-by-field validation (a manifest is untrusted input);
* :mod:`.values` -- the JSON skeleton of a state's plain values (tags, encode/decode);
* :mod:`.discovery` -- listing steps, reading a manifest, finding the newest committed step
  safely next to a writer, in-flight markers;
* :mod:`.verify` -- re-reading shard files against their manifest.

Used by the engine, the DCP reader, retention and every command-line tool; imports nothing of
torch, so the tools start in a fraction of a second.
"""
