"""The transport: our listening socket (``listener``) and one connection's transport
(``connection``: timeouts, half-close, drain, close order, bounded writes and the framing of a
body chunk). Knows no app, no engine and no process lifetime."""
