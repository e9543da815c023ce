"""Ember training backend on megatron-core: models, weight mapping, scoring, training, checkpoints.

Submodules are imported on demand (``ember_megatron_backend.model``, ``.weights``, ...), so
importing the package itself does not import megatron-core.
"""
