"""The schedule layer: collectives as data (:mod:`.schedule`), the algorithms that build them (:mod:`.algorithms`),
the symbolic checker (:mod:`.check`) and per-rank round plans (:mod:`.plan`). Imports no torch."""
