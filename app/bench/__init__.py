"""`ft bench`: reproducible speed measurements over HTTP against any OpenAI-compatible server.

Modules: client (one streamed request, exact timings), target (what the server says about
itself; fluxtide's admin API), hardware (the host profile), figures (per-request and per-round
numbers), record (the JSON record), the runs (sweep, ladder, probe, prefill, mixed, turns, cold_start, smoke),
view (rich tables), plot (matplotlib) and cli (the `ft bench` parser).
"""
