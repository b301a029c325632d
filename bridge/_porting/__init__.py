"""Porting: a model moved from one library to another, and checked.

`contract` (what porting needs of a probe and its adapter: `PortableProbe`,
`PortingSide`), `transfer` (weights by layer, through each adapter's
`PortingSide`), `pairing` (which layer of one model is which of the other),
`layer_kinds` and `hyperparameters` (what a layer is and how it is
configured), `compare` (the layer-by-layer check) and `report` (what it
returns). Porting sees a probe only through the contract.
"""
