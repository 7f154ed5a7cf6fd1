"""kmp on Keras' TensorFlow backend: the modules `kmp.backends.get` returns there."""
