"""containerd API definitions (.proto sources) and their generated Python stubs (`make proto`)."""
