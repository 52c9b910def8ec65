"""The cluster: Ray Serve deployments of the gateway and engine replicas, the shared admin
state they reconcile against, and `coxswain up` / `down` for a local cluster."""
