// amx kernels
