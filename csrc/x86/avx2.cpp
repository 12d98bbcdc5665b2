// avx2 kernels
