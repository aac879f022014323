"""`specfleet up`: one SpecDecodeDeployment's whole fleet on this machine (Redis, the stable and
canary workers, the router, the control loop), all on loopback. Torch-free itself: the workers
are processes of their own."""
