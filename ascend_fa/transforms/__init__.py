"""Offline, exact transforms of a float model that make it easier to quantize.

Each module folds seeded or layer-locally decided matrices into the weights, so the
float model computes the same function and the device runs its usual kernels.
"""
