"""Keras' own tests, ported to kmp: what Keras users already run, in our CI.

Each file restates the scenarios and expected numbers of one Keras test file
(keras-team/keras, named in the file's docstring) on kmp's classes, keeping
each test's name. A failure here is a regression whatever kmp's own tests
say. tests/conftest.py runs the backend-agnostic files in the JAX pass too
(`PEERS_JAX_TESTS`).
"""
