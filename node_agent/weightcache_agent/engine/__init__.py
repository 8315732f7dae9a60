"""The reference engine and the demo: a small Llama-style model served over HTTP.

`model` is the model (built on the meta device, weights attached); `server` runs it behind
`/generate` and `/healthz`, attaching through `client`; `main` is `weightcache engine`;
`demo` is `weightcache demo`, which starts an agent and two engines through
`serve.process_group` and times a disk load, an attach and a failover.

May import: everything below it (base, `arena`, `load`, `client`, `serve`, `testing`).
Nothing imports it except the command line.
"""
