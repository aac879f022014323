"""`specfleet up`: one SpecDecodeDeployment's whole fleet on this machine (Redis, the stable and
canary workers, the router), all on loopback, and `specfleet status` to look at it (docs/local.md).
Torch-free itself: the workers are processes of their own. The control loop plugs into
`state.StateWriter`."""
