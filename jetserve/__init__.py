"""jetserve: run an LLM on an NVIDIA Jetson and keep a fleet of them healthy."""

__version__ = "0.1.0"

DEMO_MODEL = "demo"  # `LLM(model="demo")`, `jetserve serve --model demo`: the bundled demo, from any directory


def demo_model_dir():
    """Where the bundled demo model lies in this install."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "demo")
