"""Quantized weights: the config a checkpoint or ``--quantization`` selects, and the layer methods."""
