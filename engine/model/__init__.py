"""The model: Qwen3 (+MTP) modules, their kernels and attention, and the checkpoint loader."""
