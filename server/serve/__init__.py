"""The process: the composition root that builds the app, the engine and the listener and runs
them (``lifecycle``), its hot restart (``restart``) and systemd notifications (``sdnotify``)."""
