"""The native CPU kernels (C through ctypes, `native`) and the packed float32 linears
built on them (`dense`): a library that model layers, quantizers and attention
backends call through their public functions; it registers nothing itself."""
