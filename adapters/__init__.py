"""One adapter per library, installed as `bridge.adapters`.

Each module imports its own library; none is imported until a model of that
library is probed.
"""
