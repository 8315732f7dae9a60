"""The node agent: loads a cache once and serves it to every engine on the node.

`agent` is one worker (one GPU, one socket): it loads or re-adopts the arena, answers
`status`, `attach`, `rejoin` and `detach`, keeps one lease per engine connection and
promotes a standby when its primary's connection drops. It is a façade over single-job
parts, each handed what it needs and none importing it: `connections` (accept, bounds,
routing), `handlers` (one per request type), `lease` and `lease_book`, `promotion` and
`rank_group`, `arena_holder` (fill sources in `fill_sources`, lifecycle in `phase`),
`arena_guard` (digest and scrub), `restart_state` (what the next agent reads), `status`. `supervisor` runs one worker per
GPU on a node and serves HTTP health, status and Prometheus metrics (`agent_http`);
`process_group` starts and stops child processes; `agent_main` and `status_cli` are the
`weightcache agent` and `weightcache status` entry points. `access` decides who may use a
socket (modes, peer credentials, the private state file); `stop` is the signal-safe stop
request every main loop waits on (the engine's too).

May import: the base modules, `arena` and `load`. Never `client`, `engine` or `testing`
(the status request it shares with engines is in `protocol`).
"""
