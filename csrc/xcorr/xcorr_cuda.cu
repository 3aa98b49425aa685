// CUDA xcorr kernels (to be written).
