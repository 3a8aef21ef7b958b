"""Engines other than the torch one, fed from the same resolved EngineConfig."""
