"""Test support shipped with fastckpt: fault injection as a Storage wrapper (:mod:`.faults`)."""
