"""realtime-omni: a staged, streaming, abortable runtime for real-time omni models."""

__version__ = "0.1.0"
