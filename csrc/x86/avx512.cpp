// avx512 kernels
