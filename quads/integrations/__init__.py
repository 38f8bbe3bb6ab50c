"""Adapters that bring quads' recipes into RL frameworks (``quads.integrations.verl``).

Each adapter imports its framework lazily and is optional: ``pip install quads[<framework>]``.
"""
