"""Hand-offs to the engine around a run, one file each: what ddp_kit gives back to it (metrics) when
it is present, found without importing it when it is not (ray.py: Ray Train)."""
