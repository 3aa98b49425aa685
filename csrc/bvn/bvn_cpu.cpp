// Birkhoff-von Neumann decomposition on the CPU (to be written).
