"""kmp on Keras' JAX backend: the modules `kmp.backends.get` returns there."""
