"""KubeRay v1.7.0: its RayCluster CRD (vendored) and a validator of objects against it."""
