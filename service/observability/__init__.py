"""What the service says about itself: metrics (and the lock-free per-call ones), logs and request ids, traces, the
version."""
