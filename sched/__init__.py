"""CPU planning for FEPLB, numpy only (imported as ``feplb.sched``)."""
