"""Offline tools, apart from the runtime: demo-model training, MTP heads (fit, merge, inspect), export."""
