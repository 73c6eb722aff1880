"""Sockets and process lifetime: the listener, one connection's transport (timeouts, drain,
close order, unframed writes), and the lifecycle that serves, drains and stops."""
