"""Callers of the server, not part of it: what tests, benchmarks and `realtime-omni call` use to
talk to a running gateway the way a browser, an app or a phone provider would."""
