"""The training engine. Importing it sets TensorFlow's process defaults.

`TF_ENABLE_ONEDNN_OPTS` defaults to 0 here, before any module imports
TensorFlow (it is read once, at TF's import). TF 2.21 turns its oneDNN graph
rewrites on by default on CPUs with AVX-512 (VNNI/BF16); there, graphs with
several replicas fail or go wrong: "input depth must be evenly divisible by
filter depth: 3 vs 16" on a replica's first convolution with a partial
batch, and sync-BatchNorm losses that differ between 1 and 2 replicas
(tests/test_partial_batch.py, tests/test_comm.py; all pass with it off). Set
the variable yourself (to 1) to have TF's choice back.
"""
import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
