"""Hardware as data: devices, links, topologies and routing (no torch; DESIGN.md layers)."""
