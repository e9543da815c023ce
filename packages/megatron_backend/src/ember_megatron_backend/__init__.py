"""Ember training backend on megatron-core: model provider, weight mapping, forward passes.

Submodules are imported on demand (``ember_megatron_backend.model``, ``.weights``, ...), so
importing the package itself does not import megatron-core.
"""
