"""jetserve: run an LLM on an NVIDIA Jetson and keep a fleet of them healthy."""

__version__ = "0.1.0"
