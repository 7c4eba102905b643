"""What computes the answers: the backends (numpy, the compiled fast path, Triton, auto), the devices, the warmup and
readiness."""
