"""The point-to-point layer: a schedule run round by round as torch.distributed messages (:mod:`.runtime`) over a
:class:`~dtrain.comm.p2p.transport.Transport` (:mod:`.transport`)."""
