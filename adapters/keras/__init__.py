"""Keras 3 on the JAX backend: each layer's call, reached by the layer itself.

`probe.probe` is what the registry imports. This package imports nothing, so
that `not_keras_3` refuses a Keras 2 (`tf.keras`) model without importing
Keras (where Keras 2 is installed, `import keras` is Keras 2).
"""
