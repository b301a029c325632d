"""One adapter package per library, installed as `bridge.adapters`.

`linen`, `nnx`, `equinox`, `haiku`, `torch`: each imports its own library and
is imported only when a model of that library is probed. Each names the same
role the same way: `probe` (the `ProbeBase` subclass and its factory),
`porting` (its side of `transfer`/`compare`), `transforms` (sites inside the
library's lifted transforms), `internals` (the library's private API, checked
against the supported versions), `guest` (its modules called inside another
library's model). `shared` holds what several of them use.
"""
