"""Where compiled code comes from: the warm-start cache and its keys, precompiled regions, and the
background compiler that makes them in a helper process.

Depends on torch, kiln.plugins and the compile package's leaf modules (isa_probe, messages, progress, and backend's `resolve_backend`) only;
never on what gets compiled (kiln.compile.regions, groups, backend, monitor, report, session),
which imports from here, nor on the facade or a strategy.
"""
