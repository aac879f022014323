"""Wire limits and defaults, in one home (torch-free).

Every bound the API, the router, the worker, the control loop and the CRD share lives here, and
every copy elsewhere imports it (the CRD's schema is YAML: a test checks its numbers against these).
"""

from __future__ import annotations

#: The most draft tokens one speculative step may propose (speculation.kMax's upper bound).
K_LIMIT = 32
