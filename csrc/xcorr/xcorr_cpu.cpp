// Streaming cross-correlation accumulation on the CPU (to be written).
