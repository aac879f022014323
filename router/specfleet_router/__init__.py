"""specfleet's router: an OpenAI-compatible front door (and the worker's gRPC API) that classifies
each request, splits stable and canary arms per request, routes to a draft method and balances
over worker pools. Torch-free."""
