// CUDA lap kernels (to be written).
