// CUDA bvn kernels (to be written).
