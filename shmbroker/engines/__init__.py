"""Engine adapters. `sim` is the CPU cost model; real engines come with their extras."""
