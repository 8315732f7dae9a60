"""The engine side: what an inference engine imports to attach to an agent's weights.

`session.attach` connects to the agent's socket, checks the fingerprint, receives the
arena fds and manifest, maps them read-only and hands them to `rebind`, which points the
model's own parameters at the mapped views (with the `_bindfast` C loop when built). The
connection then is the lease, and a `promote` message arrives on it. `warmup.prepare` pays
the once-per-process costs of that path at engine start, so the first attach is a later one.

May import: the base modules (`protocol`, `errors`, `spec`), `arena` (to map what the
agent sends) and `load` (fingerprint fields, and the in-process loader for `off` mode and
the disk fallback). Never `serve`, `engine` or `testing`; never kopf or kubernetes.
"""
