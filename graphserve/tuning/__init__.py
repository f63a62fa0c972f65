"""`graphserve tune`: the per-card tables (kernels/tables.py says where they are read from)."""
