"""specfleet's Kubernetes operator: SpecDecodeDeployment in, worker fleet out.

Pure modules (spec, manifests, status; the loop in specfleet_control) hold the logic; handlers glue them to kopf.
Nothing here imports torch: the operator image stays small and starts fast.
"""

GROUP = "serving.specfleet.dev"
VERSION = "v1alpha1"
PLURAL = "specdecodedeployments"
KIND = "SpecDecodeDeployment"
API_VERSION = f"{GROUP}/{VERSION}"
