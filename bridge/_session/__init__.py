"""The session: the bookkeeping of one trace of the model.

`context` (a leaf: the active session and the probe's `inside`), `session`
(the facade an adapter reports calls to) and its parts, each given what it
needs at construction and none holding the session: `naming`, `recorders`,
`taps`. Beside them: `sites` (the `Site` record and array
helpers), `inside` (assignments as sites), `computation` (sites read from
the jaxpr) and `liveness` (which calls the computation keeps).
"""
