"""Tensor and expert parallelism: process groups (state.py), the forward's collectives (comm.py) and the
one-shot all-reduce over peer memory used for small messages on CUDA (custom_all_reduce.py)."""
