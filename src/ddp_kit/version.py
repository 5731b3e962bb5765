"""The version of ddp_kit, in a module of its own: the modules that record it (checkpoint meta,
metrics, the startup agreement) import it from here, not from the package above them."""
__version__ = "0.1.0"
