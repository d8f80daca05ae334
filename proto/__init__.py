"""API definitions as .proto sources (containerd's services and types, the CRI
subset kubelet speaks) and their generated Python stubs (`make proto`)."""
