"""What the two HTTP benchmarks (``bench.serving``, ``bench.chats``) share, one job a module:
``client`` (a small HTTP/1.1 + SSE load client), ``servers`` (each side's command for one shape,
launching, readiness and stopping), ``workload`` (the serving benchmark's requests and the
``Session`` that sends them), ``measures`` (its measurements and the waits for a quiet machine),
``report`` (per-metric summaries and tables) and ``charts``.

One copy of each; a benchmark imports what it needs by its public name. Nothing here imports a
benchmark's entry module.
"""
