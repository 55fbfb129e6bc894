"""Gateway tests: limiter (memory and a real Redis), faults, config, routing, end to end."""
