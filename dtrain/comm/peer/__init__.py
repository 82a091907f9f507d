"""The peer-memory layer: windows of CUDA symmetric memory (:mod:`.window`), the pull and push plans compiled from a
schedule (:mod:`.pull`, :mod:`.push`; these two import no torch), fused copy-reduce kernels (:mod:`.kernels`,
:mod:`.triton`), CUDA graphs of calls (:mod:`.graphs`) and the watchdog that reports a stalled barrier
(:mod:`.watchdog`)."""
