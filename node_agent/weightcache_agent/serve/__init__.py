"""The node agent: loads a cache once and serves it to every engine on the node.

`agent` is one worker (one GPU, one socket): it loads or re-adopts the arena, answers
`status`, `attach`, `rejoin` and `detach`, keeps one lease per engine connection and
promotes a standby when its primary's connection drops. `supervisor` runs one worker per
GPU on a node and serves HTTP health, status and Prometheus metrics (`agent_http`);
`process_group` starts and stops child processes; `agent_main` and `status_cli` are the
`weightcache agent` and `weightcache status` entry points. `access` decides who may use a
socket (modes, peer credentials, the private state file); `stop` is the signal-safe stop
request every main loop waits on (the engine's too).

May import: the base modules, `arena` and `load`. Never `client`, `engine` or `testing`
(the status request it shares with engines is in `protocol`).
"""
