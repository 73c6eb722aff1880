"""llama-trio: an OpenAI-compatible server on llama.cpp (via ``ffi``), Quart-Trio and Hypercorn."""
