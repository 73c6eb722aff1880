"""The models a server serves: ``specs`` (which, from the command line, a folder and a presets
file), ``runtime`` (one load of one model: its engine, embedder and grammar compiler),
``registry`` (load on demand, leases, unload for room or when idle, never from under a request)
and ``policy`` (pure: which models to unload)."""
