"""The services every run has, one file each: the run ledger (run_ledger.py), the experiment trackers
(trackers.py) and the memory tier (memory_tier.py). Each declares `SERVICE`; ddp_kit/service_registry.py
names them, and the step boundary knows none of them by name."""
