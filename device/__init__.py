"""Device facts, read under a sysroot: JetPack/L4T, identity, sensors and the compatibility gate.

The agent reports them and the inference service asks the gate at start, so they live here,
apart from both. Python 3.8 (the agent runs there).
"""
