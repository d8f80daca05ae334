"""Kubernetes nodes: the CRI image-service proxy kubelet's
`--image-service-endpoint` points at (proxy.py), forwarding every
`runtime.v1.ImageService` call to containerd's CRI plugin and keeping the
registry credentials of each PullImage (credentials.py) for the lazy fetches
of the snapshotter and the layer server; its `[cri]` settings (settings.py).
See docs/kubernetes.md."""
