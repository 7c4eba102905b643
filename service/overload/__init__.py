"""What a caller may cost: a request's limits, admission under load (response budget, heavy lane), and memory handed
back."""
